"""Action chunks -> one command per control tick, aligned to the time each row is meant for.

A chunk computed from an observation stamped t0 arrives some inference latency later. Its row k is
meant for t0 + k*dt, so at time `now` the follower plays row floor((now - t0)/dt): the rows whose time
has already passed during inference are skipped. That is the latency compensation; the robot never
replays the start of a chunk that is already out of date.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import ActionError, ConfigError

_EPS = 1e-9  # now exactly on a row's time must select that row despite float rounding

STATUSES = ("ok", "blending", "hold", "stopped", "no_chunk")


@dataclass
class ActionChunkPlan:
    actions: np.ndarray  # [H, D]; row k is meant for stamp_s + k * step_period_s
    stamp_s: float  # t0: the stamp of the observation the chunk was computed from
    step_period_s: float  # dt between rows
    frame_index: int

    def __post_init__(self) -> None:
        label = f"action chunk of frame {self.frame_index}"
        try:
            self.actions = np.array(self.actions, dtype=np.float64)  # a copy the producer cannot change
        except (TypeError, ValueError) as e:
            raise ActionError(f"{label}: actions are not numbers ({e})") from e
        if self.actions.ndim != 2 or 0 in self.actions.shape:
            raise ActionError(
                f"{label}: actions must be a non-empty [H, D] array, got shape {self.actions.shape}"
            )
        bad_rows = np.flatnonzero(~np.isfinite(self.actions).all(axis=1))
        if bad_rows.size:
            raise ActionError(f"{label}: non-finite actions in rows {bad_rows.tolist()}")
        if not (math.isfinite(self.step_period_s) and self.step_period_s > 0):
            raise ActionError(f"{label}: step_period_s {self.step_period_s} must be positive")
        if not math.isfinite(self.stamp_s):
            raise ActionError(f"{label}: stamp_s {self.stamp_s} is not finite")

    @property
    def horizon(self) -> int:
        return self.actions.shape[0]

    def row_at(self, now_s: float) -> int:
        """The row meant for `now_s`; negative before t0, >= horizon once the chunk is used up."""
        return math.floor((now_s - self.stamp_s) / self.step_period_s + _EPS)

    def time_of_row(self, row: int) -> float:
        return self.stamp_s + row * self.step_period_s


@dataclass(frozen=True)
class TickCommand:
    action: np.ndarray | None  # None: stop (the node publishes nothing or a zero velocity)
    frame_index: int  # frame of the chunk in use; -1 without one
    index: int  # row of that chunk the action comes from; -1 when no row is used
    status: str  # one of STATUSES


class ChunkFollower:
    """Keeps the newest chunk and answers `next(now)` once per control tick.

    blend_steps: after a switch, the first blend_steps ticks output (1 - w) * old_row + w * new_row
    with w = (i + 1) / (blend_steps + 1), old_row being the replaced chunk's row for the same time,
    for as long as that chunk still covers it. A chunk arriving mid-blend blends from the chunk
    being blended in (the mixture itself is not a chunk).
    on_exhausted: past the last row, "hold" repeats it and "stop" returns action None.
    """

    def __init__(self, blend_steps: int = 0, on_exhausted: str = "hold"):
        if blend_steps < 0:
            raise ConfigError(f"blend_steps {blend_steps} must be >= 0")
        if on_exhausted not in ("hold", "stop"):
            raise ConfigError(f"on_exhausted {on_exhausted!r} must be 'hold' or 'stop'")
        self.blend_steps = blend_steps
        self.on_exhausted = on_exhausted
        self._plan: ActionChunkPlan | None = None
        self._replaced: ActionChunkPlan | None = None  # blended out over the first ticks
        self._blend_tick = 0
        self.stats = {"chunks_accepted": 0, "chunks_ignored": 0}

    def push(self, plan: ActionChunkPlan) -> bool:
        """Switch to `plan` if it is newer (higher frame_index or newer stamp); False if ignored."""
        current = self._plan
        if current is not None:
            if not (plan.frame_index > current.frame_index or plan.stamp_s > current.stamp_s):
                self.stats["chunks_ignored"] += 1  # late or duplicate: the robot already moved on
                return False
            if plan.actions.shape[1] != current.actions.shape[1]:
                raise ActionError(
                    f"action chunk of frame {plan.frame_index} has {plan.actions.shape[1]} action dims, "
                    f"the current chunk has {current.actions.shape[1]}"
                )
        self._plan = plan
        self._replaced = current if self.blend_steps else None
        self._blend_tick = 0
        self.stats["chunks_accepted"] += 1
        return True

    def next(self, now_s: float) -> TickCommand:
        if not math.isfinite(now_s):
            raise ActionError(f"now_s {now_s} is not finite")
        plan = self._plan
        if plan is None:
            return TickCommand(None, -1, -1, "no_chunk")
        row = max(plan.row_at(now_s), 0)  # before t0 (clocks a hair apart): the first row
        if row >= plan.horizon:
            self._replaced = None
            if self.on_exhausted == "stop":
                return TickCommand(None, plan.frame_index, -1, "stopped")
            return TickCommand(plan.actions[-1].copy(), plan.frame_index, plan.horizon - 1, "hold")
        action = plan.actions[row]
        old = self._replaced
        if old is not None and self._blend_tick < self.blend_steps:
            old_row = old.row_at(now_s)
            if 0 <= old_row < old.horizon:
                w = (self._blend_tick + 1) / (self.blend_steps + 1)
                self._blend_tick += 1
                blended = (1.0 - w) * old.actions[old_row] + w * action
                return TickCommand(blended, plan.frame_index, row, "blending")
        self._replaced = None  # blend finished, or the old chunk no longer covers now
        return TickCommand(action.copy(), plan.frame_index, row, "ok")

    @property
    def plan(self) -> ActionChunkPlan | None:
        """The chunk in use (None before the first)."""
        return self._plan

    def age_s(self, now_s: float) -> float | None:
        """Seconds since the current chunk's observation; None without a chunk."""
        return None if self._plan is None else now_s - self._plan.stamp_s
