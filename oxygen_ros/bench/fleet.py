"""`python -m oxygen_ros.bench --robots N`: N robots on ONE engine (`fleet.batched`) against the same load
on N separate single-robot engines (`fleet.separate`), in one process, on the same weights.

The load, identical for both: every round, each robot's camera delivers its next frame (seeded synthetic
frames, a different stream per robot) and submits its requests (the `--arrival` pattern, per robot, owner =
the robot); greedy replies of exactly --reply-tokens tokens; a fixed decode budget of --tokens-per-frame
steps per cycle. The cameras are as fast as the engines can serve (a saturated load): a round ends when
every robot has its chunk, so the per-robot action rate is horizon / round time.

- batched: one `Engine` with robots r0..r{N-1}; a round is one `run_frames` cycle: the N frames prefill in
  one forward, their chunks denoise together, every robot's replies share one decode batch.
- separate: N engines, one per robot, run one after another in the same thread (each round: engine 0's
  cycle, engine 1's, ...), i.e. N engines time-sharing one device; each with the same torch threads.
  Each separate engine gets --kv-budget-mb, the batched engine N times that (the same memory).

Deadlines: a robot's frame arrives at the start of its round; its chunk misses when it is ready more than
the frame period (horizon / --action-rate-hz) later (a separate engine's robot also waits for the engines
before it in the round). After the last round, decode-only cycles finish the replies (counted in the
total time, as in the main benchmark). Repetitions interleave the settings, alternating which runs first.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.requests import TextRequest
from oxygen_ros.robot.policy_io import RobotIOConfig

from .harness import REQUEST_TIMEOUT_S
from .workload import make_workload

ACTION_TOL = 2e-5     # batched vs separate chunks (float32: batched GEMMs round differently; test_fleet_engine.py)


@dataclass
class FleetRun:
    rounds_s: list = field(default_factory=list)         # wall time of each frame round
    parts_s: dict = field(default_factory=lambda: {"prefill": 0.0, "actions": 0.0, "admit": 0.0, "decode": 0.0})
    latency_s: dict = field(default_factory=dict)        # robot -> chunk latencies from its round's start
    chunks: dict = field(default_factory=dict)           # robot -> chunks delivered
    actions: dict = field(default_factory=dict)          # (robot, frame) -> model actions
    replies: list = field(default_factory=list)          # (robot, request index, Reply)
    batch_sizes: list = field(default_factory=list)
    total_s: float = 0.0


def robot_names(n: int) -> list[str]:
    return [f"r{k}" for k in range(n)]


def make_loads(n: int, a, cfg) -> dict:
    """Per robot: its own seeded frames, noise and arrival schedule (the same for both settings)."""
    common = dict(robot=a.robot, arrival=a.arrival, denoise_steps=a.denoise_steps, budget="fixed",
                  tokens_per_frame=a.tokens_per_frame, action_rate_hz=a.action_rate_hz, seed=a.seed,
                  action_horizon=cfg.action_horizon, action_dim=cfg.action_dim, prompt=a.prompt,
                  question=a.question, reply_tokens=a.reply_tokens)
    return {r: make_workload(frames=a.frames, offset=1000 + k, **common) for k, r in enumerate(robot_names(n))}


def engine_config(a) -> EngineConfig:
    return EngineConfig(policy="oxygen", decode_budget="fixed", tokens_per_frame=a.tokens_per_frame,
                        action_rate_hz=a.action_rate_hz, denoise_steps=a.denoise_steps, ignore_eos=True,
                        max_active_requests=a.max_batch, max_queued_requests=max(64, 4 * a.max_batch),
                        max_queued_per_owner=max(64, 4 * a.max_batch),
                        max_tokens_limit=max(256, a.reply_tokens), seed=a.seed, max_timeout_s=REQUEST_TIMEOUT_S,
                        cuda_graphs=False if a.no_cuda_graphs else None)


def build(model, n: int, a) -> tuple:
    """(the batched engine, {robot: its separate engine})."""
    from oxygen_ros.engine.factory import build_engine

    names = robot_names(n)
    kw = dict(built_model=model, engine=engine_config(a), checkpoint=a.checkpoint, tokenizer=a.tokenizer)
    batched = build_engine(robots={r: RobotIOConfig() for r in names}, kv_budget_mb=n * a.kv_budget_mb, **kw)
    separate = {r: build_engine(kv_budget_mb=a.kv_budget_mb, **kw) for r in names}
    return batched, separate


class ChunkClock:
    """Listens to every chunk of a set of engines: when it came (from the start of its round) and for whom.
    `run` and `round_start` are set by the driver; a separate engine's robot "" is named by `alias`."""

    def __init__(self, engines: dict):
        self.run: FleetRun | None = None
        self.round_start = 0.0
        for name, e in engines.items():
            e.add_chunk_listener(lambda c, name=name: self._on_chunk(name if c.robot == "" else c.robot))

    def _on_chunk(self, robot: str) -> None:
        if self.run is not None:
            self.run.latency_s.setdefault(robot, []).append(time.perf_counter() - self.round_start)
            self.run.chunks[robot] = self.run.chunks.get(robot, 0) + 1


def run_batched(engine, clock: ChunkClock, loads: dict, frames: int) -> FleetRun:
    run = clock.run = FleetRun()
    handles = []
    t0 = time.perf_counter()
    for i in range(frames):
        start = clock.round_start = time.perf_counter()
        for r, wl in loads.items():
            handles += [(r, len(handles), engine.submit(TextRequest(wl.question, max_tokens=wl.reply_tokens,
                                                                    timeout_s=REQUEST_TIMEOUT_S, owner=r)))
                        for _ in range(wl.schedule[i])]
        report = engine.run_frames({r: wl.observations[i] for r, wl in loads.items()},
                                   {r: wl.noise[i] for r, wl in loads.items()})
        _check(report, list(loads), "batched", i)
        run.rounds_s.append(time.perf_counter() - start)
        _add_parts(run, [report])
        for r in loads:
            run.actions[(r, i)] = np.array(engine.latest_chunk(r).model_actions, copy=True)
    while engine.active_requests or engine.queued_requests:
        _add_parts(run, [engine.run_frames()])
    run.total_s = time.perf_counter() - t0
    run.replies = [(r, k, h.result(60)) for r, k, h in handles]
    return run


def run_separate(engines: dict, clock: ChunkClock, loads: dict, frames: int) -> FleetRun:
    run = clock.run = FleetRun()
    handles = []
    t0 = time.perf_counter()
    for i in range(frames):
        start = clock.round_start = time.perf_counter()
        reports = []
        for r, engine in engines.items():
            wl = loads[r]
            handles += [(r, len(handles), engine.submit(TextRequest(wl.question, max_tokens=wl.reply_tokens,
                                                                    timeout_s=REQUEST_TIMEOUT_S)))
                        for _ in range(wl.schedule[i])]
            report = engine.run_cycle(wl.observations[i], wl.noise[i])
            _check(report, [""], f"separate {r}", i)
            reports.append(report)
            run.actions[(r, i)] = np.array(engine.latest_chunk().model_actions, copy=True)
        run.rounds_s.append(time.perf_counter() - start)
        _add_parts(run, reports)
    while any(e.active_requests or e.queued_requests for e in engines.values()):
        _add_parts(run, [e.run_cycle(None) for e in engines.values() if e.active_requests or e.queued_requests])
    run.total_s = time.perf_counter() - t0
    run.replies = [(r, k, h.result(60)) for r, k, h in handles]
    return run


def _check(report, robots: list, label: str, frame: int) -> None:
    if report.fault or report.robots != robots:
        raise RuntimeError(f"{label}: round {frame} delivered chunks for {report.robots}, not {robots} "
                           f"({report.fault or 'no fault'})")


def _add_parts(run: FleetRun, reports: list) -> None:
    for rep in reports:
        run.parts_s["prefill"] += rep.prefill_s
        run.parts_s["actions"] += rep.action_s
        run.parts_s["admit"] += rep.admit_s
        run.parts_s["decode"] += rep.decode_s
        run.batch_sizes += rep.batch_sizes


def summarize(runs: list[FleetRun], robots: list[str], horizon: int, frame_period: float) -> dict:
    """One setting over its repetitions."""
    rounds = np.array([s for run in runs for s in run.rounds_s])
    frame_s = float(rounds.sum())
    hz_all = [horizon * sum(run.chunks.get(r, 0) for run in runs) / frame_s for r in robots]
    latency = {r: np.array([x for run in runs for x in run.latency_s.get(r, [])]) for r in robots}
    tokens = sum(len(rep.tokens) for run in runs for _, _, rep in run.replies)
    total = sum(run.total_s for run in runs)
    n_rounds = len(rounds)
    batches = [b for run in runs for b in run.batch_sizes]
    return {
        "robots": len(robots),
        "per_robot_action_hz": min(hz_all),
        "per_robot_action_hz_all": hz_all,
        "aggregate_tokens_per_s": tokens / total if total > 0 else 0.0,
        "aggregate_action_hz": sum(hz_all),
        "deadline_misses": int(sum((latency[r] > frame_period).sum() for r in robots)),
        "chunks": {r: int(sum(run.chunks.get(r, 0) for run in runs)) for r in robots},
        "round_ms_mean": 1e3 * float(rounds.mean()), "round_ms_p50": 1e3 * float(np.percentile(rounds, 50)),
        "round_ms_p99": 1e3 * float(np.percentile(rounds, 99)),
        "round_ms_per_robot": 1e3 * float(rounds.mean()) / len(robots),
        "chunk_latency_ms_mean": {r: 1e3 * float(latency[r].mean()) for r in robots},
        "chunk_latency_ms_p99": {r: 1e3 * float(np.percentile(latency[r], 99)) for r in robots},
        "breakdown_ms_per_round": {k: 1e3 * sum(run.parts_s[k] for run in runs) / n_rounds
                                   for k in runs[0].parts_s},
        "tokens": tokens, "total_s": total, "frame_rounds": n_rounds,
        "avg_decode_batch": float(np.mean(batches)) if batches else 0.0,
        "replies_failed": sum(not rep.success for run in runs for _, _, rep in run.replies),
    }


def equivalence(batched: FleetRun, separate: FleetRun) -> dict:
    diff = max(float(np.abs(batched.actions[k].astype(np.float64) - separate.actions[k]).max())
               for k in batched.actions)
    sep = {(r, k): rep.tokens for r, k, rep in separate.replies}
    same = sum(rep.tokens == sep[(r, k)] for r, k, rep in batched.replies)
    return {"max_action_diff": diff, "action_tolerance": ACTION_TOL, "actions_within_tolerance": diff <= ACTION_TOL,
            "replies_identical": same, "replies_compared": len(batched.replies)}


def run_fleet(model, cfg, a, n: int, log) -> dict:
    """Both settings for N robots: warm-up, then --repeat repetitions interleaved (batched, separate;
    separate, batched; ...)."""
    robots = robot_names(n)
    loads = make_loads(n, a, cfg)
    batched, separate = build(model, n, a)
    clocks = {"batched": ChunkClock({"": batched}), "separate": ChunkClock(separate)}
    frame_period = batched.frame_period
    if a.warmup_frames:
        warm = {r: make_workload(robot=a.robot, frames=a.warmup_frames, arrival="every",
                                 reply_tokens=a.reply_tokens, denoise_steps=a.denoise_steps, budget="fixed",
                                 tokens_per_frame=a.tokens_per_frame, action_rate_hz=a.action_rate_hz,
                                 seed=a.seed, action_horizon=cfg.action_horizon, action_dim=cfg.action_dim,
                                 prompt=a.prompt, question=a.question, offset=1) for r in robots}
        run_batched(batched, clocks["batched"], warm, a.warmup_frames)
        run_separate(separate, clocks["separate"], warm, a.warmup_frames)
    runs = {"batched": [], "separate": []}
    for rep in range(a.repeat):                 # the order alternates: neither always runs first
        for name in (("batched", "separate") if rep % 2 == 0 else ("separate", "batched")):
            if name == "batched":
                runs[name].append(run_batched(batched, clocks[name], loads, a.frames))
            else:
                runs[name].append(run_separate(separate, clocks[name], loads, a.frames))
        log(f"robots {n} rep {rep + 1}/{a.repeat}: batched {runs['batched'][-1].total_s:.2f} s, "
            f"separate {runs['separate'][-1].total_s:.2f} s")
    out = {k: summarize(v, robots, cfg.action_horizon, frame_period) for k, v in runs.items()}
    b, s = out["batched"], out["separate"]
    out["speedup"] = {"aggregate_tokens_per_s": b["aggregate_tokens_per_s"] / s["aggregate_tokens_per_s"]
                      if s["aggregate_tokens_per_s"] else None,
                      "per_robot_action_hz": b["per_robot_action_hz"] / s["per_robot_action_hz"]
                      if s["per_robot_action_hz"] else None,
                      "total_time": s["total_s"] / b["total_s"] if b["total_s"] else None}
    out["equivalence"] = equivalence(runs["batched"][0], runs["separate"][0])
    out["pool_empty_at_end"] = all(e.stats.snapshot()["pool_blocks_used"] == 0
                                   for e in [batched, *separate.values()])
    out["engine_robot_stats"] = batched.stats.snapshot()["robots"]
    out["frame_period_s"] = frame_period
    return out


def table(fleet: dict, scaling: list) -> str:
    lines = ["", "Fleet: N robots on one engine (batched) vs N single-robot engines one after another (separate)"]
    head = (f"{'N':>3} {'setting':<9} {'round ms':>9} {'robot Hz':>9} {'tok/s':>8} {'misses':>7} {'prefill':>8} "
            f"{'actions':>8} {'decode':>8} {'batch':>6} {'x tok/s':>8}")
    lines += [head, "-" * len(head)]
    for point in scaling:
        for name in ("batched", "separate"):
            s = point[name]
            b = s["breakdown_ms_per_round"]
            sp = point["speedup"]["aggregate_tokens_per_s"] if name == "batched" else 1.0
            lines.append(f"{point['robots']:>3} {name:<9} {s['round_ms_mean']:>9.1f} {s['per_robot_action_hz']:>9.2f} "
                         f"{s['aggregate_tokens_per_s']:>8.2f} {s['deadline_misses']:>7} {b['prefill']:>8.1f} "
                         f"{b['actions']:>8.1f} {b['decode']:>8.1f} {s['avg_decode_batch']:>6.2f} "
                         f"{'x%.2f' % sp if sp else '-':>8}")
        eq = point["equivalence"]
        lines.append(f"    batched vs separate: max |action diff| {eq['max_action_diff']:.2g} "
                     f"(tolerance {eq['action_tolerance']:g}), replies identical {eq['replies_identical']}/"
                     f"{eq['replies_compared']}, KV pools empty at the end: {point['pool_empty_at_end']}")
    return "\n".join(lines)
