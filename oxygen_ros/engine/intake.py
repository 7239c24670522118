"""Observations on their way into a frame cycle: one slot pair per robot, and the preparer thread.

Per robot, `Intake` holds the newest raw observation (what `submit_observation` hands over) and the newest
prepared one (model inputs made by the preparer thread). A newer item replaces an unconsumed older one of
the same robot and is counted as dropped, but keeps the older one's deadline (the robot has been waiting
since then); robots never displace each other. A cycle takes per robot its
prepared item if there is one (a raw one that arrived since stays for the next cycle), else its raw item
(prepared inline, on the engine thread: `run_cycle`/`run_frames` driven synchronously always do that),
for at most `limit` robots, earliest deadline first.

The preparer thread (issue #12) runs the robots' policy input transform (rotation, resize_with_pad of
full-resolution images: 20 ms for 1080p, 177 ms for 4K at one thread) beside the engine thread, so that
the conversion no longer delays the chunk. Its cost is bounded by the engine's frame rate, not the camera
rate: it converts a robot's newest raw observation only once per frame cycle (or when its previous
prepared one was consumed), and no earlier than `not_before`, which the engine sets at each frame cycle's
start to the predicted end of that cycle minus the predicted conversion time: the frame a cycle takes is
then as fresh as the conversion allows, not a cycle old. Between cycles (`not_before` = now) it converts
at once.

Every conversion, on either thread, used or not (a newer observation may replace it before a cycle takes
it), accepted or refused, reports what it cost its robot (`on_prepared(robot, seconds)`, wall time on the
converting thread): a server charges it to the client that sent the observation (serve/clients.py).

Per robot, it also keeps the newest frame whose chunk was delivered (its prepared inputs, small; `keep`): a
question asked after a robot's last frame (a paused camera, or a client that waits for its reply before it
sends its next observation) is answered about that frame when no newer one comes (`reusable`).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from oxygen_ros.robot.errors import InputError

from .cycle import Frame
from .frames import FramePreparer, PreparedFrame

log = logging.getLogger("oxygen_ros.engine")

LATE_FRACTION = 0.25      # of a camera's interval: how late its next frame may be and still be expected now
FIRST_FRAME_WAIT_S = 2.0  # how long a question may wait for a robot that never sent a usable frame: longer
                          # than any first frame's way in (a 4K conversion: 0.2 s; a robot deferred a few cycles)


@dataclass(frozen=True)
class Pending:
    """An observation waiting for a cycle: its robot's frame is due by `deadline` (engine clock)."""

    obs: object
    noise: np.ndarray | None
    deadline: float
    prepared: PreparedFrame | None = None       # made by the preparer thread (None: prepare inline)
    error: InputError | None = None             # the preparer thread rejected it (counted by the cycle)
    prepare_s: float = 0.0                      # what the preparation cost (either thread)

    def frame(self, robot: str, index: int, preparer: FramePreparer, frame_noise: Callable[[int], torch.Tensor],
              clock: Callable[[], float], report, on_prepared: Callable[[str, float], None]) -> Frame:
        """Its robot's frame of a cycle: the inputs made ahead (counted in the cycle's `report`), else made
        here (timed into it, and reported to `on_prepared` even when refused); its noise, else the frame's own.
        Raises InputError for a bad observation."""
        if self.error is not None:
            raise self.error
        if self.prepared is not None:
            prepared = self.prepared
            report.prepared_ahead += 1
        else:
            t, start = clock(), time.perf_counter()
            try:
                prepared = preparer.prepare(self.obs)
            finally:
                on_prepared(robot, time.perf_counter() - start)
            report.prepare_s += clock() - t
        noise = frame_noise(index) if self.noise is None else \
            torch.as_tensor(np.asarray(self.noise), dtype=torch.float32)
        return Frame(robot, index, preparer, prepared, noise, self.deadline, self.obs.prompt)


class Intake:
    def __init__(self, robots: tuple[str, ...]):
        self.cv = threading.Condition()
        self.robots = robots
        self.raw: dict[str, Pending | None] = dict.fromkeys(robots)
        self.ready: dict[str, Pending | None] = dict.fromkeys(robots)
        self.dropped: dict[str, int] = dict.fromkeys(robots, 0)
        self._arrivals: dict[str, tuple[float, float | None]] = {}   # robot -> (last arrival, mean interval)
        self._kept: dict[str, tuple[Frame, float]] = {}    # robot -> (its newest delivered frame, when used)

    def add_robot(self, robot: str) -> None:
        with self.cv:
            self.robots = self.robots + (robot,)
            self.raw[robot] = self.ready[robot] = None
            self.dropped[robot] = 0

    def remove_robot(self, robot: str) -> None:
        """Forget a robot and whatever it had pending (a preparation in flight for it is discarded)."""
        with self.cv:
            self.robots = tuple(r for r in self.robots if r != robot)
            for slots in (self.raw, self.ready, self.dropped, self._arrivals, self._kept):
                slots.pop(robot, None)

    def put(self, robot: str, item: Pending, arrived: float | None = None) -> None:
        """`arrived`: the engine-clock time a live observation arrived (its camera's rhythm is learnt from
        these: `next_arrival`); None for observations handed to a synchronous cycle."""
        with self.cv:
            self._replace(self.raw, robot, item)
            if arrived is not None:
                last, interval = self._arrivals.get(robot, (None, None))
                if last is not None and arrived > last:
                    gap = arrived - last
                    interval = gap if interval is None else interval + 0.3 * (gap - interval)
                self._arrivals[robot] = (arrived, interval)

    def next_arrival(self, now: float) -> float | None:
        """When the next live observation of any robot is expected (engine clock), from each robot's last
        arrival and its camera's mean interval; None when no robot has a rhythm. A frame late by up to
        LATE_FRACTION of its interval (a camera's jitter) is expected now; one later than that is not
        expected at all: its camera paused, or its client waits for a reply before it sends the next frame
        (an openpi client that asked a question). Expecting it "now" for longer would cut every cycle's
        language to its minimum while the client waits for exactly that language. A frame that does come
        later still ends the language work at the next step boundary (the engine checks for one)."""
        with self.cv:
            expected = [last + interval for last, interval in self._arrivals.values()
                        if interval is not None and now <= last + (1 + LATE_FRACTION) * interval]
        return max(now, min(expected)) if expected else None

    def keep(self, frame: Frame, used: float) -> None:
        """A frame whose chunk was delivered (engine clock `used`): its inputs, without its KV, for `reusable`."""
        with self.cv:
            if frame.robot in self.raw:             # else the robot was removed meanwhile
                self._kept[frame.robot] = (replace(frame, cache=None), used)

    def reusable(self, robot: str, now: float, period: float) -> Frame | None:
        """The robot's newest delivered frame (without KV), when no newer one is on its way: none pending
        and none arrived or used for LATE_FRACTION past one camera interval (`period`, the robot's chunk
        period, while its camera has no rhythm). None otherwise, or when it never had one."""
        with self.cv:
            if robot not in self._kept or self.raw.get(robot) is not None or self.ready.get(robot) is not None:
                return None
            frame, used = self._kept[robot]
            last, interval = self._arrivals.get(robot, (None, None))
            latest = used if last is None else max(used, last)
            due = now >= latest + (1 + LATE_FRACTION) * (interval or period)
            return replace(frame) if due else None         # a copy: the cycle gives it its own KV

    def never_framed(self, robot: str) -> bool:
        """No frame of this robot was ever delivered, and none is waiting for a cycle."""
        with self.cv:
            return robot not in self._kept and self.raw.get(robot) is None and self.ready.get(robot) is None

    def put_ready(self, robot: str, item: Pending) -> None:
        with self.cv:
            if robot in self.ready:                 # else the robot was removed while it was prepared
                self._replace(self.ready, robot, item)

    def _replace(self, slots: dict, robot: str, item: Pending) -> None:
        old = slots[robot]
        if old is not None:
            self.dropped[robot] += 1
        if old is not None and old.deadline < item.deadline:
            # The robot has waited since its older observation: a newer one replaces its data, not its
            # place in the earliest-deadline-first order (else a robot whose camera is faster than the cycle
            # would push its own deadline back for ever and lose every tie to the others).
            item = replace(item, deadline=old.deadline)
        slots[robot] = item
        self.cv.notify_all()

    def dropped_counts(self) -> dict[str, int]:
        with self.cv:
            return dict(self.dropped)

    def take_due(self, limit: int, prepared_only: bool = False) -> tuple[dict[str, Pending], list[str]]:
        """Per robot its prepared item, else (unless `prepared_only`) its raw one, for at most `limit`
        robots, earliest deadline first (ties: robot order), returned in robot order; and the robots left
        waiting (deferred)."""
        with self.cv:
            candidates = {r: self.ready[r] or (None if prepared_only else self.raw[r]) for r in self.robots}
            ready = sorted((item.deadline, i, r) for i, (r, item) in enumerate(candidates.items()) if item is not None)
            chosen = sorted(ready[:limit], key=lambda x: x[1])
            taken = {}
            for _, _, r in chosen:
                slots = self.ready if self.ready[r] is not None else self.raw
                taken[r], slots[r] = slots[r], None
            self.cv.notify_all()                 # a consumed prepared slot lets the preparer convert again
            return taken, [r for _, _, r in ready[limit:]]

    def pending(self, prepared_only: bool = False) -> bool:
        with self.cv:
            return any(self.ready.values()) or (not prepared_only and any(self.raw.values()))

    def wait(self, timeout: float, prepared_only: bool) -> None:
        with self.cv:
            if not self.pending(prepared_only):
                self.cv.wait(timeout)

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()


class PreparerThread:
    """Converts each robot's newest raw observation into model inputs ahead of the cycle (see above)."""

    def __init__(self, intake: Intake, preparer_of: Callable[[str], FramePreparer | None], clock: Callable[[], float],
                 on_prepared: Callable[[str, float], None] = lambda robot, seconds: None, smoothing: float = 0.3):
        self.intake, self.preparer_of, self.clock, self.smoothing = intake, preparer_of, clock, smoothing
        self.on_prepared = on_prepared
        self.not_before = float("-inf")             # engine clock; set by the engine (see the module docstring)
        self._cycle = 0                              # frame cycles started so far
        self._converted: dict[str, int] = {}         # the cycle in which each robot was last converted
        self._prepare_s: dict[str, float] = {}       # moving average of each robot's conversion
        self._cycle_s = 0.0                          # moving average of a frame cycle
        self.conversions = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ engine thread
    def cycle_started(self, start: float) -> None:
        """A frame cycle began: the next conversions are due shortly before its predicted end."""
        with self.intake.cv:
            self._cycle += 1
            lead = sum(self._prepare_s.values())        # ends as the cycle is predicted to end
            self.not_before = start + max(0.0, self._cycle_s - lead)
            self.intake.cv.notify_all()

    def cycle_ended(self, duration_s: float, frame: bool) -> None:
        with self.intake.cv:
            if frame:
                self._cycle_s = _ema(self._cycle_s, duration_s, self.smoothing)
            self.not_before = float("-inf")         # between cycles: convert at once
            self.intake.cv.notify_all()

    # ------------------------------------------------------------------ preparer thread
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="oxygen-preparer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self.intake.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _next(self) -> tuple[str, Pending] | None:
        """Under the lock: a robot whose raw observation may be converted now, or None (and how long to wait)."""
        if self.clock() < self.not_before:
            return None
        for r in self.intake.robots:
            raw = self.intake.raw[r]
            if raw is not None and (self.intake.ready[r] is None or self._converted.get(r, -1) < self._cycle):
                self.intake.raw[r] = None
                self._converted[r] = self._cycle
                return r, raw
        return None

    def _loop(self) -> None:
        cv = self.intake.cv
        while not self._stop.is_set():
            with cv:
                job = self._next()
                if job is None:
                    wait = self.not_before - self.clock()
                    cv.wait(min(wait, 0.1) if wait > 0 else 0.1)
                    continue
            robot, raw = job
            preparer = self.preparer_of(robot)
            if preparer is None:                   # the robot was removed meanwhile
                continue
            t = time.perf_counter()
            try:
                item = replace(raw, prepared=preparer.prepare(raw.obs))
            except InputError as e:
                item = replace(raw, error=e)
            except Exception as e:  # noqa: BLE001 - a preparation bug must not kill the thread: the cycle reports it
                log.exception("frame preparation failed")
                item = replace(raw, error=InputError(f"preparation failed: {type(e).__name__}: {e}"))
            spent = time.perf_counter() - t
            self.on_prepared(robot, spent)
            with cv:
                self._prepare_s[robot] = _ema(self._prepare_s.get(robot, 0.0), spent, self.smoothing)
            self.conversions += 1
            self.intake.put_ready(robot, replace(item, prepare_s=spent))

    def forget(self, robot: str) -> None:
        with self.intake.cv:
            self._converted.pop(robot, None)
            self._prepare_s.pop(robot, None)


def _ema(old: float, new: float, smoothing: float) -> float:
    return new if old == 0.0 else old + smoothing * (new - old)
