"""Action chunks -> one command per publish tick, sampled at the time each row is meant for.

Two rates: a chunk's rows are one *control period* apart (dt: the rate the checkpoint was trained at,
e.g. DROID 15 Hz, ALOHA 50 Hz), while commands go out at the *publish rate* (the 70 Hz timer). Row k of
a chunk computed from an observation stamped t0 is meant for t0 + k*dt, so a DROID chunk of 15 rows
spans 1 s of commands whatever the publish rate. At time `now` the follower samples the chunk at
u = (now - t0) / dt:
- velocity-like dimensions (joint velocities, per-step deltas) hold row floor(u) for its whole period:
  the command is a rate, and the robot should apply that rate for as long as the row lasts;
- position-like dimensions (`interpolate` mask: joint positions, gripper positions) are interpolated
  linearly between rows floor(u) and floor(u) + 1: a smooth target path rather than a staircase.
Rows whose time passed during inference are skipped (latency alignment, in the chunk's own time base).
`replan_steps` is openpi's open-loop horizon: a newer chunk takes over only once the current one has
played that many rows (0: at once).

How a newer chunk takes over (`execution`):
- naive: at once, at its row meant for now (the jump between the two plans is the robot's);
- blend: at once, mixed in linearly with the replaced chunk over `blend_steps` ticks (two plans averaged);
- rtc: at once, at its row meant for now, without blending: the engine made it continue the chunk that was
  playing while it computed (real-time chunking, docs/rtc.md), so nothing needs smoothing. The follower
  plays it as naive; the mode tells the engine side to guide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import ActionError, ConfigError

_EPS = 1e-9  # now exactly on a row's time must select that row despite float rounding

STATUSES = ("ok", "blending", "hold", "stopped", "no_chunk")
EXECUTIONS = ("naive", "blend", "rtc")


def execution_problems(execution: str, blend_steps: int, replan_steps: int) -> list[str]:
    """Every inconsistency of the take-over settings, one line each (a node lists them all)."""
    if execution not in EXECUTIONS:
        return [f"execution {execution!r} must be one of {', '.join(EXECUTIONS)}"]
    out = []
    if blend_steps < 0:
        out.append(f"blend_steps {blend_steps} must be >= 0")
    elif execution == "blend" and blend_steps == 0:
        out.append("execution 'blend' needs blend_steps >= 1")
    elif execution != "blend" and blend_steps:
        out.append(f"blend_steps {blend_steps} applies to execution 'blend' only (execution is '{execution}')")
    if replan_steps < 0:
        out.append(f"replan_steps {replan_steps} must be >= 0")
    elif execution == "rtc" and replan_steps:
        out.append(f"execution 'rtc' takes a chunk over when it arrives (the engine guided it to continue from "
                   f"there): replan_steps must be 0, got {replan_steps}")
    return out


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

    def sample(self, now_s: float, interpolate: np.ndarray | None = None) -> np.ndarray:
        """The command at `now_s` (clamped to the chunk): rows held, except the `interpolate` dims, which
        go linearly from their row to the next one (the last row is held for its period)."""
        u = (now_s - self.stamp_s) / self.step_period_s
        row = min(max(math.floor(u + _EPS), 0), self.horizon - 1)
        action = self.actions[row].copy()
        if interpolate is not None and interpolate.any() and row + 1 < self.horizon:
            frac = min(max(u - row, 0.0), 1.0)
            nxt = self.actions[row + 1]
            action[interpolate] += frac * (nxt[interpolate] - action[interpolate])
        return action

    def time_of_row(self, row: int) -> float:
        return self.stamp_s + row * self.step_period_s


@dataclass(frozen=True)
class TickCommand:
    action: np.ndarray | None  # None: stop (the node publishes nothing or a zero velocity)
    frame_index: int  # frame of the chunk in use; -1 without one
    index: int  # row of that chunk the action comes from; -1 when no row is used
    status: str  # one of STATUSES
    switched: bool = False  # this tick started a newer chunk


class ChunkFollower:
    """Keeps the newest chunk and answers `next(now)` once per publish tick.

    execution: how a newer chunk takes over, naive | blend | rtc (see the module docstring).
    interpolate: per action dimension, True where it is position-like (see the module docstring);
    None: every dimension held.
    replan_steps: rows the current chunk plays before a newer one takes over (0: at once); a newer
    chunk waits meanwhile, and a still newer one replaces it while it waits.
    blend_steps (execution blend): after a switch, the first blend_steps ticks output (1 - w) * old + w * new
    with w = (i + 1) / (blend_steps + 1), `old` being the replaced chunk sampled at the same time, for as
    long as that chunk still covers it. A chunk arriving mid-blend blends from the chunk being blended
    in (the mixture itself is not a chunk).
    on_exhausted: past the last row's period, "hold" repeats it and "stop" returns action None.
    """

    def __init__(self, execution: str = "naive", blend_steps: int = 0, on_exhausted: str = "hold",
                 interpolate=None, replan_steps: int = 0):
        problems = execution_problems(execution, blend_steps, replan_steps)
        if on_exhausted not in ("hold", "stop"):
            problems.append(f"on_exhausted {on_exhausted!r} must be 'hold' or 'stop'")
        if problems:
            raise ConfigError("; ".join(problems))
        self.execution = execution
        self.blend_steps = blend_steps
        self.on_exhausted = on_exhausted
        self.interpolate = None if interpolate is None or len(interpolate) == 0 else np.array(interpolate, bool)
        self.replan_steps = replan_steps
        self._plan: ActionChunkPlan | None = None
        self._waiting: ActionChunkPlan | None = None  # newer than _plan, takes over after replan_steps rows
        self._replaced: ActionChunkPlan | None = None  # blended out over the first ticks
        self._blend_tick = 0
        self._switched = False  # a newer chunk started since the last tick
        self.stats = {"chunks_accepted": 0, "chunks_ignored": 0, "chunks_superseded": 0}

    def push(self, plan: ActionChunkPlan) -> bool:
        """Accept `plan` if it is newer (higher frame_index or newer stamp) than every chunk held; it
        takes over at once, or once the current chunk has played replan_steps rows. False if ignored."""
        newest = self._waiting or self._plan
        if newest is not None:
            if not (plan.frame_index > newest.frame_index or plan.stamp_s > newest.stamp_s):
                self.stats["chunks_ignored"] += 1  # late or duplicate: the robot already moved on
                return False
            if plan.actions.shape[1] != newest.actions.shape[1]:
                raise ActionError(
                    f"action chunk of frame {plan.frame_index} has {plan.actions.shape[1]} action dims, "
                    f"the current chunk has {newest.actions.shape[1]}"
                )
        if self.interpolate is not None and len(self.interpolate) != plan.actions.shape[1]:
            raise ActionError(f"action chunk of frame {plan.frame_index} has {plan.actions.shape[1]} action "
                              f"dims, the interpolate mask {len(self.interpolate)}")
        self.stats["chunks_accepted"] += 1
        if self._plan is None or not self.replan_steps:
            self._switch(plan)
            return True
        if self._waiting is not None:
            self.stats["chunks_superseded"] += 1  # replaced while waiting: never played
        self._waiting = plan
        return True

    def _switch(self, plan: ActionChunkPlan) -> None:
        self._replaced = self._plan if self.blend_steps else None
        self._plan, self._waiting = plan, None
        self._blend_tick = 0
        self._switched = True

    def _take_over(self, now_s: float) -> bool:
        """Switch to the waiting chunk once the current one has played replan_steps rows (or is used up);
        True if this tick starts a newer chunk."""
        if self._waiting is not None and self._plan.row_at(now_s) >= self.replan_steps:
            self._switch(self._waiting)
        switched, self._switched = self._switched, False
        return switched

    def next(self, now_s: float) -> TickCommand:
        if not math.isfinite(now_s):
            raise ActionError(f"now_s {now_s} is not finite")
        switched = self._take_over(now_s)
        plan = self._plan
        if plan is None:
            return TickCommand(None, -1, -1, "no_chunk")
        row = max(plan.row_at(now_s), 0)  # before t0 (clocks a hair apart): the first row
        if row >= plan.horizon:
            self._replaced = None
            if self.on_exhausted == "stop":
                return TickCommand(None, plan.frame_index, -1, "stopped", switched)
            return TickCommand(plan.actions[-1].copy(), plan.frame_index, plan.horizon - 1, "hold", switched)
        action = plan.sample(now_s, self.interpolate)
        old = self._replaced
        if old is not None and self._blend_tick < self.blend_steps:
            if 0 <= old.row_at(now_s) < old.horizon:
                w = (self._blend_tick + 1) / (self.blend_steps + 1)
                self._blend_tick += 1
                blended = (1.0 - w) * old.sample(now_s, self.interpolate) + w * action
                return TickCommand(blended, plan.frame_index, row, "blending", switched)
        self._replaced = None  # blend finished, or the old chunk no longer covers now
        return TickCommand(action, plan.frame_index, row, "ok", switched)

    @property
    def plan(self) -> ActionChunkPlan | None:
        """The chunk in use (None before the first)."""
        return self._plan

    def age_s(self, now_s: float) -> float | None:
        """Seconds since the current chunk's observation; None without a chunk."""
        return None if self._plan is None else now_s - self._plan.stamp_s
