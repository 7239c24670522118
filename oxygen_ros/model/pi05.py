"""π0.5 in plain PyTorch: SigLIP -> projector -> Gemma (the VLM) and the Gemma action expert with
adaRMSNorm, coupled per layer (mixture of transformers: at layer l the expert's queries attend to the
VLM's layer-l prefix K/V plus the action tokens' own K/V).

Three operations, each batched over rows with per-row lengths, each reading/writing K/V only through an
attention object (see attention.py):
- `prefill`: images + prompt -> prefix K/V in the pool, and the hidden state of each row's last token;
- `denoise_step` / `sample_actions`: flow-matching velocity of the action expert over a read-only prefix;
- `extend`: append text tokens (a question, or one generated token per row) after a prefix.

A prefix holds only valid tokens: an absent camera or prompt padding is never computed or stored. The
reference pads instead, but a masked token can never influence a valid one, so the valid outputs are the
same (positions = cumsum(valid) - 1 is exactly the index in the compacted sequence).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from oxygen_ros.kernels import ops as kernel_ops

from . import rtc
from .attention import ActionAttention, CachedAttention
from .config import Pi05Config
from .gemma import AdaRMSNorm, GemmaLayer, RMSNorm, rope_cos_sin
from .siglip import SiglipVision


# Parameters that stay float32 when the model serves in bfloat16 (openpi's PyTorch policy: the patch and
# position embeddings, every RMSNorm including the adaRMS modulation layers and the final norms, and the
# action in/out projections and time MLP, which openpi never converts). Their inputs are cast up and their
# outputs back down to the stream's dtype where they meet bfloat16 layers; norms compute in float32 anyway.
FLOAT32_ISLANDS = re.compile(
    r"^(vision\.patch_embedding\.|vision\.position_embedding$|"
    r"(vlm|expert)_layers\.\d+\.(input_norm|post_attention_norm)\.|(vlm|expert)_norm\.|"
    r"action_in_proj\.|action_out_proj\.|time_mlp_(in|out)\.)")


def param_dtype(name: str, dtype: torch.dtype, islands: bool = True) -> torch.dtype:
    """The dtype parameter `name` is served in when the model's dtype is `dtype`."""
    return torch.float32 if islands and FLOAT32_ISLANDS.match(name) else dtype


@dataclass
class PrefixRow:
    """One observation's prefix input: the valid cameras' images (slot order) and the prompt tokens."""

    images: torch.Tensor   # [n_cameras, 3, H, W] float in [-1, 1], already resized to the model's size
    tokens: torch.Tensor   # [n_tokens] int64, BOS first, no padding


def openpi_times(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """openpi's float32 arithmetic: dt = float32(-1/steps), t = 1 then t += dt while t >= -dt/2."""
    dt = torch.tensor(-1.0 / steps, dtype=torch.float32)
    t, times = torch.tensor(1.0, dtype=torch.float32), []
    while t >= -dt / 2:
        times.append(t)
        t = t + dt
    return torch.stack(times), dt


def lerobot_times(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LeRobot 0.6.1's euler_integrate: dt = -1/steps and t = 1.0 + k*dt in float64, each t rounded to float32
    once (no accumulated rounding), exactly `steps` steps; x += dt * v with dt as float32, as torch does."""
    dt = -1.0 / steps
    return (torch.tensor([1.0 + k * dt for k in range(steps)], dtype=torch.float32),
            torch.tensor(dt, dtype=torch.float32))


# The flow-time grid of a checkpoint format: the times at which the velocity is evaluated. They differ by a
# few float32 ulps (openpi's accumulates the rounding of t += dt), which moves final actions by ~1e-5 of
# their magnitude (6e-5 to 3.3e-4 for actions of magnitude 4-20): a checkpoint is denoised on its own grid.
TIME_GRIDS = {"openpi": openpi_times, "lerobot": lerobot_times}


class Pi05(nn.Module):
    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.cfg = cfg
        self.vision = SiglipVision(cfg.vision)
        self.projector = nn.Linear(cfg.vision.width, cfg.vlm.width)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.vlm.width)  # also the LM head (tied)...
        # ...unless a checkpoint's head was fine-tuned apart from the embedding (LeRobot): then this holds it.
        self.register_buffer("lm_head", None, persistent=False)
        self.vlm_layers = nn.ModuleList(GemmaLayer(cfg.vlm, adaptive=False) for _ in range(cfg.vlm.depth))
        self.vlm_norm = RMSNorm(cfg.vlm.width, cfg.vlm.rms_eps)
        we = cfg.expert.width
        self.expert_layers = nn.ModuleList(GemmaLayer(cfg.expert, adaptive=True) for _ in range(cfg.expert.depth))
        self.expert_norm = AdaRMSNorm(we, cfg.expert.rms_eps)
        self.action_in_proj = nn.Linear(cfg.action_dim, we)
        self.action_out_proj = nn.Linear(we, cfg.action_dim)
        self.time_mlp_in = nn.Linear(we, we)
        self.time_mlp_out = nn.Linear(we, we)
        # Which implementation of the norms/activation the layers use: "torch" or "triton" (CUDA).
        # Attention objects carry their own backend (chosen with the cache, see attention.py).
        self.backend = "torch"
        self._schedules: dict = {}
        # Where the flow times of denoising lie (TIME_GRIDS): a property of the checkpoint's format, set by
        # the loader (model/checkpoint.py): openpi's float32 `t += dt`, or LeRobot's `t = 1.0 + k*dt`.
        self.time_grid = "openpi"

    def to_serving_dtype(self, dtype: torch.dtype, islands: bool = True) -> "Pi05":
        """Every parameter in `dtype`, except the float32 islands (see FLOAT32_ISLANDS) when `islands`."""
        for name, p in self.named_parameters():
            p.data = p.data.to(param_dtype(name, dtype, islands))
        return self

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    # ------------------------------------------------------------------ prefix
    def prefix_bidir(self, row: PrefixRow) -> int:
        """How many leading prefix tokens attend to each other bidirectionally (see kernels/ops.py)."""
        n_image = row.images.shape[0] * self.cfg.image_tokens
        if self.cfg.prefix_language_attention == "bidirectional":
            return n_image + row.tokens.numel()
        return n_image  # OxyGen: images bidirectional, language causal

    def prefix_length(self, row: PrefixRow) -> int:
        return row.images.shape[0] * self.cfg.image_tokens + row.tokens.numel()

    def embed_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens) * math.sqrt(self.cfg.vlm.width)

    def embed_prefix(self, rows: list[PrefixRow]) -> torch.Tensor:
        """Packed prefix embeddings [sum of prefix lengths, width]: per row, its images' tokens then its
        prompt's. All rows' images go through SigLIP together. Image tokens are not scaled."""
        images = [r.images for r in rows if r.images.shape[0]]
        if images:
            feats = self.projector(self.vision(torch.cat(images).to(self.device)))
            feats = feats.reshape(-1, self.cfg.image_tokens, feats.shape[-1]).to(self.dtype)
        parts, cam = [], 0
        for r in rows:
            n = r.images.shape[0]
            if n:
                parts.append(feats[cam:cam + n].reshape(-1, feats.shape[-1]))
                cam += n
            parts.append(self.embed_text(r.tokens.to(self.device)))
        return torch.cat(parts)

    def prefill(self, rows: list[PrefixRow], attn: CachedAttention) -> torch.Tensor:
        """Run the VLM over the rows' prefixes, storing K/V through `attn`; returns the final-norm hidden
        state of each row's last prefix token [R, width] (its logits predict the first text token)."""
        return self._vlm(self.embed_prefix(rows), attn)

    def extend(self, tokens: torch.Tensor, attn: CachedAttention) -> torch.Tensor:
        """Append packed text tokens [T] (rows per `attn`); returns each row's last hidden state [R, width]."""
        return self._vlm(self.embed_text(tokens.to(self.device)), attn)

    def _vlm(self, x: torch.Tensor, attn: CachedAttention) -> torch.Tensor:
        c = self.cfg.vlm
        cos, sin = rope_cos_sin(attn.positions, c.head_dim, c.rope_theta, x.dtype)
        for i, layer in enumerate(self.vlm_layers):
            x = layer(x, cos, sin, attn.layer(i), backend=self.backend)
        # Only the last token of each row is ever read, so only it goes through the final norm.
        return kernel_ops.rms_norm(x[attn.last_token], self.vlm_norm.weight, self.cfg.vlm.rms_eps, self.backend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head (the tied embedding, or a separate head): [R, width] -> [R, vocab] float32."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens.weight
        return F.linear(hidden, head).float()

    # ------------------------------------------------------------------ actions
    def time_condition(self, t: torch.Tensor) -> torch.Tensor:
        """adaRMS condition [R, expert width] from flow-matching times t [R] (float32), in the time MLP's dtype."""
        we = self.cfg.expert.width
        fraction = torch.linspace(0.0, 1.0, we // 2, dtype=torch.float64, device=t.device)
        period = self.cfg.time_min_period * (self.cfg.time_max_period / self.cfg.time_min_period) ** fraction
        arg = (1.0 / period * 2 * math.pi)[None, :] * t[:, None]
        emb = torch.cat([torch.sin(arg), torch.cos(arg)], dim=1).to(t.dtype).to(self.time_mlp_in.weight.dtype)
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb))))

    def denoise_step(self, x_t: torch.Tensor, t: torch.Tensor, attn: ActionAttention,
                     backend: str | None = None) -> torch.Tensor:
        """Velocity v [R, H, action_dim] (float32) of noisy actions x_t [R, H, action_dim] at times t [R], or
        t [R, H]: a time per action token (prefix conditioning: given rows are clean, at t = 0).
        `backend`: the norms' and activation's implementation (default: the model's); RTC passes "torch",
        whose operations autograd can differentiate."""
        c = self.cfg.expert
        backend = backend or self.backend
        rows, horizon, _ = x_t.shape
        if t.ndim == 2:     # a condition per distinct time (two: the given rows' 0 and the step's), gathered per token
            times, token_rows = torch.unique(t.reshape(-1), return_inverse=True)
            cond = self.time_condition(times)
        else:
            cond, token_rows = self.time_condition(t), attn.token_rows
        x = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype)).to(self.dtype)
        x = x.reshape(rows * horizon, c.width)
        cos, sin = rope_cos_sin(attn.positions, c.head_dim, c.rope_theta, x.dtype)
        for i, layer in enumerate(self.expert_layers):
            x = layer(x, cos, sin, attn.layer(i), cond=cond, token_rows=token_rows, backend=backend)
        scale, shift, _ = self.expert_norm.modulation(cond, token_rows, x.dtype)  # its gate is unused
        x = kernel_ops.ada_rms_norm(x, scale, shift, c.rms_eps, backend)
        return self.action_out_proj(x.float().to(self.action_out_proj.weight.dtype)).float().reshape(
            rows, horizon, -1)

    def flow_schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(times [n] float32, dt) on the model's device for `steps` Euler steps from t = 1 to t = 0 on the
        model's time grid (`time_grid`, TIME_GRIDS). Cached: a captured CUDA graph must not copy from the
        host, and the schedule is the same for every frame."""
        key = (steps, self.device, self.time_grid)
        if key not in self._schedules:
            times, dt = TIME_GRIDS[self.time_grid](steps)
            self._schedules[key] = (times.to(self.device), dt.to(self.device))
        return self._schedules[key]

    def sample_actions(self, noise: torch.Tensor, attn: ActionAttention, steps: int | None = None,
                       record: list | None = None, guidance: rtc.Guidance | None = None) -> torch.Tensor:
        """Euler integration of the flow from noise (t = 1) to actions (t = 0), in `steps` steps.

        guidance: real-time chunking for every row (model/rtc.py). Correction "prefix": the rows with
        weight 1 are given, clean, at every step (`_sample_conditioned`; a model trained for it). Otherwise each
        step's velocity is the guided one; its "vjp" correction is a vector-Jacobian product through the
        expert: autograd must be available (not in inference mode) and `attn` must be the torch attention (the
        Triton kernels have no backward); the norms run on the torch path too. Without guidance the loop is
        unchanged (and captured as one CUDA graph)."""
        times, dt = self.flow_schedule(steps or self.cfg.num_denoise_steps)
        x = noise.float().to(self.device)
        if guidance is not None and guidance.correction == "prefix":
            return self._sample_conditioned(x, attn, times, dt, guidance, record)
        if guidance is not None:
            return self._sample_guided(x, attn, times, dt, guidance, record)
        for i in range(times.shape[0]):
            v = self.denoise_step(x, times[i].expand(x.shape[0]), attn)
            if record is not None:
                record.append((float(times[i]), x.clone(), v.clone()))
            x = x + dt * v
        return x

    def _sample_conditioned(self, x: torch.Tensor, attn: ActionAttention, times: torch.Tensor, dt: torch.Tensor,
                            guidance: rtc.Guidance, record: list | None) -> torch.Tensor:
        """Prefix conditioning (training-time RTC, Black et al. 2025; `prefix_conditioning` in the config):
        the rows with weight 1 are the playing chunk's, given clean at flow time 0 at every step,
        and the model, trained so, denoises the other rows to continue them. No guidance term, no gradient.
        The given rows come back as given (they play from the previous chunk anyway)."""
        if not self.cfg.prefix_conditioning:
            raise ValueError("RTC correction 'prefix' needs a model trained with prefix conditioning "
                             "(config.json \"prefix_conditioning\": true); this one was not")
        if guidance.target.shape != x.shape or guidance.weights.shape != x.shape[:2]:
            raise ValueError(f"RTC prefix of {list(guidance.target.shape)} rows and "
                             f"{list(guidance.weights.shape)} weights, the noise is {list(x.shape)}")
        if not ((guidance.weights == 0) | (guidance.weights == 1)).all():
            raise ValueError("RTC prefix rows are given whole: their weights must be 0 or 1 (schedule zeros)")
        given = (guidance.weights > 0).to(self.device)
        target = guidance.target.to(self.device, torch.float32)
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        for i in range(times.shape[0]):
            x = torch.where(given[..., None], target, x)
            v = self.denoise_step(x, torch.where(given, zero, times[i]), attn)
            if record is not None:
                record.append((float(times[i]), x.clone(), v.clone()))
            x = x + dt * v
        return torch.where(given[..., None], target, x)

    def _sample_guided(self, x: torch.Tensor, attn: ActionAttention, times: torch.Tensor, dt: torch.Tensor,
                       guidance: rtc.Guidance, record: list | None) -> torch.Tensor:
        if attn.backend != "torch":
            raise ValueError(f"RTC guidance differentiates through the attention: it needs the torch attention, "
                             f"got {attn.backend!r} (the Triton kernels have no backward)")
        if guidance.target.shape != x.shape or guidance.weights.shape != x.shape[:2]:
            raise ValueError(f"RTC guidance for {list(guidance.target.shape)} targets and "
                             f"{list(guidance.weights.shape)} weights, the noise is {list(x.shape)}")
        guidance = guidance.to(self.device)
        x, dt = x.clone(), float(dt)        # copies made here, not in inference mode: autograd may save them
        for t in times.tolist():            # the same float32 times as the plain loop, as Python floats
            t_rows = torch.full((x.shape[0],), t, dtype=torch.float32, device=self.device)
            v = rtc.guided_velocity(lambda z: self.denoise_step(z, t_rows, attn, backend="torch"), x, t,
                                    guidance.target, guidance.weights, guidance.max_weight, guidance.correction)
            if record is not None:
                record.append((t, x.clone(), v.clone()))
            x = x + dt * v
        return x
