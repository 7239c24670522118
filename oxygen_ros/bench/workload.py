"""What the benchmark feeds the engines: robots (cameras, state size), request arrival patterns, and the
seeded frames, noise and arrival schedule that every setting receives identically."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from oxygen_ros.model.config import CAMERA_SLOTS
from oxygen_ros.robot.sync import Observation


@dataclass(frozen=True)
class Robot:
    name: str
    cameras: tuple[bool, bool, bool]   # which of the model's three camera slots carry an image
    image_hw: tuple[int, int]          # camera image size (resized to the model's by the engine)
    state_dim: int


# Image sizes as the robots' datasets deliver them (LIBERO 256x256, DROID 180x320, ALOHA 480x640).
ROBOTS = {
    "libero": Robot("libero", (True, True, False), (256, 256), 8),   # base + wrist, right slot masked
    "droid": Robot("droid", (True, True, False), (180, 320), 8),     # exterior + wrist, right slot masked
    "aloha": Robot("aloha", (True, True, True), (480, 640), 14),     # high + two wrists
}


def parse_arrival(spec: str) -> tuple[str, float]:
    """`every`, `every:K`, `burst:N`, `poisson:RATE` -> (kind, parameter)."""
    kind, _, arg = spec.partition(":")
    kind = kind.strip().lower()
    try:
        if kind == "every":
            k = int(arg) if arg else 1
            if k < 1:
                raise ValueError
            return kind, k
        if kind == "burst":
            n = int(arg)
            if n < 1:
                raise ValueError
            return kind, n
        if kind == "poisson":
            rate = float(arg)
            if not rate > 0 or not math.isfinite(rate):
                raise ValueError
            return kind, rate
    except ValueError:
        pass
    raise ValueError(f"bad --arrival {spec!r}: use every, every:K (K >= 1), burst:N (N >= 1) or "
                     f"poisson:RATE (requests per frame, > 0)")


def arrival_schedule(spec: str, frames: int, seed: int) -> list[int]:
    """Requests submitted just before each frame's cycle."""
    kind, arg = parse_arrival(spec)
    if kind == "every":
        return [1 if i % int(arg) == 0 else 0 for i in range(frames)]
    if kind == "burst":
        return [int(arg)] * frames
    rng = np.random.default_rng([seed, 7])
    return [int(x) for x in rng.poisson(arg, frames)]


@dataclass
class Workload:
    robot: Robot
    frames: int
    arrival: str
    reply_tokens: int
    denoise_steps: int
    budget: str                      # "fixed" or "deadline"
    tokens_per_frame: int
    action_rate_hz: float
    seed: int
    prompt: str
    question: str
    schedule: list[int] = field(default_factory=list)
    observations: list = field(default_factory=list)
    noise: list = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.schedule)

    @property
    def requests_per_frame(self) -> float:
        return self.requests / self.frames if self.frames else 0.0

    def params(self) -> dict:
        return {"robot": self.robot.name, "cameras": sum(self.robot.cameras), "image_hw": list(self.robot.image_hw),
                "state_dim": self.robot.state_dim, "frames": self.frames, "arrival": self.arrival,
                "requests": self.requests, "requests_per_frame": self.requests_per_frame,
                "reply_tokens": self.reply_tokens, "denoise_steps": self.denoise_steps,
                "decode_budget": self.budget,
                "tokens_per_frame": self.tokens_per_frame if self.budget == "fixed" else None,
                "action_rate_hz": self.action_rate_hz, "seed": self.seed, "prompt": self.prompt,
                "question": self.question, "schedule": list(self.schedule)}


def make_workload(robot: str, frames: int, arrival: str, reply_tokens: int, denoise_steps: int, budget: str,
                  tokens_per_frame: int, action_rate_hz: float, seed: int, action_horizon: int, action_dim: int,
                  prompt: str, question: str, offset: int = 0) -> Workload:
    """Seeded synthetic frames (random uint8 images, a random normalised state) and per-frame noise.
    `offset` shifts the seed stream (the warm-up uses other frames than the timed runs)."""
    r = ROBOTS[robot]
    wl = Workload(r, frames, arrival, reply_tokens, denoise_steps, budget, tokens_per_frame, action_rate_hz, seed,
                  prompt, question, arrival_schedule(arrival, frames, seed + offset))
    h, w = r.image_hw
    for i in range(frames):
        rng = np.random.default_rng([seed, offset, i])
        images = {slot: (rng.integers(0, 256, (h, w, 3), dtype=np.uint8) if on else None)
                  for slot, on in zip(CAMERA_SLOTS, r.cameras)}
        wl.observations.append(Observation(stamp_s=0.1 * i, images=images,
                                           image_masks=dict(zip(CAMERA_SLOTS, r.cameras)),
                                           state=rng.uniform(-1, 1, r.state_dim), prompt=prompt))
        wl.noise.append(rng.standard_normal((action_horizon, action_dim)).astype(np.float32))
    return wl
