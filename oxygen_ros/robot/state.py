"""Robot state messages -> the float64 state vector the model expects, in the model's joint order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import ConfigError, StateError

_SHOWN_NAMES = 12  # enough to spot a naming mismatch without flooding the log
# Entries a message may carry at all (a JointState may list joints the model does not use): checked
# before any conversion, so a huge message costs the input thread nothing.
MAX_MESSAGE_ENTRIES = 4096
MAX_STATE_DIM = 1024  # the state the model gets, when the caller does not give the model's own size


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN_NAMES])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _SHOWN_NAMES else "")


def _as_vector(data: Any, what: str) -> np.ndarray:
    if hasattr(data, "__len__") and len(data) > MAX_MESSAGE_ENTRIES:
        raise StateError(f"{what}: {len(data)} values, more than the limit of {MAX_MESSAGE_ENTRIES}")
    try:
        # A copy: rclpy hands out array.array buffers the caller may reuse.
        values = np.array(data, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise StateError(f"{what} are not numbers ({e})") from e
    if values.ndim != 1:
        raise StateError(f"{what} must be a flat sequence of numbers, got shape {values.shape}")
    return values


class StateReader:
    """Reads sensor_msgs/JointState (by joint name) or std_msgs/Float64MultiArray (as given).

    joint_order: the model's joints, in the model's order; JointState messages may list them in any
    order and add other joints, which are ignored. None: positions are used in the order they come.
    expected_dim: the state size the model wants (checked on every message); defaults to
    len(joint_order).
    max_dim: the longest state the model takes (π0.5 pads its state to action_dim); always checked, so
    a state of unknown size is still bounded.
    """

    def __init__(self, joint_order: Sequence[str] | None = None, expected_dim: int | None = None,
                 max_dim: int = MAX_STATE_DIM):
        if max_dim <= 0:
            raise ConfigError(f"max_dim {max_dim} must be positive")
        if expected_dim is not None and expected_dim <= 0:
            raise ConfigError(f"expected state dim {expected_dim} must be positive")
        if expected_dim is not None and expected_dim > max_dim:
            raise ConfigError(f"expected state dim {expected_dim} exceeds the model's {max_dim}")
        if joint_order is not None:
            joint_order = list(joint_order)
            if not joint_order:
                raise ConfigError("joint_order is empty; pass None to take positions as they come")
            repeated = sorted({n for n in joint_order if joint_order.count(n) > 1})
            if repeated:
                raise ConfigError(f"joint_order lists {_names(repeated)} more than once")
            if expected_dim is not None and expected_dim != len(joint_order):
                raise ConfigError(
                    f"joint_order has {len(joint_order)} joints but the expected state dim is {expected_dim}"
                )
            expected_dim = len(joint_order)
        self.joint_order = joint_order
        self.expected_dim = expected_dim
        self.max_dim = max_dim

    def from_joint_state(self, names: Sequence[str], positions: Sequence[float]) -> np.ndarray:
        values = _as_vector(positions, "joint state positions")
        if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
            raise StateError(f"joint state names must be a list of strings, got {type(names).__name__}")
        if hasattr(names, "__len__") and len(names) > MAX_MESSAGE_ENTRIES:
            raise StateError(f"joint state names: {len(names)} values, more than the limit of {MAX_MESSAGE_ENTRIES}")
        names = list(names)
        if names and len(names) != len(values):
            raise StateError(f"joint state has {len(names)} names but {len(values)} positions")
        if self.joint_order is None:
            return self._checked(values, labels=names or None)
        index: dict[str, int] = {}
        for i, name in enumerate(names):
            if name in index:
                raise StateError(f"joint state lists joint {name!r} twice")
            index[name] = i
        missing = [n for n in self.joint_order if n not in index]
        if missing:
            raise StateError(
                f"joint state is missing joint(s) {_names(missing)} (it has: {_names(names) or 'none'})"
            )
        picked = values[[index[n] for n in self.joint_order]]
        return self._checked(picked, labels=self.joint_order)

    def from_array(self, data: Sequence[float]) -> np.ndarray:
        return self._checked(_as_vector(data, "state array values"), labels=None)

    def _checked(self, values: np.ndarray, labels: list[str] | None) -> np.ndarray:
        if values.size > self.max_dim:
            raise StateError(f"state has {values.size} values, more than the model's {self.max_dim}")
        if self.expected_dim is not None and values.size != self.expected_dim:
            raise StateError(f"state has {values.size} values, expected {self.expected_dim}")
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            if labels:
                where = ", ".join(f"{labels[i]!r} ({values[i]})" for i in bad)
                raise StateError(f"state has non-finite values for joint(s) {where}")
            shown = ", ".join(str(values[i]) for i in bad)
            raise StateError(f"state has non-finite values at indices {bad.tolist()} ({shown})")
        return values
