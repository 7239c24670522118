"""Fleet capacity: do N robots fit their chunk periods on this engine?

A cycle that takes m robots' frames costs about `fixed + per_frame x m` (prefill and actions, the part that
comes first; language only gets the time that is left). With at most M frames per cycle and N robots
asking, earliest deadline first serves every robot once in ceil(N / M) cycles, so each robot gets a chunk
about every ceil(N / M) x cost(min(N, M)) seconds. A robot fits when that is within its chunk period (the
time its chunk covers: horizon x control period). Costs are measured once on the engine's own model and
device (`measure`: a worst-case frame, every camera slot and a full-length prompt, at 1 and at M frames),
or declared (`EngineConfig.frame_cost_ms`, then `fixed` is 0). The prediction ignores the camera's own rate
and the preparation of images (done ahead on a GPU host), and is meant as a warning before the robot moves,
not as a guarantee: the engine counts what it really achieves per robot (stats: chunks_per_s,
deadline_misses).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from oxygen_ros.model.pi05 import PrefixRow

from .model_runner import EngineFault, ModelRunner


@dataclass(frozen=True)
class CycleCost:
    fixed_s: float
    per_frame_s: float
    source: str                     # "measured" or "declared"

    def of(self, frames: int) -> float:
        return self.fixed_s + self.per_frame_s * frames


@dataclass(frozen=True)
class Capacity:
    cost: CycleCost
    max_per_cycle: int
    chunks_per_s: dict[str, float]       # predicted, per robot
    needed_per_s: dict[str, float]       # 1 / chunk period, per robot

    @property
    def short(self) -> list[str]:
        """The robots predicted to miss their chunk period."""
        return [r for r, rate in self.chunks_per_s.items() if rate < self.needed_per_s[r]]

    def summary(self) -> str:
        n = len(self.chunks_per_s)
        m = min(n, self.max_per_cycle)
        head = (f"{_count(n, 'robot')}, at most {self.max_per_cycle} frames per cycle, a cycle of {_count(m, 'frame')} "
                f"{1e3 * self.cost.of(m):.0f} ms ({self.cost.source})")
        rates = ", ".join(f"{r or 'robot'} {self.chunks_per_s[r]:.1f}/s (needs {self.needed_per_s[r]:.1f})"
                          for r in self.chunks_per_s)
        verdict = f"predicted short: {self.short}" if self.short else "every robot fits its chunk period"
        return f"capacity: {head}; predicted chunks {rates}; {verdict}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class CapacityCheck:
    """The engine's capacity check: the cycle cost (declared, else measured once), then predictions for a
    set of robots; with strict_capacity a predicted shortfall raises ValueError."""

    def __init__(self, runner: ModelRunner, config):
        self.runner, self.config = runner, config
        self.cost: CycleCost | None = None

    def check(self, chunk_periods: dict[str, float], may_measure: bool) -> Capacity:
        if self.cost is None:
            c = self.config
            if c.frame_cost_ms:
                self.cost = CycleCost(0.0, c.frame_cost_ms / 1e3, "declared")
            elif not may_measure:
                raise RuntimeError("the cycle cost is measured before the engine thread starts")
            else:
                self.cost = measure(self.runner, max(1, min(len(chunk_periods), c.max_robots_per_cycle)),
                                    c.denoise_steps)
        found = predict(self.cost, chunk_periods, self.config.max_robots_per_cycle)
        if found.short and self.config.strict_capacity:
            raise ValueError(f"strict_capacity: {found.summary()}")
        return found

    def check_added(self, chunk_periods: dict[str, float]) -> None:
        """A robot is being added at run time: refuse it under strict_capacity if the grown set is short
        (only once a cost is known: a server checks its capacity before it starts)."""
        if self.config.strict_capacity and self.cost is not None:
            self.check(chunk_periods, may_measure=False)


def predict(cost: CycleCost, chunk_periods: dict[str, float], max_per_cycle: int) -> Capacity:
    n = len(chunk_periods)
    round_s = math.ceil(n / max_per_cycle) * cost.of(min(n, max_per_cycle)) if n else 0.0
    rate = 1.0 / round_s if round_s > 0 else math.inf
    return Capacity(cost, max_per_cycle, dict.fromkeys(chunk_periods, rate),
                    {r: 1.0 / p for r, p in chunk_periods.items()})


def measure(runner: ModelRunner, frames: int, denoise_steps: int | None, repeats: int = 3) -> CycleCost:
    """Time prefill + actions of a worst-case frame at 1 and at `frames` frames (best of `repeats`, after
    an untimed warm-up at each size: a shape's first call pays its allocations, which made one start-up's
    estimate 9.1 s and the next 1.3 s for the same fleet), on the engine thread's model; the frames' KV is
    released at once."""
    cfg = runner.cfg
    row = PrefixRow(torch.zeros(len(cfg.camera_slots), 3, cfg.vision.image_size, cfg.vision.image_size),
                    torch.ones(cfg.max_token_len, dtype=torch.long))

    def cycle(m: int) -> float:
        t = time.perf_counter()
        caches = runner.prefill([row] * m, list(range(m)), [0.0] * m)
        try:
            good = [c for c in caches if not isinstance(c, EngineFault)]
            if good:
                runner.actions(good, torch.zeros(len(good), cfg.action_horizon, cfg.action_dim), denoise_steps)
        finally:
            for c in caches:
                if not isinstance(c, EngineFault):
                    c.release()
        if runner.model.device.type == "cuda":
            torch.cuda.synchronize(runner.model.device)
        return time.perf_counter() - t

    for m in {1, frames}:
        cycle(m)                                                    # warm-up (allocations, kernels)
    one = min(cycle(1) for _ in range(repeats))
    if frames == 1:
        return CycleCost(0.0, one, "measured")
    many = min(cycle(frames) for _ in range(repeats))
    per_frame = max((many - one) / (frames - 1), 0.0)
    return CycleCost(max(one - per_frame, 0.0), per_frame, "measured")
