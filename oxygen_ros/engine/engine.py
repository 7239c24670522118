"""The unified-KV engine: one thread owns the device and runs the frame cycle.

Robots: one engine serves N robots (issue #17), each a name with its own policy I/O (cameras, action
dims, transforms, norm stats: a `FramePreparer` each); the model and the KV pool are shared. The
single-robot engine is the robot "" (the default of every call).

Frame cycle (policy `oxygen`):
  1. take each robot's newest observation (older ones of the same robot were dropped and counted; one
     robot's frames never displace another's). At most `max_robots_per_cycle` frames per cycle, earliest
     deadline first (deadline = arrival on the engine clock + the robot's chunk period); the others wait
     for the next cycle (counted as deferred). Prefill them once, together: ONE model forward -> a
     FrameCache per robot;
  2. action chunks: N flow-matching steps of the expert over those KVs, all frames denoised together
     (first, so they meet their deadlines);
  3. language (the scheduler): admit queued requests round-robin between owners (each attaches to its
     owner's frame of this cycle, prefill their questions on top of its prefix, their first token comes
     out), then advance every running request together, one batched decode step at a time, whatever frame
     or robot each is attached to, while the cycle's budget lasts; a cycle without a frame stops at the
     next step boundary when a new observation arrives;
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
from typing import Callable, Mapping

import numpy as np
import torch

from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.model.sampler import sample
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.robot.chunks import ActionChunkPlan
from oxygen_ros.robot.errors import InputError

from .config import POLICIES, EngineConfig
from .frames import FramePreparer, PreparedFrame
from .intake import Intake, Pending, PreparerThread
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
    robot: str = ""                # whose policy I/O (action_dim, chunk period) this describes
    chunk_period_s: float = 0.0    # the robot's frame deadline after its observation arrives


@dataclass(frozen=True)
class ChunkResult:
    plan: ActionChunkPlan          # robot units; row k is meant for stamp + k * control period
    model_actions: np.ndarray      # [H, action_dim] the expert's output before un-normalisation
    compute_s: float               # cycle start -> chunk ready (engine clock)
    prompt_truncated: int          # prompt tokens cut to fit the model's max_token_len
    robot: str = ""                # whose chunk (listeners get every robot's chunks)


@dataclass(frozen=True)
class Caption:
    stamp: float
    frame_index: int
    prompt: str
    text: str
    robot: str = ""                # whose camera the caption describes


@dataclass
class CycleReport:
    frame_index: int | None        # the cycle's first frame (None: a decode-only cycle)
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
    robots: list = field(default_factory=list)      # whose frames this cycle computed, in robot order
    chunks: int = 0                                 # action chunks it delivered
    deferred: list = field(default_factory=list)    # robots whose pending frame waits for the next cycle
    prepare_s: float = 0.0         # observations converted on the engine thread (inline preparation)
    prepared_ahead: int = 0        # frames whose inputs the preparer thread had made


@dataclass
class _Frame:
    """One robot's frame inside a cycle."""

    robot: str
    index: int
    prepared: PreparedFrame
    noise: torch.Tensor
    deadline: float
    task: str                                  # the observation's prompt (subtask mode asks about it)
    cache: FrameCache | None = None


class Engine:
    def __init__(self, runner: ModelRunner, preparer: FramePreparer | Mapping[str, FramePreparer],
                 tokenizer: Tokenizer, config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """`preparer`: one robot's (the robot "") or {robot name: its FramePreparer} for a fleet."""
        self.config = config or EngineConfig()
        self.config.validate()
        self.preparers: dict[str, FramePreparer] = dict(preparer) if isinstance(preparer, Mapping) else {"": preparer}
        if not self.preparers or not all(isinstance(r, str) for r in self.preparers):
            raise ValueError(f"an engine serves one or more robots named by strings, got {list(self.preparers)}")
        self.robots: tuple[str, ...] = tuple(self.preparers)
        self.runner, self.tokenizer = runner, tokenizer
        self.preparer = self.preparers[self.robots[0]]       # the default robot's (robot "" when single)
        self.clock = clock
        self.horizon = runner.cfg.action_horizon
        self.frame_period = self.horizon / self.config.action_rate_hz
        pool = runner.pool
        # Room kept free for the next frame's prefill: actions never starve for KV blocks.
        prefix_blocks = pool.blocks_for(runner.max_prefix_tokens())
        per_cycle = min(len(self.robots), self.config.max_robots_per_cycle)
        if pool.num_blocks < 2 * per_cycle * prefix_blocks:
            raise ValueError(f"KV pool of {pool.num_blocks} blocks cannot hold two cycles of {per_cycle} frame "
                             f"prefixes of {prefix_blocks} blocks: raise the KV memory budget")
        self.stats = EngineStats(self.horizon, self.frame_period, pool.blocks, self.robots)
        # Admission keeps room for the next cycle's prefills: up to max_robots_per_cycle frames.
        self.scheduler = Scheduler(self.config, pool.blocks, tokenizer, per_cycle * prefix_blocks, prefix_blocks, self.stats,
                                   lambda: self.clock(), self.robots)
        self.prepare_ahead = self.config.prepare_ahead if self.config.prepare_ahead is not None else \
            runner.model.device.type == "cuda"
        self._intake = Intake(self.robots)
        self._preparer_thread = PreparerThread(self._intake, self.preparers, lambda: self.clock())
        self._lock = threading.Lock()                       # guards the listener lists
        self._latest_chunks: dict[str, ChunkResult | None] = dict.fromkeys(self.robots)
        self._captions: collections.deque[Caption] = collections.deque(maxlen=self.config.memory_log_size)
        self._chunk_listeners: list[Callable[[ChunkResult], None]] = []
        self._caption_listeners: list[Callable[[Caption], None]] = []
        self._frame_listeners: list[Callable[[int, object], None]] = []
        self._frame_index = 0
        self._last_memory: dict[str, tuple[int, float] | None] = dict.fromkeys(self.robots)  # (frame, time)
        self._subtask_text = ""
        self._rows: dict[int, PrefixRow] = {}                # the last frame cycle's inputs (isolated policy)
        self._consecutive_faults = 0
        self.faulted = ""                                   # non-empty: safe stop, reason
        self._start_graphs()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._infos = {r: EngineInfo(
            tuple(runner.cfg.camera_slots), p.robot_action_dim, runner.cfg.action_dim, self.horizon,
            self.config.action_rate_hz, self.frame_period, self.config.policy, runner.backend,
            runner.graphs is not None, pool.num_blocks, pool.block_size, self.config.max_question_chars,
            self.config.max_queued_requests, r, self._chunk_period(p)) for r, p in self.preparers.items()}
        self.info = self._infos[self.robots[0]]

    def _chunk_period(self, preparer: FramePreparer) -> float:
        """A robot's frame deadline after its observation arrives: the time its chunk covers at its control
        period (horizon x control_period_s), else the engine's frame period (horizon / action_rate_hz)."""
        period = preparer.io.control_period_s
        return self.horizon * period if period > 0 else self.frame_period

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
    def submit_observation(self, obs, noise: np.ndarray | None = None, robot: str = "") -> None:
        """Hand over a robot's newest observation (oxygen_ros.robot.sync.Observation); it replaces that
        robot's unconsumed older one (counted as dropped). Never blocks. ValueError for an unknown robot."""
        self._intake.put(self._robot(robot), Pending(obs, noise, self.clock() + self._infos[robot].chunk_period_s))

    def latest_chunk(self, robot: str = "") -> ChunkResult | None:
        return self._latest_chunks[self._robot(robot)]

    def robot_info(self, robot: str = "") -> EngineInfo:
        """What a node may know about one robot's side of the engine (action_dim etc. are per robot)."""
        return self._infos[self._robot(robot)]

    def _robot(self, robot: str) -> str:
        if robot not in self._infos:
            raise ValueError(f"unknown robot {robot!r}: this engine serves {list(self.robots)}")
        return robot

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
        self._intake.wake()
        return handle

    def start(self) -> None:
        if self._thread is not None:
            if self._thread.is_alive() and not self._stop.is_set():
                return
            if self._thread.is_alive():
                raise RuntimeError("the previous engine thread has not stopped yet: cannot start another")
        self._stop.clear()
        self.scheduler.reopen()
        if self.prepare_ahead:
            self._preparer_thread.start()
        self._thread = threading.Thread(target=self._loop, name="oxygen-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the engine thread; new requests are refused from now on and every unfinished one gets an
        error reply. Returns False when the thread did not stop within `timeout` (a device call hangs):
        it then answers the unfinished requests itself when it exits, and `start` refuses to run a second
        loop beside it."""
        self.scheduler.close("engine stopped")
        self._stop.set()
        self._preparer_thread.stop(timeout)
        self._intake.wake()
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
        """Observations replaced by a newer one of the same robot before a cycle took them (all robots)."""
        return sum(self._intake.dropped.values())

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
        ahead = self.prepare_ahead                 # frames come prepared by the preparer thread
        try:
            while not self._stop.is_set():
                self._intake.wait(self.frame_period, prepared_only=ahead)
                if self._stop.is_set():
                    break
                if not self._intake.pending(prepared_only=ahead) and not self.scheduler.has_work:
                    continue
                try:
                    self._cycle({}, {}, prepared_only=ahead)
                except Exception:  # the loop must survive anything; _cycle already reported it
                    log.exception("engine cycle failed")
        finally:
            self.scheduler.fail_all("engine stopped")

    def run_cycle(self, obs=None, noise: np.ndarray | None = None, robot: str = "") -> CycleReport:
        """One frame cycle for one robot's observation (a decode-only cycle when obs is None and nothing is
        pending). Public so the benchmark and tests can drive the engine synchronously, without its thread."""
        if obs is None:
            return self.run_frames()
        return self.run_frames({robot: obs}, None if noise is None else {robot: noise})

    def run_frames(self, observations: Mapping[str, object] | None = None,
                   noise: Mapping[str, np.ndarray] | None = None) -> CycleReport:
        """One cycle over several robots' observations ({robot: obs}, optional {robot: noise}), together
        with what is pending in the mailboxes (the engine thread passes nothing and takes those): the
        frames of at most max_robots_per_cycle robots, earliest deadline first, are prefilled in one
        forward and denoised together; the others stay pending for the next cycle (counted as deferred).
        Synchronous (the benchmark and tests drive the engine with it): observations are prepared inline."""
        observations, noise = dict(observations or {}), dict(noise or {})
        unknown = [r for r in list(observations) + list(noise) if r not in self._infos]
        if unknown:
            raise ValueError(f"unknown robots {unknown}: this engine serves {list(self.robots)}")
        return self._cycle(observations, noise, prepared_only=False)

    def _cycle(self, observations: dict, noise: dict, prepared_only: bool) -> CycleReport:
        start = self.clock()
        for robot, obs in observations.items():
            self._intake.put(robot, Pending(obs, noise.get(robot), start + self._infos[robot].chunk_period_s))
        report = CycleReport(None, start)
        self.scheduler.expire(start)
        due, report.deferred = self._intake.take_due(len(self.robots) if self.faulted
                                                     else self.config.max_robots_per_cycle, prepared_only)
        if due:
            self._preparer_thread.cycle_started(start)
        for robot in report.deferred:
            self.stats.count_robot(robot, "deferred")
        with contextlib.ExitStack() as cycle:       # the cycle's frame references, released on every path
            frames = {}
            if due and not self.faulted:
                frames = self._frames(due, report, cycle)
            if frames or self.scheduler.has_work:
                self._language(frames, report)
        report.duration_s = self.clock() - start
        report.deadline_missed = bool(due) and report.duration_s > self.frame_period
        self._preparer_thread.cycle_ended(report.duration_s, bool(due))
        self.stats.record(report, dict(self._intake.dropped), self.active_requests, self.queued_requests)
        return report

    # ------------------------------------------------------------------ frames: prefill + actions
    def _frames(self, due: dict[str, Pending], report: CycleReport,
                cycle: contextlib.ExitStack) -> dict[str, FrameCache]:
        """Prepare each robot's observation, prefill them in one forward, denoise their chunks together,
        deliver the chunks. Returns {robot: frame} of the frames that succeeded (the cycle holds them)."""
        work: list[_Frame] = []
        for robot, pending in due.items():
            frame = self._prepare(robot, pending, report)
            if frame is not None:
                work.append(frame)
        if not work:
            return {}
        report.frame_index, report.robots = work[0].index, [f.robot for f in work]
        faults: list[tuple[_Frame, str]] = []      # frames discarded, and why
        t = self.clock()
        try:
            if self.config.subtask:
                work = [f for f in work if self._subtask_frame(f, faults)]
            self._rows = {f.index: f.prepared.row for f in work}
            caches = self.runner.prefill([f.prepared.row for f in work], [f.index for f in work],
                                         [f.prepared.stamp for f in work]) if work else []
            good = []
            for f, cache in zip(work, caches):
                if isinstance(cache, EngineFault):
                    faults.append((f, str(cache)))
                else:
                    f.cache = cycle.enter_context(cache)
                    good.append(f)
            report.prefill_s = self.clock() - t
            t = self.clock()
            chunks = []
            if good:
                noise = torch.stack([f.noise for f in good])
                for f, actions in zip(good, self.runner.actions([f.cache for f in good], noise,
                                                                self.config.denoise_steps)):
                    if isinstance(actions, EngineFault):
                        faults.append((f, str(actions)))
                        continue
                    try:
                        chunks.append((f, self._chunk(f, actions, report.start)))
                    except Exception as e:  # noqa: BLE001 - the robot's output transform failed: this frame only
                        faults.append((f, f"{type(e).__name__}: {e}"))
            report.action_s = self.clock() - t
        except Exception as e:  # noqa: BLE001 - any failure of the frames' computation is a fault
            # NaN/inf (EngineFault), PoolExhausted (cannot happen while the reserve holds), device errors,
            # injected faults: the chunks are discarded, the publishers keep their safe behaviour.
            for f in work:
                self._fault(f.robot, f.index, f"{type(e).__name__}: {e}", report)
            return {}
        for f, message in faults:
            self._fault(f.robot, f.index, message, report)
        if not chunks or self.faulted:
            return {}
        self._consecutive_faults = 0       # a cycle that delivers a chunk ends a run of faults
        for f, chunk in chunks:
            self._deliver(f, chunk)
        report.chunks = len(chunks)
        return {f.robot: f.cache for f, _ in chunks}

    def _prepare(self, robot: str, pending: Pending, report: CycleReport) -> _Frame | None:
        """A robot's observation -> model inputs (made ahead by the preparer thread, else here), or None (a
        bad observation, counted)."""
        index = self._frame_index
        self._frame_index += 1
        try:
            if pending.error is not None:
                raise pending.error
            if pending.prepared is not None:
                prepared = pending.prepared
                report.prepared_ahead += 1
            else:
                t = self.clock()
                prepared = self.preparers[robot].prepare(pending.obs)
                report.prepare_s += self.clock() - t
            noise = self.frame_noise(index) if pending.noise is None else \
                torch.as_tensor(np.asarray(pending.noise), dtype=torch.float32)
        except InputError as e:
            self.stats.count("bad_observations")
            self.stats.count_robot(robot, "bad_observations")
            self.stats.note_error(f"observation rejected{_of(robot)}: {e}")
            log.warning("frame %d%s: observation rejected: %s", index, _of(robot), e)
            return None
        self._notify(self._frame_listeners, index, pending.obs)
        return _Frame(robot, index, prepared, noise, pending.deadline, pending.obs.prompt)

    def _chunk(self, f: _Frame, model_actions: np.ndarray, start: float) -> ChunkResult:
        robot_actions = self.preparers[f.robot].robot_actions(model_actions, f.prepared)
        # Rows are one control period apart (the rate the checkpoint was trained at); 0: one per publish tick.
        step_s = self.preparers[f.robot].io.control_period_s or 1.0 / self.config.action_rate_hz
        plan = ActionChunkPlan(robot_actions, f.prepared.stamp, step_s, f.index)
        return ChunkResult(plan, model_actions, self.clock() - start, f.prepared.prompt_truncated, f.robot)

    def _deliver(self, f: _Frame, chunk: ChunkResult) -> None:
        now = self.clock()
        if chunk.prompt_truncated:
            self.stats.count("prompts_truncated")
        self.stats.record_chunk(f.robot, chunk.compute_s, now > f.deadline)
        self._latest_chunks[f.robot] = chunk
        self._notify(self._chunk_listeners, chunk)
        try:
            self._maybe_caption(f.robot, f.index, now)
        except Exception as e:  # noqa: BLE001 - a caption is optional; the frame and its chunk are not
            self.stats.count("captions_failed")
            self.stats.note_error(f"frame {f.index}: caption not requested: {e}")
            log.exception("caption request failed")

    def _subtask_frame(self, f: _Frame, faults: list) -> bool:
        try:
            f.prepared = self._with_subtask(f.robot, f.prepared, f.task, f.index)
            return True
        except Exception as e:  # noqa: BLE001 - this frame only
            faults.append((f, f"{type(e).__name__}: {e}"))
            return False

    def _with_subtask(self, robot: str, prepared: PreparedFrame, task: str, index: int) -> PreparedFrame:
        """π0.5 subtask mode: greedy subtask text from the frame, then the action prompt conditioned on it."""
        c = self.config
        preparer = self.preparers[robot]
        prompt = preparer.prompt_tokens(c.subtask_template.format(task=task))[:self.runner.cfg.max_token_len]
        row = PrefixRow(prepared.row.images, torch.tensor(prompt, dtype=torch.long))
        blocks = self.runner.pool.blocks
        with self.runner.prefill_one(row, index, prepared.stamp) as frame:
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
        return preparer.retokenize(prepared, c.action_task_template.format(task=task, subtask=self._subtask_text))

    def _fault(self, robot: str, index: int, message: str, report: CycleReport) -> None:
        self._consecutive_faults += 1
        report.fault = f"{report.fault}; {message}" if report.fault else message
        self.stats.count("faults")
        self.stats.count_robot(robot, "faults")
        self.stats.note_error(f"frame {index}{_of(robot)}: {message}")
        log.error("frame %d%s discarded: %s", index, _of(robot), message)
        if self._consecutive_faults >= self.config.max_consecutive_faults and not self.faulted:
            self.faulted = f"{self._consecutive_faults} consecutive faulty frames, last: {message}"
            log.error("engine safe stop: %s", self.faulted)
            self._latest_chunks = dict.fromkeys(self.robots)
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

    def _maybe_caption(self, robot: str, index: int, now: float) -> None:
        """Each robot's scene captions follow the memory settings on its own frames."""
        c = self.config
        last = self._last_memory[robot]
        due = (c.memory_every_frames and (last is None or index - last[0] >= c.memory_every_frames)) or \
              (c.memory_period_s and (last is None or now - last[1] >= c.memory_period_s))
        if not due:
            return
        self._last_memory[robot] = (index, now)
        handle = self.submit(TextRequest(c.memory_prompt, max_tokens=c.memory_max_tokens, kind="memory",
                                         owner=robot))
        handle.add_done_callback(lambda reply: self._on_caption(robot, reply))

    def _on_caption(self, robot: str, reply: Reply) -> None:
        if not reply.success:
            self.stats.count("captions_failed")
            return
        caption = Caption(reply.frame_stamp, reply.frame_index, self.config.memory_prompt, reply.text, robot)
        self._captions.append(caption)
        self._notify(self._caption_listeners, caption)

    # ------------------------------------------------------------------ language
    def _language(self, frames: dict[str, FrameCache], report: CycleReport) -> None:
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
        deadline = report.start + self.frame_period
        steps = 0
        while sched.running:
            batch = sched.decode_batch()
            if not sched.budget.another_step(steps, self.clock(), deadline, len(batch)):
                break
            if not frames and self._intake.pending(prepared_only=self._thread is not None and self.prepare_ahead):
                report.preempted = True        # a new frame is waiting: actions first
                break
            s = self.clock()
            self._decode_step(batch, report)
            sched.budget.observe(len(batch), self.clock() - s)
            steps += 1
        report.decode_s = self.clock() - t

    def _attach(self, frame: FrameCache) -> FrameCache:
        if self.config.policy == "isolated":   # openpi-style: the request gets its own prefill of the frame
            return self.runner.prefill_one(self._rows[frame.frame_index], frame.frame_index, frame.stamp)
        return frame.retain()

    def _admit(self, frames: dict[str, FrameCache], report: CycleReport) -> list[Sequence]:
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


def _of(robot: str) -> str:
    """" of robot 'name'" in messages, nothing for the single robot ""."""
    return f" of robot {robot!r}" if robot else ""


def _graphs_by_default(runner: ModelRunner) -> bool:
    """CUDA graphs when the model runs the Triton kernels on CUDA (what they are for)."""
    return runner.backend == "triton" and runner.model.device.type == "cuda"


__all__ = ["Engine", "EngineConfig", "EngineInfo", "ChunkResult", "Caption", "CycleReport", "POLICIES",
           "Sampling", "TextRequest"]
