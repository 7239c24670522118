"""`python -m oxygen_ros.bench --adversarial`: do the actions keep their deadline whatever language asks?

The engine runs on its own thread in real time, as on a robot; a camera thread hands it a frame at
--camera-hz. Two phases, same engine settings, one after the other in one run:
  baseline: the paper's workload, one short question per delivered chunk (--reply-tokens tokens each);
  flood:    a hostile but legal client keeps the waiting queue full (--flood-queue requests) of the
            longest questions a client may send (max_question_chars characters, max_tokens 32).
Optionally (--compare-unbounded) the flood again with question prefill unbounded by the budget (a chunk
as large as any question: how the engine behaved before chunked prefill). The first --warmup seconds of
each phase are not counted (the budget's cost model measures its first steps there).

Figures per phase, over the counted window: chunks_per_s (chunks delivered), max_chunk_gap_ms (largest
time between two deliveries, from the window's start), deadline_misses (chunks delivered after their
robot's deadline: the observation's arrival + the chunk period), tokens_per_s (language tokens generated),
questions_answered / questions_refused (refused at submit, e.g. busy) / questions_ended (ended with
another reason, e.g. "engine stopped" at the phase's end) / questions_without_reason (must be 0).
Targets (CPU, tiny): flood chunks/s >= 90% of baseline, largest gap <= 1.5 x the chunk period, tokens/s
during the flood > 0, every question answered or refused with a reason.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.requests import TextRequest

from .workload import make_workload

FLOOD_MAX_TOKENS = 32


def flood_question(chars: int) -> str:
    return ("What colour is the cube on the left of the table and how far is it from the gripper? " * 100)[:chars]


def run_phase(model, a, cfg, phase: str, log, prefill_chunk_tokens: int | None = None) -> dict:
    from oxygen_ros.engine.factory import build_engine

    overrides = {} if prefill_chunk_tokens is None else {"prefill_chunk_tokens": prefill_chunk_tokens}
    engine = build_engine(built_model=model, kv_budget_mb=a.kv_budget_mb, engine=EngineConfig(
        policy="oxygen", decode_budget="deadline", action_rate_hz=a.action_rate_hz, denoise_steps=a.denoise_steps,
        max_queued_requests=a.flood_queue, max_queued_per_owner=a.flood_queue, max_active_requests=a.max_batch,
        seed=a.seed, **overrides))
    wl = make_workload(robot=a.robot, frames=16, arrival="every", reply_tokens=a.reply_tokens,
                       denoise_steps=a.denoise_steps, budget="deadline", tokens_per_frame=1,
                       action_rate_hz=a.action_rate_hz, seed=a.seed, action_horizon=cfg.action_horizon,
                       action_dim=cfg.action_dim, prompt=a.prompt, question=a.question)
    chunks: list[float] = []
    engine.add_chunk_listener(lambda c: chunks.append(time.monotonic()))
    handles = []
    stop = threading.Event()
    question = flood_question(engine.config.max_question_chars)

    def camera():
        i = 0
        while not stop.is_set():
            obs = wl.observations[i % len(wl.observations)]
            engine.submit_observation(dataclasses.replace(obs, stamp_s=time.monotonic()))
            i += 1
            stop.wait(1.0 / a.camera_hz)

    def client():
        asked = 0
        while not stop.is_set():
            if phase == "baseline":
                if len(chunks) > asked:                 # one question per delivered chunk (the paper's)
                    asked = len(chunks)
                    handles.append(engine.submit(TextRequest(a.question, max_tokens=a.reply_tokens)))
            else:
                for _ in range(a.flood_queue - engine.queued_requests):
                    handles.append(engine.submit(TextRequest(question, max_tokens=FLOOD_MAX_TOKENS)))
            stop.wait(0.005)

    threads = [threading.Thread(target=f, daemon=True) for f in (camera, client)]
    engine.start()
    for t in threads:
        t.start()
    time.sleep(a.warmup)
    t0, tokens0 = time.monotonic(), engine.stats.counter("tokens")
    misses0 = engine.stats.snapshot()["robots"][""]["deadline_misses"]
    first_chunk = len(chunks)
    time.sleep(a.seconds)
    t1, tokens1 = time.monotonic(), engine.stats.counter("tokens")
    snap = engine.stats.snapshot()
    stop.set()
    for t in threads:
        t.join()
    for _ in range(60):                 # a cycle in progress finishes first (the unbounded prefill: long)
        if engine.stop(10.0):
            break
        log(f"{phase}: waiting for the engine thread to finish its cycle")
    window = [t for t in chunks[first_chunk:] if t <= t1]
    gaps = np.diff([t0] + window + [t1]) if window else np.array([t1 - t0])
    replies = [h.result(0) for h in handles if h.done()]
    out = {
        "chunks_per_s": len(window) / (t1 - t0),
        "max_chunk_gap_ms": 1e3 * float(gaps.max()),
        "deadline_misses": snap["robots"][""]["deadline_misses"] - misses0,
        "tokens_per_s": (tokens1 - tokens0) / (t1 - t0),
        "questions_answered": sum(r.success for r in replies),
        "questions_refused": sum(r.finish_reason == "refused" for r in replies),
        "questions_ended": sum(not r.success and r.finish_reason != "refused" and bool(r.error) for r in replies),
        "questions_without_reason": sum(not r.success and not r.error for r in replies) + len(handles) - len(replies),
        "frame_ms_p99": snap["frame_ms_p99"],
        "chunk_period_ms": 1e3 * engine.info.chunk_period_s,
        "seconds": t1 - t0,
    }
    log(f"{phase:>17}: {out['chunks_per_s']:5.1f} chunks/s, largest gap {out['max_chunk_gap_ms']:6.0f} ms, "
        f"{out['deadline_misses']} deadline misses, {out['tokens_per_s']:6.1f} tokens/s, questions "
        f"{out['questions_answered']} answered / {out['questions_refused']} refused / {out['questions_ended']} "
        f"ended / {out['questions_without_reason']} without a reason")
    return out


def verdict(targets: dict, load_start: float | None, load_end: float | None, cpus: int) -> tuple[str, str]:
    """(the verdict line, the load warning or ""). Every target met: actions first held. A target missed on a
    busy machine (a 1-min load average above the CPU count, at the start: other work; at the end: this run
    included) is not the engine's alone: the figures are timing figures, and the CPU was shared."""
    names = {"chunks_kept": "chunks/s under the flood >= 90% of baseline",
             "gap_kept": "largest gap between chunks <= 1.5 x the chunk period",
             "language_served": "language still served during the flood",
             "every_question_has_a_reason": "every question answered or refused with a reason"}
    missed = [text for key, text in names.items() if not targets[key]]
    loads = [x for x in (load_start, load_end) if x is not None]
    busy = bool(loads) and max(loads) > cpus
    warning = (f"WARNING: busy machine: 1-min load average {'/'.join(f'{x:.1f}' for x in loads)} (start/end) on "
               f"{cpus} CPUs: the engine shared the CPU with other work; rerun on a quiet machine to judge it"
               if busy else "")
    if not missed:
        return "verdict: PASS: actions first held (every target met)", warning
    head = "verdict: INCONCLUSIVE (busy machine)" if busy else "verdict: FAIL"
    return f"{head}: missed: {'; '.join(missed)}", warning


def run(model, a, cfg, log) -> dict:
    phases = {"baseline": run_phase(model, a, cfg, "baseline", log), "flood": run_phase(model, a, cfg, "flood", log)}
    if a.compare_unbounded:
        phases["flood_unbounded_prefill"] = run_phase(model, a, cfg, "flood", log, prefill_chunk_tokens=10**6)
    base, flood = phases["baseline"], phases["flood"]
    phases["targets"] = {
        "flood_chunks_per_s_over_baseline": flood["chunks_per_s"] / base["chunks_per_s"] if base["chunks_per_s"] else None,
        "chunks_kept": flood["chunks_per_s"] >= 0.9 * base["chunks_per_s"],
        "largest_gap_over_chunk_period": flood["max_chunk_gap_ms"] / flood["chunk_period_ms"],
        "gap_kept": flood["max_chunk_gap_ms"] <= 1.5 * flood["chunk_period_ms"],
        "language_served": flood["tokens_per_s"] > 0,
        "every_question_has_a_reason": flood["questions_without_reason"] == 0 and base["questions_without_reason"] == 0,
    }
    phases["workload"] = {"camera_hz": a.camera_hz, "seconds": a.seconds, "warmup_s": a.warmup,
                          "flood_queue": a.flood_queue, "flood_question_chars": len(flood_question(2000)),
                          "flood_max_tokens": FLOOD_MAX_TOKENS, "baseline_reply_tokens": a.reply_tokens,
                          "robot": a.robot, "note": __doc__.split("\n\n")[1].strip()}
    return phases
