"""The unified-KV engine: one thread owns the device and runs the frame cycle.

Frame cycle (policy `oxygen`):
  1. take the newest observation (older ones were dropped and counted) and prefill it once -> FrameCache;
  2. action chunk: N flow-matching steps of the expert over that KV (first, so it meets its deadline);
  3. language (the scheduler): admit queued requests (attach to this frame, prefill their questions on top
     of its prefix, their first token comes out), then advance every running request together, one batched
     decode step at a time, whatever frame each is attached to, while the cycle's budget lasts; a cycle
     without a frame stops at the next step boundary when a new observation arrives;
  4. release: the cycle's frame reference is dropped on every path (a `with` block); finished requests
     drop theirs in `Scheduler.finish`.
The other policies exist for side-by-side runs on the same engine: `isolated` (openpi-style: a separate
prefill for the action and for each request, each reply decoded to completion inside the frame) and
`shared_kv` (one prefill; replies still decoded to completion inside the frame).

Who owns what (see ARCHITECTURE.md): the engine owns the thread, the mailbox and the cycle; the scheduler
the requests; the block manager the KV blocks; the model runner the model; the frame preparer the robot's
units. Callers (ROS nodes, the benchmark) use the thread-safe API: `submit_observation` (latest wins),
`latest_chunk`, `submit` (a request -> RequestHandle), `captions`, `stats`, `info`. Nothing they call blocks
on the engine, and the engine never waits for them; their callbacks cannot break the engine.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.model.sampler import sample
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.robot.chunks import ActionChunkPlan
from oxygen_ros.robot.errors import InputError

from .config import POLICIES, EngineConfig
from .frames import FramePreparer, PreparedFrame
from .kv_pool import FrameCache
from .model_runner import EngineFault, ModelRunner, TextRow
from .requests import Reply, RequestHandle, Sampling, Sequence, TextRequest, refused
from .scheduler import Scheduler
from .stats import EngineStats

log = logging.getLogger("oxygen_ros.engine")


@dataclass(frozen=True)
class EngineInfo:
    """What a node or tool may know about a running engine (read-only)."""

    camera_slots: tuple[str, ...]
    action_dim: int                # what the robot receives per row
    max_state_dim: int             # the model's padded width: the longest state that fits
    action_horizon: int
    action_rate_hz: float
    frame_period_s: float
    policy: str
    attention_backend: str
    cuda_graphs: bool              # fixed-shape steps on (captured as CUDA graphs on a GPU)
    kv_blocks: int
    block_size: int
    max_question_chars: int
    max_queued_requests: int


@dataclass(frozen=True)
class ChunkResult:
    plan: ActionChunkPlan          # robot units; row k is meant for stamp + k * control period
    model_actions: np.ndarray      # [H, action_dim] the expert's output before un-normalisation
    compute_s: float               # cycle start -> chunk ready (engine clock)
    prompt_truncated: int          # prompt tokens cut to fit the model's max_token_len


@dataclass(frozen=True)
class Caption:
    stamp: float
    frame_index: int
    prompt: str
    text: str


@dataclass
class CycleReport:
    frame_index: int | None
    start: float
    prefill_s: float = 0.0
    action_s: float = 0.0
    admit_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    batch_sizes: list = field(default_factory=list)
    tokens: int = 0
    admitted: int = 0
    duration_s: float = 0.0
    deadline_missed: bool = False
    preempted: bool = False        # a decode-only cycle ended early for a new observation
    fault: str = ""


class _Mailbox:
    """Holds the newest observation; a newer one replaces (and counts) an unconsumed older one."""

    def __init__(self):
        self._cv = threading.Condition()
        self._item = None
        self.dropped = 0

    def put(self, item) -> None:
        with self._cv:
            if self._item is not None:
                self.dropped += 1
            self._item = item
            self._cv.notify()

    def take(self, timeout: float | None = None):
        with self._cv:
            if self._item is None and timeout:
                self._cv.wait(timeout)
            item, self._item = self._item, None
            return item

    @property
    def pending(self) -> bool:
        return self._item is not None

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()


class Engine:
    def __init__(self, runner: ModelRunner, preparer: FramePreparer, tokenizer: Tokenizer,
                 config: EngineConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or EngineConfig()
        self.config.validate()
        self.runner, self.preparer, self.tokenizer = runner, preparer, tokenizer
        self.clock = clock
        self.horizon = runner.cfg.action_horizon
        self.frame_period = self.horizon / self.config.action_rate_hz
        pool = runner.pool
        # Room kept free for the next frame's prefill: actions never starve for KV blocks.
        prefix_blocks = pool.blocks_for(runner.max_prefix_tokens())
        if pool.num_blocks < 2 * prefix_blocks:
            raise ValueError(f"KV pool of {pool.num_blocks} blocks cannot hold two frame prefixes of "
                             f"{prefix_blocks} blocks: raise the KV memory budget")
        self.stats = EngineStats(self.horizon, self.frame_period, pool.blocks)
        self.scheduler = Scheduler(self.config, pool.blocks, tokenizer, prefix_blocks, prefix_blocks, self.stats,
                                   lambda: self.clock())
        self._mailbox = _Mailbox()
        self._lock = threading.Lock()                       # guards the listener lists
        self._latest_chunk: ChunkResult | None = None
        self._captions: collections.deque[Caption] = collections.deque(maxlen=self.config.memory_log_size)
        self._chunk_listeners: list[Callable[[ChunkResult], None]] = []
        self._caption_listeners: list[Callable[[Caption], None]] = []
        self._frame_listeners: list[Callable[[int, object], None]] = []
        self._frame_index = 0
        self._last_memory_frame: int | None = None
        self._last_memory_time: float | None = None
        self._subtask_text = ""
        self._prepared: PreparedFrame | None = None          # the current frame's inputs (isolated policy)
        self._consecutive_faults = 0
        self.faulted = ""                                   # non-empty: safe stop, reason
        self._start_graphs()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.info = EngineInfo(
            tuple(runner.cfg.camera_slots), preparer.robot_action_dim, runner.cfg.action_dim, self.horizon, self.config.action_rate_hz,
            self.frame_period, self.config.policy, runner.backend, runner.graphs is not None, pool.num_blocks,
            pool.block_size, self.config.max_question_chars, self.config.max_queued_requests)

    def _start_graphs(self) -> None:
        """Fixed-shape steps (graphs.py): captured now on CUDA, not in the middle of a control cycle. When
        they are only the default (cuda_graphs unset) a failed capture is not fatal: the engine runs eagerly
        and says so (log, diagnostics); when asked for explicitly, it is."""
        runner, explicit = self.runner, self.config.cuda_graphs is not None
        if not (self.config.cuda_graphs if explicit else _graphs_by_default(runner)):
            return
        capture = runner.model.device.type == "cuda"
        try:
            steps = runner.enable_graphs(self.config.max_active_requests,
                                         self.config.max_question_chars + self.config.max_tokens_limit, capture)
            if capture:
                steps.warm_up(self.config.denoise_steps or runner.cfg.num_denoise_steps)
        except Exception as e:
            if explicit:
                raise
            runner.disable_graphs()
            message = f"CUDA graphs unavailable, running eagerly (slower): {e}"
            log.warning(message)
            self.stats.note_error(message)
            self.stats.count("graph_capture_failures")
        self.stats.graphs = runner.graphs

    # ================================================================== caller API (any thread)
    def submit_observation(self, obs, noise: np.ndarray | None = None) -> None:
        """Hand over the newest observation (oxygen_ros.robot.sync.Observation). Never blocks."""
        self._mailbox.put((obs, noise))

    def latest_chunk(self) -> ChunkResult | None:
        return self._latest_chunk

    def add_chunk_listener(self, fn: Callable[[ChunkResult], None]) -> None:
        """fn(chunk) runs on the engine thread for every new chunk: it must return at once. An exception
        it raises is logged and counted (listener_errors); it stops nothing."""
        with self._lock:
            self._chunk_listeners.append(fn)

    def add_caption_listener(self, fn: Callable[[Caption], None]) -> None:
        with self._lock:
            self._caption_listeners.append(fn)

    def add_frame_listener(self, fn: Callable[[int, object], None]) -> None:
        """fn(frame_index, observation) runs on the engine thread for every observation a frame is computed
        from (the recorder): it must return at once."""
        with self._lock:
            self._frame_listeners.append(fn)

    def frame_noise(self, index: int) -> torch.Tensor:
        """The flow-matching noise of frame `index`: a function of (seed, index) only, so that a recording
        replays bit for bit from any frame on, whatever frames were dropped before it."""
        seed = int(np.random.SeedSequence([self.config.seed, index]).generate_state(1)[0])
        return self.runner.noise(torch.Generator().manual_seed(seed))

    def captions(self) -> list[Caption]:
        return list(self._captions)

    def submit(self, request: TextRequest) -> RequestHandle:
        """Queue a language request. Invalid, never-fitting or over-capacity requests, and any request once
        the engine is stopping or in its safe stop, come back already finished with success False and the
        reason in `error` (finish_reason "refused"): nothing is dropped silently."""
        if self.faulted:
            return refused(request, f"engine stopped after repeated faults: {self.faulted}", self.clock())
        handle = self.scheduler.submit(request)
        self._mailbox.wake()
        return handle

    def start(self) -> None:
        if self._thread is not None:
            if self._thread.is_alive() and not self._stop.is_set():
                return
            if self._thread.is_alive():
                raise RuntimeError("the previous engine thread has not stopped yet: cannot start another")
        self._stop.clear()
        self.scheduler.reopen()
        self._thread = threading.Thread(target=self._loop, name="oxygen-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the engine thread; new requests are refused from now on and every unfinished one gets an
        error reply. Returns False when the thread did not stop within `timeout` (a device call hangs):
        it then answers the unfinished requests itself when it exits, and `start` refuses to run a second
        loop beside it."""
        self.scheduler.close("engine stopped")
        self._stop.set()
        self._mailbox.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("engine thread still busy %.1f s after stop: it will fail its requests on exit", timeout)
                return False
            self._thread = None
        self.scheduler.fail_all("engine stopped")
        return True

    def reset_fault(self) -> None:
        """Leave the safe stop after repeated faults (an operator decision, e.g. the enable service)."""
        self.faulted = ""
        self._consecutive_faults = 0

    @property
    def active_requests(self) -> int:
        return len(self.scheduler.running)

    @property
    def queued_requests(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def mailbox_dropped(self) -> int:
        return self._mailbox.dropped

    @property
    def subtask_text(self) -> str:
        return self._subtask_text

    def reset_pool_peak(self) -> None:
        """Start a new measurement of the peak KV blocks in use (stats: pool_peak_blocks), e.g. after a
        benchmark's warm-up."""
        self.runner.pool.blocks.reset_peak()

    def question_tokens(self, text: str) -> list[int]:
        """The tokens a question is appended as (after the frame's prefix)."""
        return self.tokenizer.encode(self.config.question_template.format(text=text))

    # ================================================================== engine thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                item = self._mailbox.take(timeout=self.frame_period)
                if self._stop.is_set():
                    break
                if item is None and not self.scheduler.has_work:
                    continue
                try:
                    self.run_cycle(*(item or (None, None)))
                except Exception:  # the loop must survive anything; run_cycle already reported it
                    log.exception("engine cycle failed")
        finally:
            self.scheduler.fail_all("engine stopped")

    def run_cycle(self, obs=None, noise: np.ndarray | None = None) -> CycleReport:
        """One frame cycle (a decode-only cycle when obs is None). Public so the benchmark and tests can
        drive the engine synchronously, without its thread."""
        start = self.clock()
        report = CycleReport(None, start)
        self.scheduler.expire(start)
        with contextlib.ExitStack() as cycle:       # the cycle's frame reference, released on every path
            frame = None
            if obs is not None and not self.faulted:
                frame = self._frame(obs, noise, report, cycle)
            if frame is not None or self.scheduler.has_work:
                self._language(frame, report)
        report.duration_s = self.clock() - start
        report.deadline_missed = obs is not None and report.duration_s > self.frame_period
        self.stats.record(report, self.mailbox_dropped, self.active_requests, self.queued_requests)
        return report

    # ------------------------------------------------------------------ frame: prefill + actions
    def _frame(self, obs, noise, report: CycleReport, cycle: contextlib.ExitStack) -> FrameCache | None:
        index = self._frame_index
        self._frame_index += 1
        report.frame_index = index
        try:
            prepared = self.preparer.prepare(obs)
            noise_t = self.frame_noise(index) if noise is None else \
                torch.as_tensor(np.asarray(noise), dtype=torch.float32)
        except InputError as e:
            report.frame_index = None          # no frame was computed: not counted as one
            self.stats.count("bad_observations")
            self.stats.note_error(f"observation rejected: {e}")
            log.warning("frame %d: observation rejected: %s", index, e)
            return None
        self._notify(self._frame_listeners, index, obs)
        try:
            t = self.clock()
            if self.config.subtask:
                prepared = self._with_subtask(prepared, obs.prompt, index)
            self._prepared = prepared
            frame = cycle.enter_context(self.runner.prefill(prepared.row, index, prepared.stamp))
            report.prefill_s = self.clock() - t
            t = self.clock()
            model_actions = self.runner.actions(frame, noise_t, self.config.denoise_steps)
            robot_actions = self.preparer.robot_actions(model_actions, prepared)
            # Rows are one control period apart (the rate the checkpoint was trained at); 0: one per publish tick.
            step_s = self.preparer.io.control_period_s or 1.0 / self.config.action_rate_hz
            plan = ActionChunkPlan(robot_actions, prepared.stamp, step_s, index)
            report.action_s = self.clock() - t
        except Exception as e:  # noqa: BLE001 - any failure of the frame's computation is a fault
            # NaN/inf (EngineFault), PoolExhausted (cannot happen while the reserve holds), device errors,
            # injected faults: the chunk is discarded, the publisher keeps its safe behaviour.
            self._fault(index, f"{type(e).__name__}: {e}", report)
            return None
        self._consecutive_faults = 0
        chunk = ChunkResult(plan, model_actions, self.clock() - report.start, prepared.prompt_truncated)
        if prepared.prompt_truncated:
            self.stats.count("prompts_truncated")
        self._latest_chunk = chunk
        self._notify(self._chunk_listeners, chunk)
        try:
            self._maybe_caption(index, report.start)
        except Exception as e:  # noqa: BLE001 - a caption is optional; the frame and its chunk are not
            self.stats.count("captions_failed")
            self.stats.note_error(f"frame {index}: caption not requested: {e}")
            log.exception("caption request failed")
        return frame

    def _with_subtask(self, prepared: PreparedFrame, task: str, index: int) -> PreparedFrame:
        """π0.5 subtask mode: greedy subtask text from the frame, then the action prompt conditioned on it."""
        c = self.config
        prompt = self.preparer.prompt_tokens(c.subtask_template.format(task=task))[:self.runner.cfg.max_token_len]
        row = PrefixRow(prepared.row.images, torch.tensor(prompt, dtype=torch.long))
        blocks = self.runner.pool.blocks
        with self.runner.prefill(row, index, prepared.stamp) as frame:
            own = blocks.allocate(max(1, blocks.blocks_for(c.subtask_max_tokens - 1)))
            try:
                logits, tokens = self.runner.frame_logits(frame), []
                while True:
                    (token,), (ok,) = sample(logits, [0.0], [1.0], [None])
                    if not ok:
                        raise EngineFault(f"frame {index}: non-finite logits in the subtask text")
                    if token == self.tokenizer.eos_id:
                        break
                    tokens.append(token)
                    if len(tokens) >= c.subtask_max_tokens or "\n" in self.tokenizer.decode([token]):
                        break
                    logits = self.runner.extend([TextRow(frame.segment, own, len(tokens) - 1, [token])])
            finally:
                blocks.decref(own)
        self._subtask_text = self.tokenizer.decode(tokens).strip()
        return self.preparer.retokenize(prepared, c.action_task_template.format(task=task, subtask=self._subtask_text))

    def _fault(self, index: int, message: str, report: CycleReport) -> None:
        self._consecutive_faults += 1
        report.fault = message
        self.stats.count("faults")
        self.stats.note_error(f"frame {index}: {message}")
        log.error("frame %d discarded: %s", index, message)
        if self._consecutive_faults >= self.config.max_consecutive_faults:
            self.faulted = f"{self._consecutive_faults} consecutive faulty frames, last: {message}"
            log.error("engine safe stop: %s", self.faulted)
            self._latest_chunk = None
            self.scheduler.fail_all(f"engine stopped after repeated faults: {message}")

    def _notify(self, listeners: list, *args) -> None:
        with self._lock:
            listeners = list(listeners)
        for fn in listeners:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a listener's bug must not break the cycle or leak its frame
                self.stats.count("listener_errors")
                log.exception("engine listener raised")

    def _maybe_caption(self, index: int, now: float) -> None:
        c = self.config
        due = (c.memory_every_frames and (self._last_memory_frame is None
                                          or index - self._last_memory_frame >= c.memory_every_frames)) or \
              (c.memory_period_s and (self._last_memory_time is None
                                      or now - self._last_memory_time >= c.memory_period_s))
        if not due:
            return
        self._last_memory_frame, self._last_memory_time = index, now
        handle = self.submit(TextRequest(c.memory_prompt, max_tokens=c.memory_max_tokens, kind="memory"))
        handle.add_done_callback(self._on_caption)

    def _on_caption(self, reply: Reply) -> None:
        if not reply.success:
            self.stats.count("captions_failed")
            return
        caption = Caption(reply.frame_stamp, reply.frame_index, self.config.memory_prompt, reply.text)
        self._captions.append(caption)
        self._notify(self._caption_listeners, caption)

    # ------------------------------------------------------------------ language
    def _language(self, frame: FrameCache | None, report: CycleReport) -> None:
        sched = self.scheduler
        t = self.clock()
        if frame is not None:
            admitted = self._admit(frame, report)
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
        deadline = report.start + self.frame_period
        steps = 0
        while sched.running:
            batch = sched.decode_batch()
            if not sched.budget.another_step(steps, self.clock(), deadline, len(batch)):
                break
            if frame is None and self._mailbox.pending:
                report.preempted = True        # a new frame is waiting: actions first
                break
            s = self.clock()
            self._decode_step(batch, report)
            sched.budget.observe(len(batch), self.clock() - s)
            steps += 1
        report.decode_s = self.clock() - t

    def _attach(self, frame: FrameCache) -> FrameCache:
        if self.config.policy == "isolated":   # openpi-style: the request gets its own prefill of the frame
            return self.runner.prefill(self._prepared.row, frame.frame_index, frame.stamp)
        return frame.retain()

    def _admit(self, frame: FrameCache, report: CycleReport) -> list[Sequence]:
        """Admit what fits, prefill the questions in one batched forward and sample the first tokens."""
        admitted = self.scheduler.admit(frame, self._attach)
        if not admitted:
            return []
        report.admitted += len(admitted)
        with_question = [s for s in admitted if s.question]
        groups = [[s] for s in with_question] if self.config.policy != "oxygen" else [with_question]
        try:
            for group in filter(None, groups):
                logits = self.runner.extend([TextRow(s.frame.segment, s.blocks, s.own_len, s.question)
                                             for s in group])
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


def _graphs_by_default(runner: ModelRunner) -> bool:
    """CUDA graphs when the model runs the Triton kernels on CUDA (what they are for)."""
    return runner.backend == "triton" and runner.model.device.type == "cuda"


__all__ = ["Engine", "EngineConfig", "EngineInfo", "ChunkResult", "Caption", "CycleReport", "POLICIES",
           "Sampling", "TextRequest"]
