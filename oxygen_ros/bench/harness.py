"""Drive one engine through a workload synchronously (`Engine.run_cycle`, no engine thread) and record
what happened: every cycle's report, each frame's action chunk, each request's reply, the wall time.

Before frame i's cycle the harness submits that frame's requests; the cycle admits them to frame i.
After the last frame it runs decode-only cycles (`run_cycle(None)`) until every request has finished:
that tail is part of the run's work and of its wall time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from oxygen_ros.engine.engine import Engine
from oxygen_ros.engine.requests import Reply, TextRequest

# A request must never time out inside the benchmark (an isolated frame on a CPU can take seconds).
REQUEST_TIMEOUT_S = 1e7


@dataclass
class RunRecord:
    setting: str
    rep: int
    cycles: list = field(default_factory=list)          # CycleReport, in order
    actions: dict = field(default_factory=dict)         # workload frame -> model_actions [H, action_dim]
    replies: list = field(default_factory=list)         # (request index, submitted before frame, Reply)
    frame_of_cycle: list = field(default_factory=list)  # workload frame of each cycle, None for decode-only
    wall_s: float = 0.0
    unfinished: int = 0                                  # requests still queued after the drain (capacity)

    @property
    def frame_cycles(self):
        return [(i, c) for i, c in zip(self.frame_of_cycle, self.cycles) if i is not None]

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for _, _, r in self.replies)

    def reply_frame(self, reply: Reply) -> int | None:
        """The workload frame a reply was attached to (engine frame indices grow across runs)."""
        base = next((c.frame_index for c in self.cycles if c.frame_index is not None), None)
        if base is None or reply.frame_index < 0:
            return None
        return reply.frame_index - base


def run_workload(engine: Engine, wl, setting: str, rep: int, max_drain_cycles: int = 100_000) -> RunRecord:
    rec = RunRecord(setting, rep)
    handles = []
    start = time.perf_counter()
    for i in range(wl.frames):
        for _ in range(wl.schedule[i]):
            handles.append((len(handles), i, engine.submit(
                TextRequest(wl.question, max_tokens=wl.reply_tokens, timeout_s=REQUEST_TIMEOUT_S))))
        before = engine.latest_chunk()
        report = engine.run_cycle(wl.observations[i], wl.noise[i])
        rec.cycles.append(report)
        rec.frame_of_cycle.append(i)
        chunk = engine.latest_chunk()
        if report.fault or chunk is None or chunk is before:
            raise RuntimeError(f"{setting}: frame {i} produced no action chunk ({report.fault or 'no chunk'})")
        rec.actions[i] = np.array(chunk.model_actions, copy=True)
    drained = 0
    while engine.active_requests:
        if drained >= max_drain_cycles:
            raise RuntimeError(f"{setting}: requests still active after {drained} decode-only cycles")
        rec.cycles.append(engine.run_cycle(None))
        rec.frame_of_cycle.append(None)
        drained += 1
    rec.wall_s = time.perf_counter() - start
    # Requests a capacity limit kept queued after the last frame can never be admitted (admission needs a
    # frame): cancel them and count them, they make the settings' work differ.
    for _, _, h in handles:
        if not h.done():
            h.cancel()
            rec.unfinished += 1
    if rec.unfinished:
        engine.run_cycle(None)   # expires the cancelled requests, releases nothing else
    for idx, frame, h in handles:
        rec.replies.append((idx, frame, h.result(timeout=60)))
    return rec
