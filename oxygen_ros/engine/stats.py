"""Engine statistics for diagnostics and the benchmark: counters plus a window of recent cycles, and per
robot (issue #17) its frames, chunks, deadline misses, chunk latency, dropped and deferred observations.
The flat keys are the totals over every robot."""
from __future__ import annotations

import collections
import threading
import time

import numpy as np

from . import requests


class EngineStats:
    RATE_WINDOW_S = 10.0       # achieved chunk rate per robot: chunks delivered in the last this many seconds

    def __init__(self, horizon: int, frame_period: float, blocks, robots: tuple[str, ...] = ("",), window: int = 200,
                 clock=time.monotonic):
        self.horizon, self.frame_period, self.blocks = horizon, frame_period, blocks
        self._cycles = collections.deque(maxlen=window)
        self._counters: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self.last_error = ""
        self.dropped_frames = 0
        self.active = 0
        self.queued = 0
        self.graphs = None          # the runner's StepGraphs, when fixed-shape steps are on (its counters)
        self._robots = {r: collections.Counter() for r in robots}
        self._chunk_s = {r: collections.deque(maxlen=window) for r in robots}
        self._delivered = {r: collections.deque() for r in robots}     # delivery times in the rate window
        self.clock = clock
        self._first_delivery: float | None = None
        self._dropped = dict.fromkeys(robots, 0)
        self._dropped_by_removed = 0

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def add_robot(self, robot: str) -> None:
        with self._lock:
            self._robots[robot] = collections.Counter()
            self._chunk_s[robot] = collections.deque(maxlen=self._cycles.maxlen)
            self._delivered[robot] = collections.deque()
            self._dropped[robot] = 0

    def remove_robot(self, robot: str) -> None:
        with self._lock:
            self._dropped_by_removed += self._dropped.pop(robot, 0)    # the total keeps what it counted
            self._robots.pop(robot, None)
            self._chunk_s.pop(robot, None)
            self._delivered.pop(robot, None)

    def count_robot(self, robot: str, name: str, n: int = 1) -> None:
        with self._lock:
            if robot in self._robots:            # else removed while its frame was in a cycle
                self._robots[robot][name] += n

    def record_chunk(self, robot: str, latency_s: float, missed: bool) -> None:
        """A chunk delivered to `robot`, `latency_s` after its cycle started; `missed`: after its deadline."""
        with self._lock:
            counter = self._robots.get(robot)
            if counter is None:
                return
            counter["chunks"] += 1
            counter["deadline_misses"] += int(missed)
            self._chunk_s[robot].append(latency_s)
            now = self.clock()
            self._delivered[robot].append(now)
            if self._first_delivery is None:
                self._first_delivery = now

    def note_error(self, message: str) -> None:
        self.last_error = message

    def robot_error(self, robot: str, name: str, message: str) -> None:
        """A robot's frame lost (`name`: bad_observations, faults): counted in all and for the robot, and noted."""
        self.count(name)
        self.count_robot(robot, name)
        self.note_error(message)

    def record(self, report, dropped: dict[str, int], active: int, queued: int) -> None:
        """A finished cycle; `dropped`: observations each robot's mailbox replaced so far."""
        with self._lock:
            self._cycles.append(report)
            for robot in report.robots:
                if robot in self._robots:
                    self._robots[robot]["frames"] += 1
            self._counters["frames"] += report.chunks
            if report.prepared_ahead:
                self._counters["frames_prepared_ahead"] += report.prepared_ahead
            self._dropped.update((r, n) for r, n in dropped.items() if r in self._dropped)
            dropped_frames = sum(self._dropped.values()) + self._dropped_by_removed
            self._counters["cycles"] += 1
            self._counters["tokens"] += report.tokens
            self._counters["deadline_misses"] += int(report.deadline_missed)
            self.dropped_frames, self.active, self.queued = dropped_frames, active, queued

    def _rate(self, times: collections.deque, now: float) -> float:
        """Chunks per second over the last RATE_WINDOW_S (or since the first chunk, if more recent)."""
        while times and times[0] < now - self.RATE_WINDOW_S:
            times.popleft()
        span = min(self.RATE_WINDOW_S, now - self._first_delivery) if self._first_delivery is not None else 0.0
        return len(times) / span if span > 0 else 0.0

    def counter(self, name: str) -> int:
        with self._lock:
            return self._counters[name]

    def snapshot(self) -> dict:
        """Plain numbers over the recent window (frames = cycles that computed an action chunk)."""
        with self._lock:
            cycles = list(self._cycles)
            counters = dict(self._counters)
            robots = {r: dict(c) for r, c in self._robots.items()}
            now = self.clock()
            rates = {r: self._rate(times, now) for r, times in self._delivered.items()}
            chunk_s = {r: np.array(d) for r, d in self._chunk_s.items()}
            dropped = dict(self._dropped)
        frames = [c for c in cycles if c.chunks]
        frame_s = np.array([c.duration_s for c in frames]) if frames else np.zeros(0)
        wall = sum(c.duration_s for c in cycles)
        batches = [b for c in cycles for b in c.batch_sizes]

        def ms(x, q=None):
            if not len(x):
                return 0.0
            return float(1e3 * (np.mean(x) if q is None else np.percentile(x, q)))

        mean_frame = float(frame_s.mean()) if len(frame_s) else 0.0
        return {
            "frames": counters.get("frames", 0),
            "reused_frames": counters.get("reused_frames", 0),     # prefilled again for questions, no chunk
            "frame_ms_mean": ms(frame_s), "frame_ms_p50": ms(frame_s, 50), "frame_ms_p99": ms(frame_s, 99),
            "prefill_ms_mean": ms([c.prefill_s for c in frames]),
            "action_ms_mean": ms([c.action_s for c in frames]),
            "prepare_ms_mean": ms([c.prepare_s for c in frames]),     # conversions on the engine thread
            "decode_ms_mean": ms([c.decode_s for c in cycles]),
            "action_hz": self.horizon / mean_frame if mean_frame > 0 else 0.0,
            "tokens_per_s": sum(c.tokens for c in cycles) / wall if wall > 0 else 0.0,
            "avg_batch": float(np.mean(batches)) if batches else 0.0,
            "deadline_misses": counters.get("deadline_misses", 0),
            "dropped_frames": self.dropped_frames,
            "faults": counters.get("faults", 0),
            "active_requests": self.active,
            "queued_requests": self.queued,
            "pool_blocks_used": self.blocks.num_used,
            "pool_blocks_total": self.blocks.num_blocks,
            "pool_peak_blocks": self.blocks.peak_used,
            "pool_occupancy": self.blocks.num_used / self.blocks.num_blocks,
            "counters": counters,
            "callback_errors": requests.callback_errors,
            "graph_replays": self.graphs.replays if self.graphs else 0,
            "graph_fallbacks": self.graphs.fallbacks if self.graphs else 0,
            "last_error": self.last_error,
            "robots": {r: {"frames": c.get("frames", 0), "chunks": c.get("chunks", 0),
                           "deadline_misses": c.get("deadline_misses", 0), "chunks_per_s": rates[r],
                           "chunk_ms_mean": ms(chunk_s[r]), "chunk_ms_p99": ms(chunk_s[r], 99),
                           "dropped_observations": dropped[r], "deferred": c.get("deferred", 0),
                           "bad_observations": c.get("bad_observations", 0), "faults": c.get("faults", 0),
                           "reused_frames": c.get("reused_frames", 0)}
                       for r, c in robots.items()},
        }
