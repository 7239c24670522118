"""The actions task: each frame's action chunk, first in every cycle so that it meets its deadline.

All frames of a cycle are denoised together (one expert batch over their prefix KVs, read-only), then each
chunk goes back to its robot's units through that robot's policy I/O. A chunk that cannot be used (non-finite
actions, a failing output transform) is a fault of its frame alone. Delivering a chunk makes it the robot's
latest and hands it to the chunk listeners (the action publishers).

Real-time chunking (config `rtc`, docs/rtc.md): a robot's publisher plays the chunk the engine delivered to
it last, taking a new one over when it arrives, at its row meant for then. So each robot's new chunk is
guided (model/rtc.py) toward that chunk's rows for the same times:
- alignment: the playing chunk's row for the new observation's stamp (both stamps on the robot's clock)
  is the new chunk's row 0; its delta dimensions are re-expressed relative to the new observation's state;
- delay d, the rows that play before the new chunk takes over: `rtc_delay_rows` if set, else predicted
  as ceil((wait + latency) / control period), with wait = cycle start - the observation's arrival at the
  engine (known for this frame) and latency = the longest cycle-start-to-chunk time of the robot's last
  LATENCY_WINDOW chunks (measured). Not counted: the observation's age on arrival (camera, transport:
  another clock) and the publisher's wait for its next tick (< 1 period);
- pinned rows (weight 1): the d rows that play before the take-over and `rtc_margin_rows` more, the first
  rows the new chunk plays: the guidance does not make a guided row equal to its target (92% of the way
  with LeRobot's correction at 10 steps; docs/rtc.md), so pinning only the d rows that never play from the
  new chunk leaves a step at the take-over;
- no guidance (plain denoising, bit for bit) without a delivered chunk, when it has no row left for the new
  chunk, when d is 0 (nothing plays while the chunk computes), while the robot's output is off (`set_playing`:
  its publisher says so; nothing plays the chunks, the robot stays where it is or is moved by someone else,
  so continuing them would lead from where it is not: each is planned from its state, and RTC continues the
  last of them, the one that plays first, when the output is back on), or for a robot added without RTC (a
  socket client plays each chunk open-loop for its own number of rows, not the newest chunk at once).
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from oxygen_ros.model import rtc
from oxygen_ros.robot.chunks import ActionChunkPlan

from ..config import EngineConfig
from ..cycle import Frame
from ..frames import FramePreparer
from ..model_runner import EngineFault, ModelRunner
from ..stats import EngineStats


@dataclass(frozen=True)
class ChunkResult:
    plan: ActionChunkPlan          # robot units; row k is meant for stamp + k * control period
    model_actions: np.ndarray      # [H, action_dim] the expert's output before un-normalisation
    compute_s: float               # cycle start -> chunk ready (engine clock)
    prompt_truncated: int          # prompt tokens cut to fit the model's max_token_len
    robot: str = ""                # whose chunk (listeners get every robot's chunks)
    rtc_delay_rows: int | None = None   # RTC: the delay it was guided with (None: plain denoising)
    subtask: str = ""              # the subtask text that conditioned it (hierarchy; "" when none)


PREFIX_UNTRAINED = ("rtc_correction 'prefix' needs a checkpoint trained with prefix conditioning (its config.json "
                    "says \"prefix_conditioning\": true; oxygen_ros.training.train --prefix-delay-max); this model "
                    "was not: use error or vjp")
LATENCY_WINDOW = 8      # chunks of a robot whose measured latency predicts its next RTC delay


@dataclass(frozen=True)
class _Played:
    """A robot's last delivered chunk, with the state its delta actions are relative to (model units, not
    normalised): what RTC continues."""

    chunk: ChunkResult
    model_state: np.ndarray


class ActionsTask:
    def __init__(self, runner: ModelRunner, config: EngineConfig, stats: EngineStats,
                 clock: Callable[[], float], notify: Callable[[ChunkResult], None]):
        self.runner, self.config, self.stats, self.clock, self.notify = runner, config, stats, clock, notify
        self.latest: dict[str, ChunkResult] = {}      # per robot, its last delivered chunk
        self._played: dict[str, _Played] = {}
        self._latency: dict[str, collections.deque] = {}   # per robot, recent cycle start -> chunk ready (s)
        self._unguided: set[str] = set()                   # robots added without RTC (set_rtc)
        self._idle: set[str] = set()                       # robots whose output is off (set_playing)
        # Replay (record/replay.py): the delay each recorded chunk was made with, for the next cycle's chunks
        # (0: plain), instead of the one predicted from this process's timing.
        self.replayed_delay: int | None = None
        if config.rtc and config.rtc_correction == "prefix" and not runner.cfg.prefix_conditioning:
            raise ValueError(PREFIX_UNTRAINED)

    def chunks(self, frames: list[Frame], start: float,
               faults: list[tuple[Frame, str]]) -> list[tuple[Frame, ChunkResult]]:
        """Denoise the frames' chunks together (with RTC: each guided by its robot's playing chunk); a frame
        whose chunk is unusable goes to `faults`."""
        c = self.config
        out = []
        noise = torch.stack([f.noise for f in frames])
        guided = [self._guide(f, start) if c.rtc else (None, None) for f in frames]
        rtc_args = dict(guides=[guide for guide, _ in guided], max_guidance=c.rtc_max_guidance,
                        correction=c.rtc_correction) if c.rtc else {}
        caches = [f.action_cache or f.cache for f in frames]       # the joint format's: prefix + subtask span
        results = self.runner.actions(caches, noise, c.denoise_steps, **rtc_args)
        for f, actions, (_, delay) in zip(frames, results, guided):
            if isinstance(actions, EngineFault):
                faults.append((f, str(actions)))
                continue
            try:
                out.append((f, self._chunk(f, actions, start, delay)))
            except Exception as e:  # noqa: BLE001 - the robot's output transform failed: this frame only
                faults.append((f, f"{type(e).__name__}: {e}"))
        return out

    def _chunk(self, f: Frame, model_actions: np.ndarray, start: float, delay: int | None) -> ChunkResult:
        robot_actions = f.preparer.robot_actions(model_actions, f.prepared)
        plan = ActionChunkPlan(robot_actions, f.prepared.stamp, self._step_s(f), f.index)
        return ChunkResult(plan, model_actions, self.clock() - start, f.prepared.prompt_truncated, f.robot, delay,
                           f.subtask)

    def _step_s(self, f: Frame) -> float:
        # Rows are one control period apart (the rate the checkpoint was trained at); 0: one per publish tick.
        return f.preparer.io.control_period_s or 1.0 / self.config.action_rate_hz

    def set_rtc(self, robot: str, enabled: bool) -> None:
        """Whether the engine's RTC (config `rtc`) guides this robot's chunks: only for a robot that plays the
        newest chunk at once, taking it over at its row for then (an action publisher with execution rtc)."""
        (self._unguided.discard if enabled else self._unguided.add)(robot)

    def _guide(self, f: Frame, start: float) -> tuple[rtc.RowGuide | None, int | None]:
        """(guide, delay in rows) of a frame's chunk, or (None, None): see the module docstring."""
        played = self._played.get(f.robot)
        if played is None or f.robot in self._unguided or f.robot in self._idle:
            return None, None
        previous, horizon, dim = played.chunk.model_actions, *played.chunk.model_actions.shape
        offset = played.chunk.plan.row_at(f.prepared.stamp)
        delay = self.delay_rows(f, start)
        if not 0 <= offset < horizon or delay == 0:
            return None, None
        leftover = previous[offset:].astype(np.float64)
        io, delta = f.preparer.io, f.preparer.io.delta_dims
        if delta.size:
            # un-normalisation is affine per dimension: its slope turns a change of state into model units
            slope = (io.normalizer.unnormalize_actions(np.ones((1, dim)))
                     - io.normalizer.unnormalize_actions(np.zeros((1, dim))))[0].astype(np.float64)
            state = io.model_state(f.prepared.state)
            if len(state) <= delta.max():
                return None, None               # its robot_actions refuses this state: the frame's fault
            leftover[:, delta] += (played.model_state[delta] - state[delta]) / slope[delta]
        pinned = delay + self.config.rtc_margin_rows
        # prefix conditioning takes the pinned rows only (the model hands over by itself): no soft rows
        end, schedule = ((horizon, "zeros") if self.config.rtc_correction == "prefix" else
                         (self.config.rtc_execution_horizon or horizon, self.config.rtc_schedule))
        guide = rtc.row_guide(torch.as_tensor(leftover), pinned, end, horizon, dim, schedule)
        return (guide, delay) if guide.active else (None, None)

    def delay_rows(self, f: Frame, start: float) -> int:
        """Rows of the playing chunk that play before this frame's chunk takes over (module docstring)."""
        if self.replayed_delay is not None:
            return self.replayed_delay
        if self.config.rtc_delay_rows is not None:
            return self.config.rtc_delay_rows
        step_s = self._step_s(f)
        arrival = f.deadline - self.runner.cfg.action_horizon * step_s   # deadline = arrival + H rows
        recent = self._latency.get(f.robot)
        latency = max(recent) if recent else 0.0
        return max(0, math.ceil((start - arrival + latency) / step_s - 1e-9))

    def deliver(self, f: Frame, chunk: ChunkResult) -> None:
        if chunk.prompt_truncated:
            self.stats.count("prompts_truncated")
        if chunk.rtc_delay_rows is not None:
            self.stats.count("rtc_guided_chunks")
        self.stats.record_chunk(f.robot, chunk.compute_s, self.clock() > f.deadline)
        self.latest[f.robot] = chunk
        self._played[f.robot] = _Played(chunk, f.preparer.io.model_state(f.prepared.state))
        self._latency.setdefault(f.robot, collections.deque(maxlen=LATENCY_WINDOW)).append(chunk.compute_s)
        self.notify(chunk)

    def resume(self, robot: str, chunk: ChunkResult, state: np.ndarray, preparer: FramePreparer) -> None:
        """Replay (record/replay.py): `chunk`, recorded, is the one this robot was playing, delivered for an
        observation with `state` (robot units); its next chunk continues it, as in the recorded run."""
        self._played[robot] = _Played(chunk, preparer.io.model_state(np.asarray(state, dtype=np.float64)))

    def set_playing(self, robot: str, playing: bool) -> None:
        """Whether the robot plays its chunks (its publisher's output is on). While it does not, its chunks are
        plain (module docstring)."""
        (self._idle.discard if playing else self._idle.add)(robot)

    def forget(self, robot: str | None = None) -> None:
        """Drop a robot's latest chunk (every robot's: the safe stop, which keeps their RTC settings), so that
        nobody plays it on (and RTC continues nothing); a named robot is leaving the engine: its setting too."""
        if robot is None:
            self.latest, self._played, self._latency = {}, {}, {}
        else:
            for d in (self.latest, self._played, self._latency):
                d.pop(robot, None)
            self._unguided.discard(robot)
            self._idle.discard(robot)
