"""The actions task: each frame's action chunk, first in every cycle so that it meets its deadline.

All frames of a cycle are denoised together (one expert batch over their prefix KVs, read-only), then each
chunk goes back to its robot's units through that robot's policy I/O. A chunk that cannot be used (non-finite
actions, a failing output transform) is a fault of its frame alone. Delivering a chunk makes it the robot's
latest and hands it to the chunk listeners (the action publishers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from oxygen_ros.robot.chunks import ActionChunkPlan

from ..config import EngineConfig
from ..cycle import Frame
from ..model_runner import EngineFault, ModelRunner
from ..stats import EngineStats


@dataclass(frozen=True)
class ChunkResult:
    plan: ActionChunkPlan          # robot units; row k is meant for stamp + k * control period
    model_actions: np.ndarray      # [H, action_dim] the expert's output before un-normalisation
    compute_s: float               # cycle start -> chunk ready (engine clock)
    prompt_truncated: int          # prompt tokens cut to fit the model's max_token_len
    robot: str = ""                # whose chunk (listeners get every robot's chunks)


class ActionsTask:
    def __init__(self, runner: ModelRunner, config: EngineConfig, stats: EngineStats,
                 clock: Callable[[], float], notify: Callable[[ChunkResult], None]):
        self.runner, self.config, self.stats, self.clock, self.notify = runner, config, stats, clock, notify
        self.latest: dict[str, ChunkResult] = {}      # per robot, its last delivered chunk

    def chunks(self, frames: list[Frame], start: float,
               faults: list[tuple[Frame, str]]) -> list[tuple[Frame, ChunkResult]]:
        """Denoise the frames' chunks together; a frame whose chunk is unusable goes to `faults`."""
        out = []
        noise = torch.stack([f.noise for f in frames])
        for f, actions in zip(frames, self.runner.actions([f.cache for f in frames], noise,
                                                          self.config.denoise_steps)):
            if isinstance(actions, EngineFault):
                faults.append((f, str(actions)))
                continue
            try:
                out.append((f, self._chunk(f, actions, start)))
            except Exception as e:  # noqa: BLE001 - the robot's output transform failed: this frame only
                faults.append((f, f"{type(e).__name__}: {e}"))
        return out

    def _chunk(self, f: Frame, model_actions: np.ndarray, start: float) -> ChunkResult:
        robot_actions = f.preparer.robot_actions(model_actions, f.prepared)
        # Rows are one control period apart (the rate the checkpoint was trained at); 0: one per publish tick.
        step_s = f.preparer.io.control_period_s or 1.0 / self.config.action_rate_hz
        plan = ActionChunkPlan(robot_actions, f.prepared.stamp, step_s, f.index)
        return ChunkResult(plan, model_actions, self.clock() - start, f.prepared.prompt_truncated, f.robot)

    def deliver(self, f: Frame, chunk: ChunkResult) -> None:
        if chunk.prompt_truncated:
            self.stats.count("prompts_truncated")
        self.stats.record_chunk(f.robot, chunk.compute_s, self.clock() > f.deadline)
        self.latest[f.robot] = chunk
        self.notify(chunk)

    def forget(self, robot: str | None = None) -> None:
        """Drop a robot's latest chunk (every robot's: the safe stop), so that nobody plays it on."""
        if robot is None:
            self.latest = {}
        else:
            self.latest.pop(robot, None)
