"""Staleness of an input stream: how long since it was last seen, and whether that is too long."""
from __future__ import annotations

import math


class StaleWatch:
    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"stale timeout must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.last_s: float | None = None
        self.transitions = 0          # fresh -> stale changes, for diagnostics
        self._was_stale = True

    def seen(self, now_s: float) -> None:
        self.last_s = now_s
        self._was_stale = False

    def age(self, now_s: float) -> float:
        return math.inf if self.last_s is None else now_s - self.last_s

    def stale(self, now_s: float) -> bool:
        """True when never seen or older than the timeout. Counts each fresh -> stale transition."""
        is_stale = self.age(now_s) > self.timeout_s
        if is_stale and not self._was_stale:
            self.transitions += 1
        self._was_stale = is_stale
        return is_stale
