"""Message stamps made by another host's clock, checked against this host's clock.

A robot's cameras and joint states are stamped by the robot's computer; the engine may run on another
machine and compares those stamps with its own clock (the observation's age, a camera gone missing, the
row of an action chunk to play now). What the package assumes: the hosts' clocks are synchronised (chrony
or PTP; chrony on a LAN keeps them within a millisecond), so `now - stamp` is the transport latency plus
a residual offset far below one control period (14 ms at 70 Hz). It does not estimate or correct offsets.

What it does when a stamp breaks that assumption, before the stamp reaches any other logic:
- more than `max_future_s` ahead of this clock: rejected (the message names the offset: the clocks are not
  synchronised, or a driver stamps with another clock, e.g. simulated time). Accepting it would make the
  observation look fresh for as long as the offset lasts and place chunk rows in the future;
- older than `max_age_s`: rejected as too old (a stamp of 0 is named: a driver that leaves header.stamp
  unset). An observation that old is not worth computing an action for; with no fresh input the stale
  watchdog stops the actions.
Within these bounds a stamp is used as is. `max_age_s = 0` turns the age check off (e.g. replaying a
recording with its original stamps against the wall clock); future stamps are always checked.

The recent ages (latency + offset) are kept for diagnostics: a minimum below 0 means the robot's clock is
ahead of the engine's.
"""
from __future__ import annotations

import math
from collections import deque

from .errors import ConfigError, SyncError

AGE_WINDOW = 200  # recent ages kept for diagnostics


class StampCheck:
    def __init__(self, max_age_s: float, max_future_s: float):
        if not (math.isfinite(max_age_s) and max_age_s >= 0):
            raise ConfigError(f"max_stamp_age_s {max_age_s} must be >= 0 (0: no age check)")
        if not (math.isfinite(max_future_s) and max_future_s >= 0):
            raise ConfigError(f"max_stamp_future_s {max_future_s} must be >= 0")
        self.max_age_s = float(max_age_s)
        self.max_future_s = float(max_future_s)
        self._ages: deque[float] = deque(maxlen=AGE_WINDOW)
        self.stats = {"stamps_future": 0, "stamps_too_old": 0}

    def check(self, what: str, stamp_s: float, now_s: float) -> float:
        """The stamp's age (now - stamp, s) if it is usable; SyncError naming the problem if not."""
        age = now_s - stamp_s
        if not math.isfinite(age):
            raise SyncError(f"{what}: stamp {stamp_s} or clock {now_s} is not finite")
        if -age > self.max_future_s:
            self.stats["stamps_future"] += 1
            raise SyncError(f"{what}: stamp is {-age:.3f} s ahead of this host's clock (at most "
                            f"{self.max_future_s} s accepted): are the robot's and the engine's clocks "
                            "synchronised (chrony/PTP), and both on the same time source (sim time)?")
        if self.max_age_s and age > self.max_age_s:
            self.stats["stamps_too_old"] += 1
            unset = " (stamp 0: the driver does not set header.stamp)" if stamp_s == 0 else ""
            raise SyncError(f"{what}: stamp is {age:.3f} s old, more than max_stamp_age_s "
                            f"{self.max_age_s}{unset}")
        self._ages.append(age)
        return age

    def age_summary(self) -> dict:
        """min / median / max of the recent accepted ages in ms (None before the first)."""
        if not self._ages:
            return {"stamp_age_ms_min": None, "stamp_age_ms_median": None, "stamp_age_ms_max": None}
        ages = sorted(self._ages)
        return {"stamp_age_ms_min": round(ages[0] * 1e3, 2), "stamp_age_ms_median": round(ages[len(ages) // 2] * 1e3, 2),
                "stamp_age_ms_max": round(ages[-1] * 1e3, 2)}
