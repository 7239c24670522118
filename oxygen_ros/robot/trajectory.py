"""Action chunks -> trajectory_msgs/JointTrajectory points, and exact ROS time conversions."""

from __future__ import annotations

import math
import operator
from fractions import Fraction
from typing import Any

import numpy as np

from .errors import ActionError, TimeError

NS_PER_S = 1_000_000_000
_INT32 = (-(2**31), 2**31 - 1)  # builtin_interfaces sec is int32


def chunk_to_trajectory_points(
    actions: Any, step_period_s: float, start_index: int, first_offset_s: float = 0.0
) -> list[tuple[list[float], float]]:
    """Rows start_index.. of a chunk as (positions, time_from_start_s) with the header stamped now.

    Row start_index + j is due at first_offset_s + j * step_period_s. To keep the chunk's own timing
    exactly, pass start_index = plan.row_at(now) + 1 (the first row still ahead) and
    first_offset_s = plan.time_of_row(start_index) - now; with the default offset 0, start_index is
    the row due now.
    """
    try:
        rows = np.asarray(actions, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ActionError(f"trajectory: actions are not numbers ({e})") from e
    if rows.ndim != 2 or 0 in rows.shape:
        raise ActionError(f"trajectory: actions must be a non-empty [H, D] array, got {rows.shape}")
    if not 0 <= start_index < rows.shape[0]:
        last = rows.shape[0] - 1
        raise ActionError(f"trajectory: start_index {start_index} is outside the chunk's rows 0..{last}")
    if not (math.isfinite(step_period_s) and step_period_s > 0):
        raise ActionError(f"trajectory: step_period_s {step_period_s} must be positive")
    if not (math.isfinite(first_offset_s) and first_offset_s >= 0):
        raise ActionError(f"trajectory: first_offset_s {first_offset_s} must be >= 0")
    rows = rows[start_index:]
    bad = np.flatnonzero(~np.isfinite(rows).all(axis=1))
    if bad.size:
        raise ActionError(f"trajectory: non-finite actions in rows {(bad + start_index).tolist()}")
    return [(row.tolist(), first_offset_s + j * step_period_s) for j, row in enumerate(rows)]


def seconds_to_duration(seconds: float) -> tuple[int, int]:
    """(sec, nanosec) with 0 <= nanosec < 1e9, as builtin_interfaces Duration/Time want them.

    Rounded to the nearest nanosecond from the float's exact value; negative values keep nanosec
    positive: -1.5 s -> (-2, 500000000).
    """
    try:
        value = seconds if isinstance(seconds, int) else float(seconds)
    except (TypeError, ValueError) as e:
        raise TimeError(f"duration {seconds!r} is not a number") from e
    if not math.isfinite(value):
        raise TimeError(f"duration {value} s is not finite")
    sec, nanosec = divmod(round(Fraction(value) * NS_PER_S), NS_PER_S)
    if not _INT32[0] <= sec <= _INT32[1]:
        raise TimeError(f"duration {value} s does not fit a ROS time (int32 seconds)")
    return sec, nanosec


def stamp_to_seconds(sec: int, nanosec: int) -> float:
    """A ROS stamp (or duration) -> seconds, the float nearest to the exact value."""
    try:
        total_ns = operator.index(sec) * NS_PER_S + operator.index(nanosec)
    except TypeError as e:
        raise TimeError(f"stamp ({sec!r}, {nanosec!r}) must be integers") from e
    return total_ns / NS_PER_S  # int / int is correctly rounded in Python
