"""Measured rate and jitter of a periodic event (the action publisher's ticks)."""
from __future__ import annotations

import collections

import numpy as np


class RateMeter:
    def __init__(self, window: int = 700):
        self._times: collections.deque[float] = collections.deque(maxlen=window)

    def tick(self, now_s: float) -> None:
        self._times.append(now_s)

    def summary(self) -> dict:
        """rate_hz over the window, period mean/std/max (ms); zeros until two ticks were seen."""
        t = np.asarray(self._times)
        if len(t) < 2:
            return {"rate_hz": 0.0, "period_ms_mean": 0.0, "period_ms_std": 0.0, "period_ms_max": 0.0, "ticks": len(t)}
        periods = np.diff(t) * 1e3
        return {"rate_hz": float((len(t) - 1) / (t[-1] - t[0])), "period_ms_mean": float(periods.mean()),
                "period_ms_std": float(periods.std()), "period_ms_max": float(periods.max()), "ticks": len(t)}
