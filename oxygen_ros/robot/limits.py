"""Last line before the actuators: position bounds, a per-tick step (velocity) limit, and no NaN."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ActionError, ConfigError

_SHOWN = 4  # offending entries listed in a message


def _vector(values: Any, name: str, dim: int | None) -> np.ndarray:
    try:
        vec = np.array(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name} is not a list of numbers ({e})") from e
    if vec.ndim != 1:
        raise ConfigError(f"{name} must be a flat list, got shape {vec.shape}")
    if dim is not None and vec.size != dim:
        raise ConfigError(f"{name} has {vec.size} values, expected {dim} (the action dim)")
    nan = np.flatnonzero(np.isnan(vec))
    if nan.size:
        raise ConfigError(f"{name} has NaN at indices {nan.tolist()}")
    return vec


def _require_positive(vec: np.ndarray, name: str) -> None:
    bad = np.flatnonzero(~(vec > 0))
    if bad.size:
        listed = ", ".join(f"{name}[{i}]={vec[i]}" for i in bad[:_SHOWN])
        raise ConfigError(f"{listed}: must be positive")


@dataclass
class ActionLimits:
    """Clamps actions; a None field means no limit of that kind. Infinite bounds are allowed."""

    lower: np.ndarray | None = None
    upper: np.ndarray | None = None
    max_step: np.ndarray | None = None  # max |change| per tick: max velocity x tick period
    dim: int | None = field(init=False, default=None)  # from the arrays; None without any limit

    def __post_init__(self) -> None:
        for name in ("lower", "upper", "max_step"):
            if getattr(self, name) is not None:
                vec = _vector(getattr(self, name), name, self.dim)
                setattr(self, name, vec)
                self.dim = vec.size
        if self.lower is not None and self.upper is not None:
            crossed = np.flatnonzero(self.lower > self.upper)
            if crossed.size:
                listed = ", ".join(
                    f"lower[{i}]={self.lower[i]} is above upper[{i}]={self.upper[i]}"
                    for i in crossed[:_SHOWN]
                )
                raise ConfigError(f"action limits: {listed}")
        if self.max_step is not None:
            _require_positive(self.max_step, "max_step")

    @classmethod
    def from_config(
        cls,
        dim: int,
        lower: Sequence[float] | None = None,
        upper: Sequence[float] | None = None,
        max_velocity: Sequence[float] | None = None,
        tick_period_s: float | None = None,
    ) -> ActionLimits:
        """Limits from robot config: bounds in action units, max_velocity in action units per second."""
        if dim <= 0:
            raise ConfigError(f"action dim {dim} must be positive")
        max_step = None
        if max_velocity is not None:
            velocity = _vector(max_velocity, "max_velocity", dim)
            _require_positive(velocity, "max_velocity")
            if tick_period_s is None or not (np.isfinite(tick_period_s) and tick_period_s > 0):
                raise ConfigError(
                    f"tick_period_s {tick_period_s} must be positive to apply max_velocity"
                )
            max_step = velocity * tick_period_s
        return cls(
            lower=None if lower is None else _vector(lower, "lower", dim),
            upper=None if upper is None else _vector(upper, "upper", dim),
            max_step=max_step,
        )

    def apply(self, action: Any, previous: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """(clamped action, bool mask of the entries changed).

        `previous` is the action last sent (None on the first tick: no step limit). The step limit is
        applied first and the bounds last, so the result is always inside the bounds even when the
        previous action was not.
        """
        action = self._checked(action, "action")
        clamped = action.copy()
        if previous is not None and self.max_step is not None:
            previous = self._checked(previous, "previous action")
            clamped = np.clip(clamped, previous - self.max_step, previous + self.max_step)
        if self.lower is not None:
            clamped = np.maximum(clamped, self.lower)
        if self.upper is not None:
            clamped = np.minimum(clamped, self.upper)
        return clamped, clamped != action

    def _checked(self, values: Any, what: str) -> np.ndarray:
        try:
            vec = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ActionError(f"{what} is not numbers ({e})") from e
        if vec.ndim != 1 or (self.dim is not None and vec.size != self.dim):
            raise ActionError(f"{what} has shape {vec.shape}, expected ({self.dim or 'D'},)")
        bad = np.flatnonzero(~np.isfinite(vec))
        if bad.size:
            shown = ", ".join(str(vec[i]) for i in bad[:_SHOWN])
            raise ActionError(
                f"{what} has non-finite values at indices {bad.tolist()} ({shown}); not sending it"
            )
        return vec
