"""The unified-KV engine: one thread owns the device and runs the frame cycle.

Frame cycle (policy `oxygen`):
  1. take the newest observation (older ones were dropped and counted) and prefill it once -> FrameCache;
  2. action chunk: N flow-matching steps of the expert over that KV (first, so it meets its deadline);
  3. language: admit queued requests (attach to this frame, prefill their questions on top of its prefix,
     their first token comes out), then advance every active request together, one batched decode step
     at a time, whatever frame each is attached to, while the cycle's budget lasts;
  4. release: finished requests and the cycle drop their frame references; blocks return to the pool.
The other policies exist for side-by-side runs on the same engine: `isolated` (openpi-style: a separate
prefill for the action and for each request, each reply decoded to completion inside the frame) and
`shared_kv` (one prefill; replies still decoded to completion inside the frame).

Callers (ROS nodes, the benchmark) use the thread-safe API: `submit_observation` (latest wins),
`latest_chunk`, `submit` (a request -> RequestHandle), `captions`, `stats`. Nothing they call blocks on
the engine, and the engine never waits for them.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from oxygen_ros.robot.chunks import ActionChunkPlan
from oxygen_ros.robot.errors import InputError
from oxygen_ros.robot.text import validate_text

from .kv_pool import FrameCache, PoolExhausted
from .requests import ActiveRequest, Reply, RequestHandle, Sampling, TextRequest, refused, sample_tokens
from .runner import EngineFault, ModelRunner, PreparedFrame
from .scheduler import DecodeBudget
from .stats import EngineStats

log = logging.getLogger("oxygen_ros.engine")

POLICIES = ("isolated", "shared_kv", "oxygen")


@dataclass
class EngineConfig:
    policy: str = "oxygen"
    action_rate_hz: float = 70.0          # chunk rows are 1/action_rate_hz apart; frame period = H / rate
    decode_budget: str = "deadline"       # "deadline": decode while the frame period lasts; "fixed"
    tokens_per_frame: int = 5             # "fixed": decode steps per cycle (the paper's setting)
    min_tokens_per_frame: int = 1         # "deadline": at least this many steps per cycle (progress)
    max_active_requests: int = 32         # decode batch cap
    max_queued_requests: int = 64         # bounded wait queue; beyond it requests are refused ("busy")
    max_tokens_limit: int = 256           # largest max_tokens a request may ask for
    max_question_chars: int = 2000
    question_template: str = "{text}\n"
    denoise_steps: int | None = None      # None: the model config's
    memory_prompt: str = "Describe the scene."
    memory_every_frames: int = 0          # 0 = off
    memory_period_s: float = 0.0          # 0 = off
    memory_max_tokens: int = 24
    memory_log_size: int = 100
    subtask: bool = False                 # π0.5 subtask mode
    subtask_template: str = "{task}. Subtask:"
    action_task_template: str = "{task}. Subtask: {subtask}"
    subtask_max_tokens: int = 12
    max_consecutive_faults: int = 5       # then the engine stops producing actions until reset
    seed: int = 0
    cuda_graphs: bool | None = None       # decode steps and denoise loops as CUDA graphs (graphs.py); None:
                                          # on when the model runs the Triton kernels on CUDA. True on the
                                          # CPU replays the same fixed-shape steps eagerly (tests)
    ignore_eos: bool = False              # benchmark only: EOS is kept as an ordinary token, so every reply
                                          # runs to max_tokens (or a stop string); never set it when serving

    def validate(self) -> None:
        problems = []
        if self.policy not in POLICIES:
            problems.append(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.decode_budget not in ("deadline", "fixed"):
            problems.append(f"decode_budget must be 'deadline' or 'fixed', got {self.decode_budget!r}")
        if not self.action_rate_hz > 0:
            problems.append(f"action_rate_hz must be positive, got {self.action_rate_hz}")
        for name in ("tokens_per_frame", "max_active_requests", "max_tokens_limit", "max_question_chars",
                     "memory_max_tokens", "memory_log_size", "subtask_max_tokens", "max_consecutive_faults"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("min_tokens_per_frame", "max_queued_requests", "memory_every_frames"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if "{text}" not in self.question_template:
            problems.append("question_template must contain {text}")
        if problems:
            raise ValueError("invalid engine config: " + "; ".join(problems))


@dataclass(frozen=True)
class ChunkResult:
    plan: ActionChunkPlan          # robot units; row k is meant for stamp + k / action_rate_hz
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
    finished: int = 0
    duration_s: float = 0.0
    deadline_missed: bool = False
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

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config or EngineConfig()
        self.config.validate()
        self.runner = runner
        self.clock = clock
        cfg = runner.cfg
        self.horizon = cfg.action_horizon
        self.frame_period = self.horizon / self.config.action_rate_hz
        self.budget = DecodeBudget(self.config.decode_budget, self.config.tokens_per_frame,
                                   self.config.min_tokens_per_frame)
        # Room kept free for the next frame's prefill: actions never starve for KV blocks.
        self.reserve_blocks = runner.pool.blocks_for(runner.max_prefix_tokens())
        if runner.pool.num_blocks < 2 * self.reserve_blocks:
            raise ValueError(f"KV pool of {runner.pool.num_blocks} blocks cannot hold two frame prefixes of "
                             f"{self.reserve_blocks} blocks: raise the KV memory budget")
        self._mailbox = _Mailbox()
        self._lock = threading.Lock()                       # guards _queue and listeners
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._active: list[ActiveRequest] = []
        self._latest_chunk: ChunkResult | None = None
        self._captions: collections.deque[Caption] = collections.deque(maxlen=self.config.memory_log_size)
        self._chunk_listeners: list[Callable[[ChunkResult], None]] = []
        self._caption_listeners: list[Callable[[Caption], None]] = []
        self._frame_listeners: list[Callable[[int, object], None]] = []
        self._frame_index = 0
        self._last_memory_frame: int | None = None
        self._last_memory_time: float | None = None
        self._subtask_text = ""
        self._prepared: PreparedFrame | None = None             # the current frame's inputs (isolated policy)
        self._consecutive_faults = 0
        self.faulted = ""                                   # non-empty: safe stop, reason
        self.stats = EngineStats(self.horizon, self.frame_period, runner.pool)
        self._start_graphs()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _start_graphs(self) -> None:
        """Fixed-shape steps (graphs.py): captured now on CUDA, not in the middle of a control cycle. When
        they are only the default (cuda_graphs unset) a failed capture is not fatal: the engine runs eagerly
        and says so (log, diagnostics); when asked for explicitly, it is."""
        explicit = self.config.cuda_graphs is not None
        if not (self.config.cuda_graphs if explicit else _graphs_by_default(self.runner)):
            return
        capture = self.runner.model.device.type == "cuda"
        try:
            steps = self.runner.enable_graphs(self.config.max_active_requests,
                                              self.config.max_question_chars + self.config.max_tokens_limit, capture)
            if capture:
                steps.warm_up(self.config.denoise_steps or self.runner.cfg.num_denoise_steps)
        except Exception as e:
            if explicit:
                raise
            self.runner.graphs = None
            message = f"CUDA graphs unavailable, running eagerly (slower): {e}"
            log.warning(message)
            self.stats.note_error(message)
            self.stats.count("graph_capture_failures")
        self.stats.graphs = self.runner.graphs

    # ================================================================== caller API (any thread)
    def submit_observation(self, obs, noise: np.ndarray | None = None) -> None:
        """Hand over the newest observation (oxygen_ros.robot.sync.Observation). Never blocks."""
        self._mailbox.put((obs, noise))

    def latest_chunk(self) -> ChunkResult | None:
        return self._latest_chunk

    def add_chunk_listener(self, fn: Callable[[ChunkResult], None]) -> None:
        """fn(chunk) runs on the engine thread for every new chunk: it must return at once."""
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
        """Queue a language request. Invalid or over-capacity requests come back already finished, with
        success False and the reason in `error` (finish_reason "refused"): nothing is dropped silently."""
        now = self.clock()
        try:
            text = validate_text(request.text, what="question", max_chars=self.config.max_question_chars) \
                if request.kind != "subtask" else request.text
        except InputError as e:
            self.stats.count("refused_invalid")
            return refused(request, str(e), now)
        if not 1 <= request.max_tokens <= self.config.max_tokens_limit:
            self.stats.count("refused_invalid")
            return refused(request, f"max_tokens must be in 1..{self.config.max_tokens_limit}, "
                                    f"got {request.max_tokens}", now)
        if self.faulted:
            return refused(request, f"engine stopped after repeated faults: {self.faulted}", now)
        handle = RequestHandle(request if text == request.text else _with_text(request, text), now)
        with self._lock:
            if len(self._queue) >= self.config.max_queued_requests:
                self.stats.count("refused_busy")
                return refused(request, f"busy: {len(self._queue)} requests already waiting "
                                        f"(max_queued_requests={self.config.max_queued_requests})", now)
            self._queue.append(handle)
        self.stats.count("submitted")
        self._mailbox.wake()
        return handle

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="oxygen-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; every unfinished request gets an error reply."""
        self._stop.set()
        self._mailbox.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._fail_all("engine stopped")

    def reset_fault(self) -> None:
        """Leave the safe stop after repeated faults (an operator decision, e.g. the enable service)."""
        self.faulted = ""
        self._consecutive_faults = 0

    @property
    def active_requests(self) -> int:
        return len(self._active)

    @property
    def queued_requests(self) -> int:
        return len(self._queue)

    # ================================================================== engine thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            item = self._mailbox.take(timeout=self.frame_period)
            if self._stop.is_set():
                break
            if item is None and not self._active and not self._queue:
                continue
            try:
                self.run_cycle(*(item or (None, None)))
            except Exception:  # the loop must survive anything; run_cycle already reported it
                log.exception("engine cycle failed")

    def run_cycle(self, obs=None, noise: np.ndarray | None = None) -> CycleReport:
        """One frame cycle (a decode-only cycle when obs is None). Public so the benchmark and tests can
        drive the engine synchronously, without its thread."""
        start = self.clock()
        report = CycleReport(None, start)
        self._expire(start)
        frame: FrameCache | None = None
        try:
            if obs is not None and not self.faulted:
                frame = self._frame(obs, noise, report)
            if frame is not None or self._active or self._queue:
                self._language(frame, report)
        finally:
            if frame is not None:
                frame.release()                     # the cycle's own reference
        report.duration_s = self.clock() - start
        report.deadline_missed = obs is not None and report.duration_s > self.frame_period
        self.stats.record(report, self.mailbox_dropped, len(self._active), len(self._queue))
        return report

    @property
    def mailbox_dropped(self) -> int:
        return self._mailbox.dropped

    # ------------------------------------------------------------------ frame: prefill + actions
    def _frame(self, obs, noise, report: CycleReport) -> FrameCache | None:
        index = self._frame_index
        self._frame_index += 1
        report.frame_index = index
        try:
            prepared = self.runner.prepare(obs)
        except InputError as e:
            report.frame_index = None          # no frame was computed: not counted as one
            self.stats.count("bad_observations")
            self.stats.note_error(f"observation rejected: {e}")
            log.warning("frame %d: observation rejected: %s", index, e)
            return None
        for fn in list(self._frame_listeners):
            fn(index, obs)
        if noise is None:
            noise_t = self.frame_noise(index)
        else:
            noise_t = torch.as_tensor(np.asarray(noise), dtype=torch.float32)
        frame = None
        try:
            t = self.clock()
            if self.config.subtask:
                prepared = self._with_subtask(prepared, obs.prompt, index)
            self._prepared = prepared
            frame = self.runner.prefill(prepared, index)
            report.prefill_s = self.clock() - t
            t = self.clock()
            model_actions, robot_actions = self.runner.actions(frame, noise_t, self.config.denoise_steps,
                                                               np.asarray(obs.state, dtype=np.float64))
            report.action_s = self.clock() - t
        except Exception as e:  # noqa: BLE001 - any failure of the frame's computation is a fault
            # NaN/inf (EngineFault), PoolExhausted (cannot happen while the reserve holds), device errors,
            # injected faults: the chunk is discarded, the publisher keeps its safe behaviour.
            if frame is not None:
                frame.release()
            self._fault(index, f"{type(e).__name__}: {e}", report)
            return None
        self._consecutive_faults = 0
        plan = ActionChunkPlan(robot_actions, prepared.stamp, 1.0 / self.config.action_rate_hz, index)
        chunk = ChunkResult(plan, model_actions, self.clock() - report.start, prepared.prompt_truncated)
        if prepared.prompt_truncated:
            self.stats.count("prompts_truncated")
        self._latest_chunk = chunk
        for fn in list(self._chunk_listeners):
            fn(chunk)
        self._maybe_caption(index, report.start)
        return frame

    def _with_subtask(self, prepared: PreparedFrame, task: str, index: int) -> PreparedFrame:
        """π0.5 subtask mode: greedy subtask text from the frame, then the action prompt conditioned on it."""
        tokenizer = self.runner.tokenizer
        prompt = [tokenizer.bos_id] + tokenizer.encode(self.config.subtask_template.format(task=task))
        frame = self.runner.prefill(prepared, index, tokens=prompt[:self.runner.cfg.max_token_len])
        try:
            logits = self.runner.frame_logits(frame)
            blocks = self.runner.pool.allocator.allocate(
                self.runner.request_blocks(0, self.config.subtask_max_tokens))
            req = ActiveRequest(RequestHandle(TextRequest("", kind="subtask"), self.clock()), [], frame.retain(),
                                blocks, self.clock(), None)
            try:
                tokens = []
                while True:
                    token = int(torch.argmax(logits[0]))
                    if token == tokenizer.eos_id:
                        break
                    tokens.append(token)
                    if len(tokens) >= self.config.subtask_max_tokens or "\n" in tokenizer.decode([token]):
                        break
                    logits = self.runner.extend([(req, [token])])
            finally:
                self._release(req)
        finally:
            frame.release()
        self._subtask_text = tokenizer.decode(tokens).strip()
        return self.runner.retokenize(
            prepared, self.config.action_task_template.format(task=task, subtask=self._subtask_text))

    @property
    def subtask_text(self) -> str:
        return self._subtask_text

    def _fault(self, index: int, message: str, report: CycleReport) -> None:
        self._consecutive_faults += 1
        report.fault = message
        self.stats.count("faults")
        self.stats.note_error(f"frame {index}: {message}")
        log.error("frame %d discarded: %s", index, message)
        if self._consecutive_faults >= self.config.max_consecutive_faults:
            self.faulted = (f"{self._consecutive_faults} consecutive faulty frames, last: {message}")
            log.error("engine safe stop: %s", self.faulted)
            self._latest_chunk = None
            self._fail_all(f"engine stopped after repeated faults: {message}")

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
        for fn in list(self._caption_listeners):
            fn(caption)

    # ------------------------------------------------------------------ language
    def _language(self, frame: FrameCache | None, report: CycleReport) -> None:
        t = self.clock()
        if frame is not None:
            admitted = self._admit(frame, report)
            if self.config.policy != "oxygen":
                # Decode each admitted reply to completion inside the frame, one request at a time.
                report.admit_s = self.clock() - t
                t = self.clock()
                for req in admitted:
                    while req in self._active:
                        self._decode_step([req], report)
                report.decode_s = self.clock() - t
                return
        report.admit_s = self.clock() - t
        t = self.clock()
        deadline = report.start + self.frame_period
        steps = 0
        while self._active and self.budget.another_step(steps, self.clock(), deadline, len(self._active)):
            s = self.clock()
            batch = self._active[:self.config.max_active_requests]
            self._decode_step(batch, report)
            self.budget.observe(len(batch), self.clock() - s)
            steps += 1
        report.decode_s = self.clock() - t

    def _admit(self, frame: FrameCache, report: CycleReport) -> list[ActiveRequest]:
        """Attach queued requests to this frame while there is room (batch cap and KV blocks beyond the
        reserve); prefill their questions in one batched forward and sample their first tokens."""
        admitted: list[ActiveRequest] = []
        isolated = self.config.policy == "isolated"
        alloc = self.runner.pool.allocator
        while True:
            with self._lock:
                if not self._queue or len(self._active) + len(admitted) >= self.config.max_active_requests:
                    break
                handle = self._queue[0]
                question = self._question(handle.request)
                need = self.runner.request_blocks(len(question), handle.request.max_tokens)
                prefix_need = len(frame.segment.blocks) if isolated else 0
                if alloc.num_free - need - prefix_need < self.reserve_blocks:
                    self.stats.count("admission_waits")   # back-pressure: it stays queued
                    break
                self._queue.popleft()
            if handle.cancelled:
                handle._finish(self._reply(handle, None, [], "", "cancelled", "cancelled before admission"))
                continue
            req_frame = None
            try:
                # isolated (openpi-style): the request gets its own prefill of the same observation.
                req_frame = self.runner.prefill(self._prepared, frame.frame_index) if isolated else frame.retain()
                blocks = alloc.allocate(need)
            except (PoolExhausted, EngineFault, RuntimeError) as e:
                if req_frame is not None:
                    req_frame.release()
                handle._finish(self._reply(handle, None, [], "", "error", f"could not admit: {e}"))
                continue
            gen = None
            s = handle.request.sampling
            if s.temperature > 0:
                gen = torch.Generator().manual_seed(s.seed)
            admitted.append(ActiveRequest(handle, question, req_frame, blocks, self.clock(), gen))
        if not admitted:
            return []
        report.admitted += len(admitted)
        self._active.extend(admitted)
        try:
            with_question = [r for r in admitted if r.question]
            groups = [[r] for r in with_question] if self.config.policy != "oxygen" else [with_question]
            logits = {}
            for group in filter(None, groups):
                out = self.runner.extend([(r, r.question) for r in group])
                logits.update({id(r): out[i] for i, r in enumerate(group)})
            for r in admitted:
                if not r.question:
                    logits[id(r)] = self.runner.frame_logits(r.frame)[0]
        except Exception as e:  # a fault in the question prefill fails these requests only
            self.stats.count("faults")
            self.stats.note_error(f"question prefill failed: {e}")
            for r in admitted:
                self._finish(r, "error", f"question prefill failed: {e}")
            return []
        self._accept_tokens(admitted, torch.stack([logits[id(r)] for r in admitted]), report)
        return admitted

    def _question(self, request: TextRequest) -> list[int]:
        if request.kind == "subtask" or not request.text:
            return []
        return self.runner.question_tokens(request.text, self.config.question_template)

    def _decode_step(self, batch: list[ActiveRequest], report: CycleReport) -> None:
        try:
            logits = self.runner.extend([(r, [r.tokens[-1]]) for r in batch])
        except Exception as e:  # cannot attribute a batched failure: fail the batch, keep the engine
            self.stats.count("faults")
            self.stats.note_error(f"decode step failed: {e}")
            log.exception("decode step failed")
            for r in batch:
                self._finish(r, "error", f"decode step failed: {e}")
            return
        report.decode_steps += 1
        report.batch_sizes.append(len(batch))
        self._accept_tokens(batch, logits, report)

    def _accept_tokens(self, batch: list[ActiveRequest], logits: torch.Tensor, report: CycleReport) -> None:
        ok = torch.isfinite(logits).all(dim=-1).tolist()
        tokens = sample_tokens(logits, [r.request.sampling for r in batch], [r.generator for r in batch])
        tokenizer = self.runner.tokenizer
        for r, token, good in zip(batch, tokens, ok):
            if not good:
                self._finish(r, "error", "the model produced non-finite logits")
                continue
            report.tokens += 1
            if token == tokenizer.eos_id and not self.config.ignore_eos:
                self._finish(r, "eos")
                continue
            r.tokens.append(token)
            text = tokenizer.decode(r.tokens)
            stop_at = min((i for i in (text.find(s) for s in r.request.stop if s) if i >= 0), default=-1)
            if stop_at >= 0:
                r.text = text[:stop_at]
                self._finish(r, "stop")
                continue
            if text != r.text:
                r.text = text
                r.handle._publish_partial(text, len(r.tokens))
            if len(r.tokens) >= r.request.max_tokens:
                self._finish(r, "length")
            elif r.handle.cancelled:
                self._finish(r, "cancelled", "cancelled")

    def _expire(self, now: float) -> None:
        """Requests past their timeout or cancelled: reply and release, queued or active."""
        for r in list(self._active):
            if r.handle.cancelled:
                self._finish(r, "cancelled", "cancelled")
            elif now - r.handle.submitted_at > r.request.timeout_s:
                self._finish(r, "timeout", f"timed out after {r.request.timeout_s:g} s")
        with self._lock:
            keep = collections.deque()
            expired = []
            for h in self._queue:
                if h.cancelled:
                    expired.append((h, "cancelled", "cancelled before admission"))
                elif now - h.submitted_at > h.request.timeout_s:
                    expired.append((h, "timeout", f"timed out after {h.request.timeout_s:g} s in the queue"))
                else:
                    keep.append(h)
            self._queue = keep
        for h, reason, msg in expired:
            h._finish(self._reply(h, None, [], "", reason, msg))

    def _finish(self, r: ActiveRequest, reason: str, error: str = "") -> None:
        if r in self._active:
            self._active.remove(r)
        reply = self._reply(r.handle, r, r.tokens, r.text, reason, error)
        self._release(r)
        r.handle._finish(reply)
        self.stats.count(f"finished_{reason}")

    def _release(self, r: ActiveRequest) -> None:
        if r.blocks:
            self.runner.pool.allocator.decref(r.blocks)
            r.blocks = ()
        if r.frame is not None:
            r.frame.release()
            r.frame = None

    def _reply(self, h: RequestHandle, r: ActiveRequest | None, tokens, text, reason, error="") -> Reply:
        now = self.clock()
        success = reason in ("stop", "length", "eos")
        frame = r.frame if r is not None else None
        return Reply(success, text, list(tokens), reason, error,
                     frame.frame_index if frame is not None else -1,
                     frame.stamp if frame is not None else 0.0,
                     (r.admitted_at - h.submitted_at) if r is not None else now - h.submitted_at,
                     now - h.submitted_at)

    def _fail_all(self, message: str) -> None:
        for r in list(self._active):
            self._finish(r, "error", message)
        with self._lock:
            queued, self._queue = list(self._queue), collections.deque()
        for h in queued:
            h._finish(self._reply(h, None, [], "", "error", message))


def _graphs_by_default(runner: ModelRunner) -> bool:
    """CUDA graphs when the model runs the Triton kernels on CUDA (what they are for)."""
    return runner.backend == "triton" and runner.model.device.type == "cuda"


def _with_text(request: TextRequest, text: str) -> TextRequest:
    from dataclasses import replace

    return replace(request, text=text)


__all__ = ["Engine", "EngineConfig", "ChunkResult", "Caption", "CycleReport", "Sampling", "TextRequest"]
