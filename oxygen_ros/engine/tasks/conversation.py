"""The conversation task: language requests (questions, and the captions task's requests) read the frame's
KV and advance together, in the time the cycle has left after the actions.

Each cycle: admit what the scheduler lets in (each request attaches to its owner's frame of this cycle),
prefill their questions on top of the frame's prefix in one batched forward (their first token comes out),
then advance every running request together, one batched decode step at a time, whatever frame or robot
each is attached to, while the scheduler's budget says the next step still ends before the deadline. A
cycle without a frame stops at the next step boundary when a new observation is waiting (actions first).

The other policies exist for side-by-side runs: `isolated` (openpi-style: each request prefills its own
copy of the frame, then is decoded to completion inside the frame) and `shared_kv` (one prefill; replies
still decoded to completion inside the frame).
"""
from __future__ import annotations

import logging
from typing import Callable

from ..config import EngineConfig
from ..cycle import CycleReport, Frame
from ..kv_pool import FrameCache
from ..model_runner import ModelRunner, TextRow
from ..requests import Sequence
from ..scheduler import Scheduler
from ..stats import EngineStats

log = logging.getLogger("oxygen_ros.engine")


class ConversationTask:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, config: EngineConfig, stats: EngineStats,
                 clock: Callable[[], float], frame_waiting: Callable[[], bool]):
        self.runner, self.scheduler, self.config, self.stats = runner, scheduler, config, stats
        self.clock, self.frame_waiting = clock, frame_waiting

    def run(self, frames: dict[str, Frame], report: CycleReport, deadline: float) -> None:
        """This cycle's language work: admission onto `frames` ({robot: frame}, possibly none), then decode
        until `deadline` (engine clock)."""
        sched = self.scheduler
        t = self.clock()
        if frames:
            admitted = self._admit(frames, report)
            if self.config.policy != "oxygen":
                # Decode each admitted reply to completion inside the frame, one request at a time.
                report.admit_s = self.clock() - t
                t = self.clock()
                for seq in admitted:
                    while seq in sched.running:
                        self._decode_step([seq], report)
                report.decode_s = self.clock() - t
                return
        report.admit_s = self.clock() - t
        t = self.clock()
        steps = 0
        while sched.running:
            batch = sched.decode_batch()
            if not sched.budget.another_step(steps, self.clock(), deadline, len(batch)):
                break
            if not frames and self.frame_waiting():
                report.preempted = True        # a new frame is waiting: actions first
                break
            s = self.clock()
            self._decode_step(batch, report)
            sched.budget.observe(len(batch), self.clock() - s)
            steps += 1
        report.decode_s = self.clock() - t

    def _attach(self, frame: Frame) -> FrameCache:
        """A request's reference to its frame's KV: the same blocks (retain), or in the isolated policy a
        prefill of its own (openpi-style)."""
        if self.config.policy == "isolated":
            return self.runner.prefill_one(frame.prepared.row, frame.index, frame.prepared.stamp)
        return frame.cache.retain()

    def _admit(self, frames: dict[str, Frame], report: CycleReport) -> list[Sequence]:
        """Admit what fits (each request to its owner's frame), prefill the questions in one batched forward
        and sample the first tokens."""
        admitted = self.scheduler.admit(frames, self._attach)
        if not admitted:
            return []
        report.admitted += len(admitted)
        with_question = [s for s in admitted if s.question]
        groups = [[s] for s in with_question] if self.config.policy != "oxygen" else [with_question]
        try:
            for group in filter(None, groups):
                logits = self.runner.extend([TextRow(s.frame.segment, s.blocks, s.own_len, s.question)
                                             for s in group])
                report.question_tokens += sum(len(s.question) for s in group)
                report.tokens += self.scheduler.postprocess(group, [len(s.question) for s in group], logits)
            for s in admitted:
                if not s.question:
                    report.tokens += self.scheduler.postprocess([s], [0], self.runner.frame_logits(s.frame))
        except Exception as e:  # noqa: BLE001 - a fault in the question prefill fails these requests only
            self.stats.count("faults")
            self.stats.note_error(f"question prefill failed: {e}")
            self.scheduler.fail([s for s in admitted if s.frame is not None], f"question prefill failed: {e}")
            return []
        return admitted

    def _decode_step(self, batch: list[Sequence], report: CycleReport) -> None:
        try:
            logits = self.runner.extend([TextRow(s.frame.segment, s.blocks, s.own_len, [s.tokens[-1]])
                                         for s in batch])
        except Exception as e:  # noqa: BLE001 - cannot attribute a batched failure: fail the batch, keep going
            self.stats.count("faults")
            self.stats.note_error(f"decode step failed: {e}")
            log.exception("decode step failed")
            self.scheduler.fail(batch, f"decode step failed: {e}")
            return
        report.decode_steps += 1
        report.batch_sizes.append(len(batch))
        report.tokens += self.scheduler.postprocess(batch, [1] * len(batch), logits)
