"""Real-time chunking (RTC; Black, Galliker, Levine 2025, arXiv 2506.07339): training-free guidance that
makes a new action chunk continue the chunk the robot executes while the new one is computed.

While a chunk computes, the robot plays on: the first d rows of the new chunk (d: the delay in rows) are
already committed by the previous chunk, and its later rows should not contradict the rest of it either.
RTC treats this as inpainting: at every flow step it pulls the prediction of the final actions toward the
previous chunk's rows, with weight 1 on the first d rows, decaying to 0 at row `execution_horizon`, 0 after.

Time convention (Pi05.flow_schedule, openpi, LeRobot 0.6.1's pi05): the flow time t runs from 1 (noise)
to 0 (actions), x <- x + dt * v with dt = -1/steps, and v ~ noise - actions. The paper's tau is 1 - t. Per
guided row, at one flow step:

    x0   = x_t - t * v(x_t)                   the actions this step predicts
    e    = W * (Y - x0)                       Y: the previous chunk's rows aligned to this chunk, W: weights
    g    = (d x0 / d x_t)^T e                 a vector-Jacobian product through the velocity function
    v'   = v - min(beta, c(t)) * g,  c(t) = (t^2 + (1 - t)^2) / (t (1 - t))

(dt < 0, so -dt * min(..) * g moves x_t toward Y.) The velocity function is the action expert over a frame's
prefix K/V: the K/V are constants, the gradient flows only from x_t through the expert's suffix.

A third way needs a model trained for it (`Pi05Config.prefix_conditioning`; Black et al. 2025,
"Training-Time Action Conditioning for Efficient Real-Time Chunking"): correction "prefix" gives the
pinned rows to the expert as clean actions at flow time 0 at every step (Pi05._sample_conditioned) and the
model continues them; no guidance term, no backward pass, only the pinned rows (weight > 0) matter.

LeRobot 0.6.1 (`lerobot.policies.rtc.modeling_rtc.RTCProcessor`) computes the same v' with the same
weights, guidance weight and time convention, except that it evaluates v(x_t) before marking x_t as
requiring a gradient, so its `correction` is e itself (d x0 / d x_t taken as the identity): its result is
v - w * e, the paper's v - w * e + w * t * (dv/dx_t)^T e. Both are here (`correction`): "vjp", the paper's
(default), and "error", LeRobot 0.6.1's (no backward pass). They differ most for a confident model: when
the predicted actions hardly depend on x_t (dx0/dx_t ~ 0, the small demo model), the VJP vanishes and the
paper's guidance cannot move the chunk, while the error term still pulls x_t itself (docs/rtc.md has the
measurements). test/test_rtc.py checks both against reference arrays made with LeRobot
(scripts/rtc_reference.py). The default beta is the paper's (5; LeRobot's config defaults to 10), the
default schedule the paper's (exp; LeRobot's config defaults to linear). The engine's defaults differ
(EngineConfig.rtc_*: LeRobot's, with one more pinned row; measured on the demo, docs/rtc.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

SCHEDULES = ("exp", "linear", "ones", "zeros")
DEFAULT_SCHEDULE = "exp"
GUIDED_CORRECTIONS = ("vjp", "error")        # guided_velocity's
CORRECTIONS = GUIDED_CORRECTIONS + ("prefix",)  # "prefix": a model trained with prefix conditioning
DEFAULT_MAX_GUIDANCE = 5.0      # beta, the paper's value


def prefix_weights(schedule: str, delay: int, execution_horizon: int, horizon: int) -> torch.Tensor:
    """Weights [horizon] (float32) of the previous chunk's rows, as LeRobot 0.6.1's get_prefix_weights(
    start=delay, end=execution_horizon, total=horizon): 1 for rows < delay, then (linear, exp) decaying
    toward 0 until row execution_horizon, 0 from there on; `ones`: 1 before execution_horizon; `zeros`: 1
    for rows < delay only. A delay beyond execution_horizon is cut to it."""
    if schedule not in SCHEDULES:
        raise ValueError(f"RTC schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if delay < 0 or execution_horizon < 0 or horizon < 1:
        raise ValueError(f"RTC weights need delay >= 0, execution_horizon >= 0 and horizon >= 1, got "
                         f"{delay}, {execution_horizon}, {horizon}")
    start = min(delay, execution_horizon)
    if schedule == "zeros":
        w = torch.zeros(horizon)
        w[:start] = 1.0
        return w
    if schedule == "ones":
        w = torch.ones(horizon)
        w[execution_horizon:] = 0.0
        return w
    # The decaying part covers rows start .. min(execution_horizon, horizon) - 1, strictly between 1 and 0.
    span = min(execution_horizon, horizon) - start
    ramp = torch.linspace(1, 0, span + 2)[1:-1] if span > 0 else torch.zeros(0)
    if schedule == "exp":
        ramp = ramp * torch.expm1(ramp).div(math.e - 1)
    tail = torch.zeros(max(horizon - execution_horizon, 0))
    head = torch.ones(min(start, horizon))
    return torch.cat([head, ramp, tail])


def guidance_weight(t: float, max_weight: float) -> float:
    """min(beta, c(t)) of the module docstring at flow time t (1: noise); beta at t = 1 and 0 at t = 0
    (where LeRobot's nan_to_num gives 0; the sampling loop never evaluates t = 0)."""
    if t >= 1.0:
        return float(max_weight)
    if t <= 0.0:
        return 0.0
    return min(float(max_weight), (t * t + (1.0 - t) ** 2) / (t * (1.0 - t)))


def guided_velocity(velocity: Callable[[torch.Tensor], torch.Tensor], x_t: torch.Tensor, t: float,
                    target: torch.Tensor, weights: torch.Tensor, max_weight: float = DEFAULT_MAX_GUIDANCE,
                    correction: str = "vjp") -> torch.Tensor:
    """The RTC velocity v' [G, H, A] (module docstring) of rows x_t [G, H, A] at flow time t, each row with
    its own target rows [G, H, A] and weights [G, H]. correction "vjp": `velocity(x)` must be differentiable
    in x (autograd on, inference mode off); "error": LeRobot 0.6.1's, the weighted error itself. Returns a
    tensor detached from any graph."""
    if correction == "error":
        with torch.no_grad():
            v = velocity(x_t)
            g = (target - (x_t - t * v)) * weights[..., None]
        return v - guidance_weight(t, max_weight) * g
    if correction != "vjp":
        raise ValueError(f"RTC correction {correction!r} is not one of {', '.join(GUIDED_CORRECTIONS)} "
                         f"(the guided velocities)")
    if torch.is_inference_mode_enabled():
        raise RuntimeError("RTC guidance needs autograd: call it outside torch.inference_mode")
    x = x_t.detach().requires_grad_(True)
    with torch.enable_grad():
        v = velocity(x)
        x0 = x - t * v
        error = (target - x0) * weights[..., None]
        (g,) = torch.autograd.grad(x0, x, error.detach())
    return (v - guidance_weight(t, max_weight) * g).detach()


@dataclass(frozen=True)
class RowGuide:
    """One robot's guidance for its next chunk: the previous chunk's rows aligned to the new chunk (row k
    of `target` is meant for the same time as the new chunk's row k; zero where the previous chunk has no
    row) and the weights of those rows."""

    target: torch.Tensor    # [H, A] model space
    weights: torch.Tensor   # [H]

    @property
    def active(self) -> bool:
        """False when no weight is positive: the row is then denoised plainly (bitwise as without RTC)."""
        return bool((self.weights > 0).any())


def row_guide(leftover: torch.Tensor, delay: int, execution_horizon: int, horizon: int, action_dim: int,
              schedule: str = DEFAULT_SCHEDULE) -> RowGuide:
    """A robot's guide from `leftover` [L, A'] (the previous chunk's rows from the one meant for the new
    chunk's row 0 on, model space), as LeRobot 0.6.1 treats prev_chunk_left_over: the weights end at
    min(execution_horizon, L) (there is nothing to continue beyond the previous chunk's last row) and the
    target is padded with zeros to [horizon, action_dim]."""
    leftover = torch.as_tensor(leftover, dtype=torch.float32)
    if leftover.ndim != 2 or leftover.shape[0] > horizon or leftover.shape[1] > action_dim:
        raise ValueError(f"RTC leftover rows must be [<= {horizon}, <= {action_dim}], got {list(leftover.shape)}")
    if not torch.isfinite(leftover).all():
        raise ValueError("RTC leftover rows must be finite")
    target = torch.zeros(horizon, action_dim)
    target[:leftover.shape[0], :leftover.shape[1]] = leftover
    end = min(execution_horizon, leftover.shape[0])
    return RowGuide(target, prefix_weights(schedule, delay, end, horizon))


@dataclass(frozen=True)
class Guidance:
    """RTC for every row of one sampling call (Pi05.sample_actions): per row its target and weights."""

    target: torch.Tensor    # [R, H, A]
    weights: torch.Tensor   # [R, H]
    max_weight: float = DEFAULT_MAX_GUIDANCE
    correction: str = "vjp"

    def __post_init__(self):
        if self.correction not in CORRECTIONS:
            raise ValueError(f"RTC correction {self.correction!r} is not one of {', '.join(CORRECTIONS)}")
        if not self.max_weight > 0:
            raise ValueError(f"RTC max guidance weight (beta) must be > 0, got {self.max_weight}")

    @classmethod
    def stack(cls, guides: Sequence[RowGuide], max_weight: float = DEFAULT_MAX_GUIDANCE,
              correction: str = "vjp") -> "Guidance":
        return cls(torch.stack([g.target for g in guides]), torch.stack([g.weights for g in guides]), max_weight,
                   correction)

    def to(self, device: torch.device | str) -> "Guidance":
        """Float32 copies on `device` (also: made outside inference mode, so autograd may save them)."""
        return Guidance(self.target.to(device, torch.float32, copy=True),
                        self.weights.to(device, torch.float32, copy=True), self.max_weight, self.correction)


def guided_rows(guides: Sequence[RowGuide | None] | None) -> list[int]:
    """Indices of the rows that RTC guides: those with a guide whose weights are not all zero. The others
    never enter the guided arithmetic."""
    return [i for i, g in enumerate(guides or ()) if g is not None and g.active]
