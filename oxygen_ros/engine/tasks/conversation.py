"""The conversation task: language requests (questions, and the captions task's requests) read the frame's
KV and advance together, in the time the cycle has left after the actions.

Each cycle (policy `oxygen`): admit what the scheduler lets in (each request attaches to its owner's frame
of this cycle); prefill the next chunk of the admitted questions on top of their frames' prefixes in one
batched forward, as many tokens as the budget says fit (a long question spreads over cycles; a request
whose question is complete gets its first token); then advance every running request together, one
batched decode step at a time, whatever frame or robot each is attached to, while the budget says the next
step still ends before the deadline. A new observation waiting for the engine ends the language work at the
next step boundary once the budget's minimum is done (deadline budget; a cycle without a frame stops at
once): actions first, at the camera's rate, and language gets the time that is left, and always some. The
scheduler decides how much (`LanguageBudget`); this task runs it.

A request with a prefix prompt of its own (pi052's default recipe: a text is images + its messages,
bidirectional), or one continuing a frame's prompt where the frame's prefill is not that prompt (the joint
recipe's lone space piece in the actions' block), is prefilled when admitted, only while the cycle's time
allows its measured cost.

Frames for waiting requests: a robot's newest frame is held while its requests wait (`_hold`); a robot with
questions waiting and no frame for over a camera interval gets its last delivered frame again (`reusable`);
a robot that never sent one has its questions refused after FIRST_FRAME_WAIT_S.

The other policies exist for side-by-side runs: `isolated` (openpi-style: each request prefills its own
copy of the frame, then its whole question, then is decoded to completion inside the frame) and
`shared_kv` (one prefill; replies still prefilled whole and decoded to completion inside the frame).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Mapping

import torch

from oxygen_ros.model.pi05 import PrefixRow

from ..config import EngineConfig
from ..cycle import CycleReport, Frame
from ..intake import FIRST_FRAME_WAIT_S, Intake
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
        self.held: dict[str, Frame] = {}     # robot -> its newest frame, held for its waiting requests (_hold)
        self.own_prefill_s = 0.0             # measured cost of a request's own prefill (moving average)

    def run(self, frames: dict[str, Frame], report: CycleReport, deadline: float) -> None:
        """This cycle's language work: admission onto `frames` ({robot: frame}, possibly none) and onto the
        frames held for requests that are still waiting, question prefill, then decode until `deadline`
        (engine clock), or until a new observation is waiting (actions first) once the budget's minimum is
        done (decode_budget deadline; a cycle without a frame stops at once)."""
        sched = self.scheduler
        t = self.clock()
        admitted = self._admit(frames, report, deadline) if frames or self.held else []
        if self.config.policy != "oxygen":
            self._to_completion(admitted, report, t)
            return
        preemptible = self.config.decode_budget == "deadline"
        if frames or not self.frame_waiting():
            waiting = preemptible and self.frame_waiting()          # then only the minimum chunk of prefill
            self._prefill(sched.prefill_chunks(self.clock(), self.clock() if waiting else deadline), report)
        report.admit_s = self.clock() - t
        t = self.clock()
        steps = 0
        while batch := sched.decode_batch():
            if not sched.budget.another_step(steps, self.clock(), deadline, len(batch), frame=bool(frames)):
                break
            if (not frames or preemptible and steps >= sched.budget.min_steps) and self.frame_waiting():
                report.preempted = True        # a new frame is waiting: actions first
                break
            s = self.clock()
            self._decode_step(batch, report)
            sched.budget.observe(len(batch), len(batch), self.clock() - s)
            steps += 1
        report.decode_s = self.clock() - t

    def _to_completion(self, admitted: list[Sequence], report: CycleReport, t: float) -> None:
        """The comparison policies: each admitted request's whole question, then its whole reply, one
        request at a time, inside the frame."""
        for seq in admitted:
            self._prefill([(seq, len(seq.question))] if seq.prefilling else [], report)
        report.admit_s = self.clock() - t
        t = self.clock()
        for seq in admitted:
            while seq in self.scheduler.running:
                self._decode_step([seq], report)
        report.decode_s = self.clock() - t

    def _attach(self, frame: Frame, seq: Sequence) -> FrameCache:
        """A request's reference to its frame's KV: the same blocks (retain), or a prefill of its own over the
        frame's images: its own prefix prompt, or the prompt it continues where the frame's prefill is not
        that prompt (the joint recipe's lone space piece: counted, joint_text_own_prefill), or in the isolated
        policy the frame's (openpi-style)."""
        prompt = seq.own_prompt(frame.prepared)
        if prompt is not None:
            if seq.own_prefix is None:
                self.stats.count("joint_text_own_prefill")
            t = self.clock()
            own = self.runner.prefill_one(PrefixRow(frame.prepared.row.images,
                                                    torch.as_tensor(prompt, dtype=torch.long)),
                                          frame.index, frame.prepared.stamp)
            spent = self.clock() - t
            self.own_prefill_s += (spent - self.own_prefill_s) * (0.3 if self.own_prefill_s else 1.0)
            return own
        if self.config.policy == "isolated":
            return self.runner.prefill_one(frame.prepared.row, frame.index, frame.prepared.stamp)
        return frame.cache.retain()

    def _admit(self, frames: dict[str, Frame], report: CycleReport, deadline: float) -> list[Sequence]:
        """Admit what fits, each request onto its owner's frame (this cycle's, else the one held for it); a
        request without a question gets its first token from the frame's last position at once. Then hold
        the newest frame of each robot that still has requests waiting (see `_hold`)."""
        for robot in [r for r in self.held if r in frames or r not in self.scheduler.robots]:
            self.held.pop(robot).cache.release()           # a newer frame came, or the robot left
        admitted = self.scheduler.admit({**self.held, **frames}, self._attach,
                                        lambda: self.clock() + self.own_prefill_s <= deadline)
        report.admitted += len(admitted)
        for s in [s for s in admitted if not s.question]:
            report.tokens += self.scheduler.postprocess([s], [0], self.runner.frame_logits(s.frame))
        self._hold(frames)
        return admitted

    def _hold(self, frames: dict[str, Frame]) -> None:
        """A request that could not be admitted at its robot's frame (the batch was full, or its KV blocks were
        not free yet) must not wait for that robot's next frame: a client that asked with an observation waits
        for the reply before it sends another, and a paused camera sends none. So the robot's newest frame is
        held (one reference) while it has requests waiting, and cycles without a frame admit onto it. Only
        while the pool keeps its reserve for the next cycle's frames beside it; released as soon as nothing
        of its robot waits, a newer frame comes, the robot leaves or the engine stops (`release_held`)."""
        waiting = self.scheduler.waiting_owners()
        for robot in [r for r in self.held if r not in waiting]:
            self.held.pop(robot).cache.release()
        for robot, frame in frames.items():
            if robot in waiting and robot not in self.held and frame.cache is not None \
                    and self.runner.pool.blocks.num_free >= self.scheduler.reserve_blocks:
                self.held[robot] = replace(frame, cache=frame.cache.retain())

    def reuse(self, framed: set[str], intake: Intake, chunk_periods: Mapping[str, float], prefix_blocks: int,
              prefill: Callable[[list[Frame], list], list[Frame]]) -> list[Frame]:
        """Questions must not wait for a frame that may never come (a paused camera; a client that waits for
        its reply before it sends its next observation). For each robot with questions waiting, no frame
        this cycle and none held for them, and no newer frame on its way: its last delivered frame again,
        prefilled in one forward (`prefill`: the engine's, held by its cycle), without a chunk: it is not a new
        observation, and a chunk planned from an old state must not reach the robot. Only while the pool keeps
        the next cycle's reserve beside them. A robot that never delivered a frame: its own questions waiting longer than FIRST_FRAME_WAIT_S
        end with an error at once instead of at their timeout (no other robot's)."""
        now, blocks = self.clock(), self.runner.pool.blocks
        reused: list[Frame] = []
        for robot in sorted(self.scheduler.waiting_owners() - framed - set(self.held)):
            if robot not in chunk_periods:
                continue
            if intake.never_framed(robot):
                whose = f"robot {robot!r}" if robot else "the robot"
                self.scheduler.fail_waiting(robot, now - FIRST_FRAME_WAIT_S, f"no frame yet from {whose} after "
                                            f"{FIRST_FRAME_WAIT_S:g} s: nothing to answer about")
            elif (frame := intake.reusable(robot, now, chunk_periods[robot])) is not None and \
                    blocks.num_free >= self.scheduler.reserve_blocks + (len(reused) + 1) * prefix_blocks:
                reused.append(frame)
        faults: list[tuple[Frame, str]] = []
        try:
            reused = prefill(reused, faults) if reused else []
        except Exception as e:  # noqa: BLE001 - as a frame's prefill: the robots' questions wait on, nothing else
            faults, reused = [(f, f"{type(e).__name__}: {e}") for f in reused], []
        for f, message in faults:
            self.stats.count("faults")
            self.stats.note_error(f"re-used frame {f.index} of robot {f.robot!r}: {message}")
            log.error("re-used frame %d of robot %r: %s", f.index, f.robot, message)
        for f in reused:
            self.stats.count("reused_frames")
            self.stats.count_robot(f.robot, "reused_frames")
        return reused

    def release_held(self) -> None:
        """Drop every held frame (the engine stops, or its safe stop failed the requests that waited)."""
        while self.held:
            self.held.popitem()[1].cache.release()

    def _prefill(self, chunks: list[tuple[Sequence, int]], report: CycleReport) -> None:
        """Append each (request, n): the next n tokens of its question, all in one forward."""
        if not chunks:
            return
        seqs, counts = [s for s, _ in chunks], [n for _, n in chunks]
        s = self.clock()
        try:
            logits = self.runner.extend([TextRow(seq.frame.segment, seq.blocks, seq.own_len,
                                                 seq.question[seq.own_len:seq.own_len + n]) for seq, n in chunks])
        except Exception as e:  # noqa: BLE001 - a fault in the question prefill fails these requests only
            self.stats.count("faults")
            self.stats.note_error(f"question prefill failed: {e}")
            log.exception("question prefill failed")
            self.scheduler.fail(seqs, f"question prefill failed: {e}")
            return
        self.scheduler.budget.observe(len(chunks), sum(counts), self.clock() - s)
        report.question_tokens += sum(counts)
        report.tokens += self.scheduler.postprocess(seqs, counts, logits)

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
