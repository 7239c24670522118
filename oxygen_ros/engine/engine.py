"""The unified-KV engine: one thread owns the device and runs the frame cycle; the frame's tasks
(`tasks/`) read each frame's KV.

Robots (robots.py): each a name ("" when single) with its own policy I/O; the model and KV pool are shared.
Frame cycle (policy `oxygen`): take each robot's newest observation (at most `max_robots_per_cycle`,
earliest deadline first; the others wait: deferred) -> [hierarchy] each frame's prompt -> prefill the frames
in ONE forward (a `FrameCache` per robot; [hierarchy, joint] plus the causal subtask span) -> [actions]
every chunk denoised together and delivered first -> [captions, hierarchy] a caption or subtask request
when due -> [conversation] language admitted onto the frames (or a robot's last frame again) and decoded
while the budget lasts -> release (a `with` block; finished requests in `Scheduler.finish`).
Who owns what: ARCHITECTURE.md. Callers use the thread-safe API; nothing they call blocks on the engine.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Mapping

import numpy as np
import torch

from oxygen_ros.model.pi052 import Pi052Format
from oxygen_ros.robot.errors import InputError

from .capacity import Capacity, CapacityCheck
from .config import EngineConfig
from .cycle import CycleReport, Frame, Listeners
from .frames import FramePreparer
from .intake import Intake, Pending, PreparerThread
from .model_runner import EngineFault, ModelRunner
from .robots import EngineInfo, Robots
from .requests import RequestHandle, TextRequest, refused
from .scheduler import Scheduler
from .stats import EngineStats
from .tasks import (ActionsTask, Caption, CaptionsTask, ChunkResult, ConversationTask, HierarchyTask,
                    LanguageUpdate)

log = logging.getLogger("oxygen_ros.engine")


class Engine:
    def __init__(self, runner: ModelRunner, preparer: FramePreparer | Mapping[str, FramePreparer],
                 tokenizer, config: EngineConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 text_format: Pi052Format | None = None):
        """`preparer`: the robot ""'s, or {name: FramePreparer} for a fleet (may be empty: robots added at run
        time). `text_format`: a pi052 checkpoint's prompt format (hierarchy "auto" follows it)."""
        self.config = config or EngineConfig()
        self.config.validate()
        preparers = dict(preparer) if isinstance(preparer, Mapping) else {"": preparer}
        if not all(isinstance(r, str) for r in preparers):
            raise ValueError(f"an engine serves robots named by strings, got {list(preparers)}")
        self.runner, self.tokenizer, self.clock = runner, tokenizer, clock
        self.horizon = runner.cfg.action_horizon
        self.frame_period = self.horizon / self.config.action_rate_hz
        self._robots = Robots(runner, self.config, self.frame_period)
        self._capacity = CapacityCheck(runner, self.config)
        self._robots.check_pool(len(preparers))
        self.stats = EngineStats(self.horizon, self.frame_period, runner.pool.blocks, (), clock=lambda: self.clock())
        self.scheduler = Scheduler(self.config, runner.pool.blocks, tokenizer, 0, self._robots.prefix_blocks, self.stats,
                                   lambda: self.clock(), ())
        self.prepare_ahead = self.config.prepare_ahead if self.config.prepare_ahead is not None else \
            runner.model.device.type == "cuda"
        (self._chunk_listeners, self._caption_listeners, self._frame_listeners, self._discard_listeners,
         self._language_listeners, self._prepare_listeners) = (Listeners(self.stats) for _ in range(6))
        self._intake = Intake(())
        self._preparer_thread = PreparerThread(self._intake, lambda r: self.preparers.get(r), lambda: self.clock(),
                                               self._prepare_listeners)
        # The frame's tasks, in cycle order (tasks/): each owns its state.
        self.hierarchy = HierarchyTask(runner, tokenizer, self.config, text_format, self.scheduler.submit, self.stats,
                                       lambda: self.clock(), self._language_listeners)
        self.actions = ActionsTask(runner, self.config, self.stats, lambda: self.clock(), self._chunk_listeners)
        self.captions_task = CaptionsTask(self.config, self.stats, self.submit, self._caption_listeners)
        self.conversation = ConversationTask(runner, self.scheduler, self.config, self.stats, lambda: self.clock(),
                                             lambda: self._intake.pending(prepared_only=self._thread is not None
                                                                          and self.prepare_ahead))
        self._frame_index = 0
        self._consecutive_faults = 0
        self.faulted = ""                                   # non-empty: safe stop, reason
        if failure := runner.start_graphs(self.config):
            self.stats.note_error(failure)
            self.stats.count("graph_capture_failures")
        self.stats.graphs = runner.graphs
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        for name, p in preparers.items():
            self.add_robot(name, p)

    # ================================================================== robots (any thread)
    def add_robot(self, name: str, preparer: FramePreparer, captions: bool = True, rtc: bool = True) -> EngineInfo:
        """Serve one more robot from now on (`captions`: the memory settings apply to its frames; `rtc`: the
        engine's RTC guides its chunks: not for a robot playing chunks open-loop, like an openpi client).
        ValueError when the name is taken, the pool has no room for its frame, or (strict_capacity) it won't fit."""
        with self._robots.lock:
            self._capacity.check_added({**self._robots.chunk_periods(), name: self._robots.chunk_period(preparer)})
            info = self._robots.add(name, preparer)
            self.captions_task.set_enabled(name, captions)
            self.actions.set_rtc(name, rtc)
            self.stats.add_robot(name)
            self._intake.add_robot(name)
            self.scheduler.set_robots(self._robots.names, self._robots.reserve_blocks())
        return info

    def remove_robot(self, name: str, reason: str = "its robot left the engine") -> None:
        """Stop serving a robot: its pending observation is dropped, its requests end with `reason` (running
        ones at the next cycle's start), its statistics go; a chunk of a cycle under way may still come."""
        with self._robots.lock:
            self._robots.remove(name)
            self.scheduler.set_robots(self._robots.names, self._robots.reserve_blocks())
            self.scheduler.drop_owner(name, reason)
            self._intake.remove_robot(name)
            self._preparer_thread.forget(name)
            for task in (self.actions, self.captions_task, self.hierarchy):
                task.forget(name)
            self.stats.remove_robot(name)
        self._intake.wake()

    def capacity(self) -> Capacity:
        """Whether the robots fit their chunk periods (capacity.py; the first call measures the cycle cost on the
        caller's thread unless frame_cost_ms declares it: call it before `start`; strict_capacity: ValueError)."""
        return self._capacity.check(self._robots.chunk_periods(), may_measure=self._thread is None)

    @property
    def robots(self) -> tuple[str, ...]:
        return self._robots.names

    @property
    def preparers(self) -> dict[str, FramePreparer]:
        return self._robots.preparers

    @property
    def preparer(self) -> FramePreparer:            # the first robot's (the robot "" when single)
        return self.preparers[self.robots[0]]

    @property
    def info(self) -> EngineInfo:                   # the first robot's (the robot "" when single)
        return self._robots.infos[self.robots[0]]

    def robot_info(self, robot: str = "") -> EngineInfo:    # one robot's side of the engine (action_dim etc.)
        return self._robots.info(robot)

    # ================================================================== caller API (any thread)
    def submit_observation(self, obs, noise: np.ndarray | None = None, robot: str = "") -> None:
        """Hand over a robot's newest observation (oxygen_ros.robot.sync.Observation); it replaces that
        robot's unconsumed older one (counted as dropped). Never blocks. ValueError for an unknown robot."""
        now = self.clock()
        self._intake.put(robot, Pending(obs, noise, now + self.robot_info(robot).chunk_period_s), arrived=now)

    def latest_chunk(self, robot: str = "") -> ChunkResult | None:
        return self.actions.latest.get(self._robots.info(robot).robot)

    # Listeners run on the engine thread and must return at once; one that raises is logged, counted
    # (listener_errors) and stops nothing (cycle.Listeners).
    def add_chunk_listener(self, fn: Callable[[ChunkResult], None]) -> None:     # every robot's chunks
        self._chunk_listeners.add(fn)

    def add_caption_listener(self, fn: Callable[[Caption], None]) -> None:
        self._caption_listeners.add(fn)

    def add_frame_listener(self, fn: Callable[[int, object], None]) -> None:    # (frame index, observation)
        self._frame_listeners.add(fn)

    def add_discard_listener(self, fn: Callable[[str, str], None]) -> None:     # (robot, why): no chunk
        self._discard_listeners.add(fn)

    def add_prepare_listener(self, fn: Callable[[str, float], None]) -> None:   # (robot, seconds): see intake.py
        self._prepare_listeners.add(fn)       # also on the preparer thread: every conversion, used or not

    def add_language_listener(self, fn: Callable[[LanguageUpdate], None]) -> None:   # hierarchy texts
        self._language_listeners.add(fn)

    def language_state(self, robot: str = "") -> dict:
        """A robot's task, subtask, progress memory, plan and speech, each with the index and stamp of the frame
        it came from (`{kind}_frame` -1 when none yet). ValueError for an unknown robot."""
        return self.hierarchy.language_state(self._robots.info(robot).robot)

    def interject(self, text: str, robot: str = "", timeout_s: float = 30.0) -> RequestHandle:
        """The operator's interjection about a robot's task: when it finishes, the robot's plan and speech are
        updated (and the language listeners called); the Reply's text is the raw reply."""
        if robot not in self._robots.infos or self.faulted:
            return refused(TextRequest(str(text), kind="interjection", owner=robot), f"engine stopped: {self.faulted}"
                           if self.faulted else f"unknown robot {robot!r} (serving {list(self.robots)})", self.clock())
        handle = self.hierarchy.interject(text, robot, timeout_s)
        self._intake.wake()
        return handle

    def frame_noise(self, index: int) -> torch.Tensor:
        """Frame `index`'s flow-matching noise: of (seed, index) only, so a recording replays bit for bit."""
        seed = int(np.random.SeedSequence([self.config.seed, index]).generate_state(1)[0])
        return self.runner.noise(torch.Generator().manual_seed(seed))

    def captions(self) -> list[Caption]:
        return list(self.captions_task.log)

    def submit(self, request: TextRequest) -> RequestHandle:
        """Queue a language request. Invalid, never-fitting or over-capacity requests, and any once the engine
        stops or is in its safe stop, come back finished with finish_reason "refused" and the reason in `error`."""
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
        """Stop the engine thread; new requests are refused, every unfinished one gets an error reply. False when
        the thread did not stop within `timeout` (a hung device call): it answers them itself when it exits."""
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
        self.conversation.release_held()
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

    def reset_pool_peak(self) -> None:        # a new measurement of the peak KV blocks in use (pool_peak_blocks)
        self.runner.pool.blocks.reset_peak()

    def question_tokens(self, text: str) -> list[int]:     # what a question is appended as after the prefix
        return self.tokenizer.encode(self.config.question_template.format(text=text))

    # ================================================================== engine thread
    def _loop(self) -> None:
        ahead = self.prepare_ahead
        try:
            while not self._stop.is_set():
                # Running requests: the next cycle at once (with or without a frame); else wait for work.
                if not self.scheduler.running:
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
            self.conversation.release_held()

    def run_cycle(self, obs=None, noise: np.ndarray | None = None, robot: str = "") -> CycleReport:
        """One cycle for one robot's observation (decode-only when obs is None and nothing is pending)."""
        if obs is None:
            return self.run_frames()
        return self.run_frames({robot: obs}, None if noise is None else {robot: noise})

    def run_frames(self, observations: Mapping[str, object] | None = None,
                   noise: Mapping[str, np.ndarray] | None = None) -> CycleReport:
        """One cycle, synchronously (benchmark, tests; prepared inline), over {robot: obs} (and {robot: noise})
        and what is pending: at most max_robots_per_cycle frames, earliest deadline first; others deferred."""
        observations, noise = dict(observations or {}), dict(noise or {})
        unknown = [r for r in list(observations) + list(noise) if r not in self._robots.infos]
        if unknown:
            raise ValueError(f"unknown robots {unknown}: this engine serves {list(self.robots)}")
        return self._cycle(observations, noise, prepared_only=False)

    def _cycle(self, observations: dict, noise: dict, prepared_only: bool) -> CycleReport:
        start = self.clock()
        for robot, obs in observations.items():
            self._intake.put(robot, Pending(obs, noise.get(robot), start + self._robots.infos[robot].chunk_period_s))
        report = CycleReport(None, start)
        self.scheduler.expire(start)
        due, report.deferred = self._intake.take_due(len(self.robots) if self.faulted
                                                     else self.config.max_robots_per_cycle, prepared_only)
        if due:
            self._preparer_thread.cycle_started(start)
        for robot in report.deferred:
            self.stats.count_robot(robot, "deferred")
        with contextlib.ExitStack() as cycle:       # the cycle's frame references, released on every path
            frames = self._frames(due, report, cycle) if due and not self.faulted else []
            if self.scheduler.waiting and not self.faulted:
                frames += self.conversation.reuse({f.robot for f in frames}, self._intake, self._robots.chunk_periods(),
                                                  self._robots.prefix_blocks, lambda fs, bad: self._prefill(fs, bad, cycle))
            if frames or self.scheduler.has_work or self.conversation.held:
                # Language ends by the chunk deadline and by the next camera frame expected (actions first).
                deadline = min(start + self.frame_period, self._intake.next_arrival(self.clock()) or float("inf"))
                self.conversation.run({f.robot: f for f in frames}, report, deadline)
        report.duration_s = self.clock() - start
        report.deadline_missed = bool(due) and report.duration_s > self.frame_period
        self._preparer_thread.cycle_ended(report.duration_s, bool(due))
        self.stats.record(report, self._intake.dropped_counts(), self.active_requests, self.queued_requests)
        return report

    def _frames(self, due: dict[str, Pending], report: CycleReport, cycle: contextlib.ExitStack) -> list[Frame]:
        """Each robot's observation through the tasks before language (prompt, prefill, actions, captions, subtask
        requests). Returns the frames whose chunks were delivered (the cycle holds their KV)."""
        work = [f for f in (self._prepare(robot, pending, report) for robot, pending in due.items()) if f]
        if not work:
            return []
        report.frame_index, report.robots = work[0].index, [f.robot for f in work]
        faults: list[tuple[Frame, str]] = []      # frames discarded, and why
        try:
            work = self.hierarchy.prompt(work, faults)
            t = self.clock()
            work = self._prefill(work, faults, cycle)
            self.hierarchy.spans(work, cycle)
            report.prefill_s = self.clock() - t
            t = self.clock()
            chunks = self.actions.chunks(work, report.start, faults) if work else []
            report.action_s = self.clock() - t
        except Exception as e:  # noqa: BLE001 - any failure of the frames' computation is a fault
            # NaN/inf, PoolExhausted, device errors: the chunks are discarded, the publishers stay safe.
            for f in work:
                self._fault(f.robot, f.index, f"{type(e).__name__}: {e}", report)
            return []
        for f, message in faults:
            self._fault(f.robot, f.index, message, report)
        if not chunks or self.faulted:
            return []
        self._consecutive_faults = 0       # a cycle that delivers a chunk ends a run of faults
        for f, chunk in chunks:
            self.actions.deliver(f, chunk)
            self._intake.keep(f, report.start)
            self.captions_task.after_chunk(f, self.clock())
            self.hierarchy.after_chunk(f)
        report.chunks = len(chunks)
        return [f for f, _ in chunks]

    def _prefill(self, frames: list[Frame], faults: list, cycle: contextlib.ExitStack) -> list[Frame]:
        """The frames' prefixes in ONE forward: each good frame gets its `cache` (held by the cycle)."""
        caches = self.runner.prefill([f.prepared.row for f in frames], [f.index for f in frames],
                                     [f.prepared.stamp for f in frames]) if frames else []
        good = []
        for f, cache in zip(frames, caches):
            if isinstance(cache, EngineFault):
                faults.append((f, str(cache)))
            else:
                f.cache = cycle.enter_context(cache)
                good.append(f)
        return good

    def _prepare(self, robot: str, pending: Pending, report: CycleReport) -> Frame | None:
        """A robot's observation -> model inputs (made ahead by the preparer thread, else here), or None (a
        bad observation, counted; or its robot was removed meanwhile)."""
        if (preparer := self.preparers.get(robot)) is None:
            return None
        index, self._frame_index = self._frame_index, self._frame_index + 1
        try:
            frame = pending.frame(robot, index, preparer, self.frame_noise, self.clock, report, self._prepare_listeners)
        except InputError as e:
            self.stats.robot_error(robot, "bad_observations", f"observation rejected{_of(robot)}: {e}")
            log.warning("frame %d%s: observation rejected: %s", index, _of(robot), e)
            self._discard_listeners(robot, f"observation rejected: {e}")
            return None
        except Exception as e:  # noqa: BLE001 - e.g. frame_noise refusing the seed: the frame's fault, not the loop's
            self._fault(robot, index, f"preparing the frame failed: {type(e).__name__}: {e}", report)
            return None
        self._frame_listeners(index, pending.obs)
        return frame

    def _fault(self, robot: str, index: int, message: str, report: CycleReport) -> None:
        self._consecutive_faults += 1
        report.fault = f"{report.fault}; {message}" if report.fault else message
        self.stats.robot_error(robot, "faults", f"frame {index}{_of(robot)}: {message}")
        log.error("frame %d%s discarded: %s", index, _of(robot), message)
        self._discard_listeners(robot, f"the engine discarded this frame: {message}")
        if self._consecutive_faults >= self.config.max_consecutive_faults and not self.faulted:
            self.faulted = f"{self._consecutive_faults} consecutive faulty frames, last: {message}"
            log.error("engine safe stop: %s", self.faulted)
            self.actions.forget()
            self.scheduler.fail_all(f"engine stopped after repeated faults: {message}")
            self.conversation.release_held()


def _of(robot: str) -> str:      # " of robot 'name'" in messages, nothing for the single robot ""
    return f" of robot {robot!r}" if robot else ""

