"""`python -m oxygen_ros.bench.hierarchy`: hierarchical π0.5 (pi052 formats) served two ways, on the same
random-weight checkpoint, the same frames and the same noise, in real time on this machine:

(a) serial, as LeRobot's language runtime schedules it (branch codex/pi052-language-policy at f2c8867,
    `src/lerobot/runtime/language_runtime.py`: `_run_tick` -> `maybe_update_language_state` ->
    `maybe_enqueue_action_chunk`; the texts from `src/lerobot/runtime/adapter.py` `PI052PolicyAdapter`): one
    thread; the robot plays its queued chunk at the control rate; only when the queue is empty does the
    runtime compute: the subtask when the 1 Hz gate is due, then, if it changed, the progress memory, each a
    prefill of its own (images + its messages; the vision tower and the whole prefix re-run) and a greedy
    decode; then a new observation's chunk on a prefill of its own (the action prompt; joint recipe: the
    prompt and the subtask in the branch's three attention blocks, `Serial.chunk`); the whole chunk is
    queued. The robot gets no command while any of that runs.
(b) the engine (tasks/hierarchy.py): the camera sends a frame every chunk period; every frame is prefilled
    once, its chunk delivered first, and the texts are language requests decoded in the time the cycles
    have left; the robot plays the newest chunk from its row for now.

Both run on one thread on a simulated clock that every model operation advances by its measured duration
(`timed`): the schedules see this machine's real costs, while other processes sharing the CPU cannot stall
one schedule's timeline and not the other's. The control rate is calibrated (chunk period = twice the
measured hierarchy-off cycle) unless given.

Measured at the robot (a simulated 1-D timeline from the measured compute times and delivery times): command
rate, largest gap between commands, age of the chunk being executed (command time - its observation's
stamp); subtask and memory latency (serial: the text's compute; engine: submitted -> finished); language
tokens/s; the engine's frames whose actions needed an own prefill (joint recipe: a subtask whose first piece
has no leading space). Then the engine with hierarchy off vs on on the same frames: median cycle (target:
within 10%) and chunks late because of language (a chunk is late when delivered after its deadline; target 0
more than off).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.factory import build_engine, build_model, model_config
from oxygen_ros.model import inference, pi052
from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.robot.policy_io import RobotIOConfig

from .workload import make_workload

TASK = "put the cups away"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oxygen_ros.bench.hierarchy", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=("tiny", "bench"), default="tiny")
    p.add_argument("--format", choices=("joint", "pi052"), default="joint", help="pi052 recipe served")
    p.add_argument("--seconds", type=float, default=20.0, help="robot time per run")
    p.add_argument("--subtask-period-s", type=float, default=1.0, help="subtask refresh (LeRobot: 1 Hz)")
    p.add_argument("--action-rate-hz", type=float, default=None,
                   help="control rate (chunk period = horizon / rate); default: calibrated (calibrated_rate)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--text-tokens", type=int, default=pi052.MAX_NEW_TOKENS,
                   help="longest text decoded (the format's 128; random weights rarely stop earlier, a trained "
                        "model's subtask is a few words: a smaller cap stands for its length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p


def robot_timeline(chunks: list[tuple[float, float]], horizon: int, dt: float, end: float) -> dict:
    """Commands at the robot from chunks (delivered at, observation stamp), each row k meant for stamp + k dt:
    at every control tick the newest delivered chunk that still has a row for now plays it."""
    chunks = sorted(chunks)
    times, ages, i, newest = [], [], 0, None
    t = chunks[0][0] if chunks else end
    while t < end:
        while i < len(chunks) and chunks[i][0] <= t:
            newest, i = chunks[i], i + 1
        if newest is not None and 0 <= (t - newest[1]) / dt < horizon:
            times.append(t)
            ages.append(t - newest[1])
        t += dt
    return _commands(times, ages, chunks[0][0] if chunks else 0.0, end)


def _commands(times: list[float], ages: list[float], start: float, end: float) -> dict:
    gaps = np.diff(times) if len(times) > 1 else np.zeros(1)
    return {"command_hz": len(times) / (end - start) if end > start else 0.0,
            "largest_command_gap_ms": 1e3 * float(gaps.max()),
            "chunk_age_ms_p50": 1e3 * float(np.median(ages)) if ages else 0.0,
            "chunk_age_ms_max": 1e3 * float(np.max(ages)) if ages else 0.0}


class Serial:
    """(a): LeRobot's runtime loop (module docstring) on the model directly, every text and every chunk on a
    prefill of its own, as the branch re-runs the whole prefix per call (model/inference.py: the engine's
    reference path); `task` is the robot's task."""

    def __init__(self, engine, fmt: pi052.Pi052Format, task: str = TASK):
        self.model, self.tok, self.preparer, self.fmt = engine.runner.model, engine.tokenizer, engine.preparer, fmt
        self.task = task
        self.masked = fmt.masked_ranges(self.model.cfg.vocab_size, allow_loc=False)
        self.tokens = 0

    def _text(self, images, prompt: str) -> str:
        cache = inference.ContiguousCache(self.model, 4096)
        row = PrefixRow(images, torch.tensor(self.tok.encode(prompt, bos=True)))
        pre = inference.prefill(self.model, cache, [row])
        ids = inference.greedy_generate(self.model, cache, pre.segments[0], pre.hidden[0], [],
                                        self.fmt.max_new_tokens, eos_id=self.tok.eos_id)
        self.tokens += len(ids)
        return pi052.decode_reply(self.tok, ids)

    def subtask(self, prepared, state: str) -> str:
        prompt = pi052.joint_prompt(self.task, state) if self.fmt.joint else \
            pi052.render(pi052.subtask_messages(self.task), generation_prompt=False)
        return self._text(prepared.row.images, prompt + pi052.GENERATION_PROMPT)

    def memory(self, prepared, memory: str, completed: str) -> str:
        return self._text(prepared.row.images, pi052.render(pi052.memory_messages(self.task, memory, completed)))

    @torch.inference_mode()
    def chunk(self, prepared, state: str, subtask: str, noise) -> np.ndarray:
        """The chunk's model actions [H, action_dim] on a prefill of its own. Default recipe: images + the
        action prompt. Joint recipe: images + the prompt in the branch's three attention blocks
        (`pi052.joint_tokens`): the prompt through "Assistant:" bidirectional, the subtask's tokens causal,
        [EOS, "\\n"] a block that sees itself (`inference.prefill_blocks`)."""
        images = prepared.row.images
        if not self.fmt.joint:
            row = PrefixRow(images, torch.tensor(self.tok.encode(pi052.action_prompt(subtask, state), bos=True)))
            cache = inference.ContiguousCache(self.model, self.model.prefix_length(row))
            prefix = inference.prefill(self.model, cache, [row]).segments[0]
        else:
            joint = pi052.joint_tokens(self.tok, self.task, state, subtask)
            cache, prefix = inference.prefill_blocks(
                self.model, PrefixRow(images, torch.tensor(joint.tokens[:joint.bidir])),
                [(joint.tokens[joint.bidir:-joint.tail], 0), (joint.tokens[-joint.tail:], joint.tail)])
        actions = inference.sample_actions(self.model, cache, [prefix], torch.as_tensor(noise)[None])
        return actions[0].cpu().numpy()


def run_serial(engine, fmt, wl, seconds: float, period_s: float, dt: float) -> dict:
    serial, horizon = Serial(engine, fmt), engine.horizon
    t, queue_end, last_gate = 0.0, 0.0, -float("inf")
    subtask, memory, chunks, k = "", "", [], 0
    sub_s, mem_s = [], []
    text_s = 0.0
    while t < seconds:
        t = max(t, queue_end)                           # the queue is empty: compute now
        obs = wl.observations[k % len(wl.observations)]
        prepared = engine.preparer.prepare(obs)
        state = pi052.state_text(prepared.model_state)
        if t - last_gate >= period_s:                   # maybe_update_language_state (1 Hz gate)
            last_gate = t
            s = time.perf_counter()
            new = serial.subtask(prepared, state)
            sub_s.append(time.perf_counter() - s)
            if new and new != subtask:
                s2 = time.perf_counter()
                memory = serial.memory(prepared, memory, subtask) or memory
                mem_s.append(time.perf_counter() - s2)
            subtask = new or subtask
            text_s += time.perf_counter() - s
            t += time.perf_counter() - s
        stamp = t                                       # maybe_enqueue_action_chunk: a new observation
        s = time.perf_counter()
        serial.chunk(prepared, state, subtask or TASK, wl.noise[k % len(wl.noise)])
        t += time.perf_counter() - s
        chunks.append((t, stamp))
        queue_end = t + horizon * dt                    # every row queued, played one per control tick
        k += 1
    times = [c + j * dt for c, _ in chunks for j in range(horizon) if c + j * dt < seconds]
    ages = [c + j * dt - s for c, s in chunks for j in range(horizon) if c + j * dt < seconds]
    out = _commands(times, ages, chunks[0][0], seconds)
    out.update(subtask_ms_p50=1e3 * float(np.median(sub_s)) if sub_s else 0.0,
               memory_ms_p50=1e3 * float(np.median(mem_s)) if mem_s else 0.0,
               subtasks=len(sub_s), memories=len(mem_s), chunks=len(chunks),
               language_tokens_per_s=serial.tokens / text_s if text_s else 0.0)
    return out


def timed(engine) -> list[float]:
    """The engine on a simulated clock that each model operation advances by its measured duration (one
    thread: the cycle's decisions see the costs this machine has, not the other processes' scheduling)."""
    now = [0.0]
    engine.clock = lambda: now[0]
    runner = engine.runner
    for name in ("prefill", "actions", "extend", "extend_spans"):
        def op(*args, _real=getattr(runner, name), **kwargs):
            start = time.perf_counter()
            out = _real(*args, **kwargs)
            now[0] += time.perf_counter() - start
            return out
        setattr(runner, name, op)
    return now


def run_engine(engine, wl, seconds: float) -> dict:
    """(b): the camera sends a frame every chunk period (stamped when taken; a frame the engine is too busy
    for is replaced by the next, as the intake does); between frames the engine runs frame-less cycles while
    language work is left, as its thread does."""
    delivered, updates = [], []
    now = timed(engine)
    engine.add_chunk_listener(lambda c: delivered.append((now[0], c.plan.stamp_s, c.plan.step_period_s, c.compute_s)))
    engine.add_language_listener(updates.append)
    period, k, next_frame = engine.frame_period, 0, 0.0
    while now[0] < seconds:
        if now[0] >= next_frame:
            while next_frame + period <= now[0]:
                next_frame += period                      # frames taken while the engine was busy: replaced
            obs = replace(wl.observations[k % len(wl.observations)], stamp_s=next_frame)
            engine.submit_observation(obs, wl.noise[k % len(wl.noise)])
            k, next_frame = k + 1, next_frame + period
            engine.run_cycle()
        elif engine.scheduler.has_work:
            report = engine.run_cycle()
            if not (report.tokens or report.question_tokens):
                now[0] = max(now[0], next_frame)
        else:
            now[0] = next_frame
    snap = engine.stats.snapshot()
    dt = delivered[0][2] if delivered else period / engine.horizon
    out = robot_timeline([(at, stamp) for at, stamp, *_ in delivered], engine.horizon, dt, seconds)
    latency = {kind: [1e3 * x for x in v] for kind, v in engine.hierarchy.latency_s.items()}
    out.update(chunk_ms_p50=1e3 * float(np.median([d[3] for d in delivered])) if delivered else None,
               cycle_ms_p50=snap["frame_ms_p50"], language_tokens_per_s=snap["tokens_per_s"], chunks=len(delivered),
               frames_taken=k, late_chunks=int(sum(snap["robots"][r]["deadline_misses"] for r in engine.robots)),
               subtask_updates=sum(1 for u in updates if u.kind == "subtask"),
               own_prefills=engine.stats.counter("joint_own_prefill"),
               text_own_prefills=engine.stats.counter("joint_text_own_prefill"),
               span_tokens_p50=float(np.median([span_tokens(engine.tokenizer, u.text)
                                                for u in updates if u.kind == "subtask"] or [0])),
               memory_updates=sum(1 for u in updates if u.kind == "memory"),
               subtask_ms_p50=float(np.median(latency["subtask"])) if latency["subtask"] else None,
               memory_ms_p50=float(np.median(latency["memory"])) if latency["memory"] else None,
               subtasks=len(latency["subtask"]), memories=len(latency["memory"]))
    return out


def span_tokens(tokenizer, subtask: str) -> int:
    """How many tokens the joint recipe's actions read after the frame's prompt for `subtask`: its causal
    tokens and the [EOS, "\\n"] block (the state's bins come before them and do not change the count)."""
    joint = pi052.joint_tokens(tokenizer, TASK, None, subtask)
    return joint.causal + joint.tail


def calibrated_rate(make, wl, horizon: int) -> float:
    """A control rate whose chunk period is twice this machine's median cycle with hierarchy off (measured on
    8 frames), so that the schedules are compared where the actions fit, whatever the machine's speed."""
    engine = make("off")
    now = timed(engine)
    cycles = []
    for i in range(8):
        start = now[0]
        engine.run_cycle(wl.observations[i], wl.noise[i])
        cycles.append(now[0] - start)
    return horizon / (2.0 * float(np.median(cycles[2:])))


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    load = os.getloadavg()[0]               # other processes share the CPU: the figures depend on it
    cfg = model_config(a.preset)
    model = build_model(cfg, seed=a.seed)
    fmt = pi052.Pi052Format(joint=a.format == "joint", fast_skip_tokens=pi052.DEFAULT_FAST_SKIP_TOKENS,
                            max_new_tokens=a.text_tokens)
    wl = make_workload("libero", 16, "every", 1, cfg.num_denoise_steps, "deadline", 1, 70.0, a.seed,
                       cfg.action_horizon, cfg.action_dim, TASK, "")

    def engine(hierarchy: str, rate: float = 70.0):
        e = build_engine(cfg, built_model=model, robot_io=RobotIOConfig(robot_action_dim=7), seed=a.seed,
                         engine=EngineConfig(hierarchy=hierarchy, subtask_period_s=a.subtask_period_s,
                                             action_rate_hz=rate, prepare_ahead=False), kv_budget_mb=64.0)
        e.hierarchy.format = replace(e.hierarchy.format, max_new_tokens=a.text_tokens)
        return e

    a.action_rate_hz = a.action_rate_hz or calibrated_rate(engine, wl, cfg.action_horizon)
    warm = engine(a.format, a.action_rate_hz)
    for i in range(3):
        warm.run_cycle(wl.observations[i], wl.noise[i])
    dt = 1.0 / a.action_rate_hz
    results = {"serial_lerobot": run_serial(warm, fmt, wl, a.seconds, a.subtask_period_s, dt)}
    results["engine"] = run_engine(engine(a.format, a.action_rate_hz), wl, a.seconds)
    off = run_engine(engine("off", a.action_rate_hz), wl, a.seconds)
    on = results["engine"]
    # A chunk's time (cycle start -> chunk ready: prefill, span, actions) is what language must not delay;
    # a cycle with a frame lasts until its deadline when language work is left (it fills the time left).
    results["hierarchy_off_vs_on"] = {
        "chunk_ms_p50_off": off["chunk_ms_p50"], "chunk_ms_p50_on": on["chunk_ms_p50"],
        "ratio": on["chunk_ms_p50"] / off["chunk_ms_p50"] if off["chunk_ms_p50"] else None,
        "cycle_ms_p50_off": off["cycle_ms_p50"], "cycle_ms_p50_on": on["cycle_ms_p50"],
        "late_chunks_off": off["late_chunks"], "late_chunks_on": on["late_chunks"],
        "late_chunks_because_of_language": max(0, on["late_chunks"] - off["late_chunks"]),
        "largest_command_gap_ms_off": off["largest_command_gap_ms"]}
    args = sys.argv[1:] if argv is None else argv
    doc = {"benchmark": "hierarchy", "command": " ".join(["python -m oxygen_ros.bench.hierarchy", *args]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": a.threads,
                       "torch": torch.__version__, "cpus": os.cpu_count(),
                       "load_average_1min_before_after": [load, os.getloadavg()[0]]},
           "params": {"preset": a.preset, "format": a.format, "seconds": a.seconds, "task": TASK,
                      "subtask_period_s": a.subtask_period_s, "action_rate_hz": a.action_rate_hz,
                      "horizon": cfg.action_horizon, "chunk_period_ms": 1e3 * cfg.action_horizon / a.action_rate_hz,
                      "text_tokens": fmt.max_new_tokens, "weights": f"random (seed {a.seed})"},
           "results": results}
    text = json.dumps(doc, indent=2)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
