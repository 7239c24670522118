"""The robots an engine serves: each a name with its `FramePreparer` (policy I/O: cameras, action dims,
transforms, norm stats) and what nodes may know of it (`EngineInfo`). Robots are added and removed at run
time (a connecting client, a fleet member), so the set is copy-on-write: every change makes new
containers, never changes them in place, and a reader on any thread sees a consistent set."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from .config import EngineConfig
from .frames import FramePreparer
from .model_runner import ModelRunner


@dataclass(frozen=True)
class EngineInfo:
    """What a node or tool may know about a running engine, for one robot (read-only)."""

    camera_slots: tuple[str, ...]
    action_dim: int                # what the robot receives per row
    max_state_dim: int             # the model's padded width: the longest state that fits
    action_horizon: int
    action_rate_hz: float
    frame_period_s: float
    policy: str
    attention_backend: str
    cuda_graphs: bool              # fixed-shape steps on (captured as CUDA graphs on a GPU)
    kv_blocks: int
    block_size: int
    max_question_chars: int
    max_queued_requests: int
    robot: str = ""                # whose policy I/O (action_dim, chunk period) this describes
    chunk_period_s: float = 0.0    # the robot's frame deadline after its observation arrives


class Robots:
    def __init__(self, runner: ModelRunner, config: EngineConfig, frame_period: float):
        self.runner, self.config, self.frame_period = runner, config, frame_period
        self.prefix_blocks = runner.pool.blocks_for(runner.max_prefix_tokens())
        self.names: tuple[str, ...] = ()
        self.preparers: dict[str, FramePreparer] = {}
        self.infos: dict[str, EngineInfo] = {}
        self.lock = threading.Lock()           # serialises changes (the engine holds it while it applies one)

    def add(self, name: str, preparer: FramePreparer) -> EngineInfo:
        """Under `lock`: the new robot's info, the set grown by it. ValueError when the name is taken or the
        KV pool cannot keep room for one more frame per cycle."""
        if not isinstance(name, str) or not isinstance(preparer, FramePreparer):
            raise ValueError(f"a robot is a name (text) and a FramePreparer, got {name!r}, {type(preparer).__name__}")
        if name in self.infos:
            raise ValueError(f"robot {name!r} is already served by this engine")
        self.check_pool(len(self.names) + 1)
        r, c = self.runner, self.config
        info = EngineInfo(tuple(r.cfg.camera_slots), preparer.robot_action_dim, r.cfg.action_dim, r.cfg.action_horizon,
                          c.action_rate_hz, self.frame_period, c.policy, r.backend, r.graphs is not None,
                          r.pool.num_blocks, r.pool.block_size, c.max_question_chars, c.max_queued_requests, name,
                          self.chunk_period(preparer))
        self.preparers = {**self.preparers, name: preparer}
        self.infos = {**self.infos, name: info}
        self.names = self.names + (name,)
        return info

    def remove(self, name: str) -> None:
        """Under `lock`: the set without `name` (ValueError if it is not served)."""
        self.info(name)
        self.names = tuple(n for n in self.names if n != name)
        self.infos = {n: i for n, i in self.infos.items() if n != name}
        self.preparers = {n: p for n, p in self.preparers.items() if n != name}

    def info(self, name: str) -> EngineInfo:
        info = self.infos.get(name)
        if info is None:
            raise ValueError(f"unknown robot {name!r}: this engine serves {list(self.names)}")
        return info

    def chunk_periods(self) -> dict[str, float]:
        return {n: i.chunk_period_s for n, i in self.infos.items()}

    def reserve_blocks(self) -> int:
        """KV blocks admission keeps free for the next cycle's prefills: up to max_robots_per_cycle frames."""
        return min(len(self.names), self.config.max_robots_per_cycle) * self.prefix_blocks

    def check_pool(self, robots: int) -> None:
        per_cycle, pool = min(robots, self.config.max_robots_per_cycle), self.runner.pool
        if pool.num_blocks < 2 * per_cycle * self.prefix_blocks:
            raise ValueError(f"KV pool of {pool.num_blocks} blocks cannot hold two cycles of {per_cycle} frame "
                             f"prefixes of {self.prefix_blocks} blocks: raise the KV memory budget")

    def chunk_period(self, preparer: FramePreparer) -> float:
        """A robot's frame deadline after its observation arrives: the time its chunk covers at its control
        period (horizon x control_period_s), else the engine's frame period (horizon / action_rate_hz)."""
        period = preparer.io.control_period_s
        return self.runner.cfg.action_horizon * period if period > 0 else self.frame_period
