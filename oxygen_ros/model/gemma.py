"""Gemma decoder pieces shared by the VLM (PaliGemma's Gemma 2B) and the action expert (Gemma 300M).

Tokens are packed: hidden states are [T, width] for T tokens of any number of rows; attention is the only
operation that needs to know which row a token belongs to, and it is delegated to a callable so the
cache layout (paged pool) and the kernel (torch or Triton) stay out of the model.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import GemmaConfig

# attend(q [T, heads, hd], k [T, kv_heads, hd], v [T, kv_heads, hd]) -> [T, heads, hd], for one layer.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in float32 whatever the storage dtype (as the reference does for bf16).
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Gemma RMSNorm: the weight is stored as an offset from 1."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class AdaRMSNorm(nn.Module):
    """π0.5's adaptive RMSNorm: scale, shift and a residual gate computed from the flow-matching time."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(width, 3 * width)

    def modulation(self, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dense(cond).chunk(3, dim=-1)  # scale, shift, gate

    def forward(self, x: torch.Tensor, mod: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        scale, shift, gate = mod
        y = rms_norm(x, self.eps) * (1.0 + scale.float()) + shift.float()
        return y.to(x.dtype), gate.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [T, head_dim] for integer positions [T] (HF Gemma convention, float32 math)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                               / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; rotate_half pairs dimension i with i + hd/2."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class GemmaLayer(nn.Module):
    """One decoder layer. With `adaptive=True` (the action expert) both norms are adaRMS and the
    residuals are gated; otherwise plain Gemma (RMSNorm, plain residuals)."""

    def __init__(self, cfg: GemmaConfig, adaptive: bool):
        super().__init__()
        self.cfg = cfg
        self.adaptive = adaptive
        w, hd = cfg.width, cfg.head_dim
        norm = (lambda: AdaRMSNorm(w, cfg.rms_eps)) if adaptive else (lambda: RMSNorm(w, cfg.rms_eps))
        self.input_norm = norm()
        self.post_attention_norm = norm()
        self.q_proj = nn.Linear(w, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(w, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(w, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, w, bias=False)
        self.gate_proj = nn.Linear(w, cfg.mlp_dim, bias=False)
        self.up_proj = nn.Linear(w, cfg.mlp_dim, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_dim, w, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                cond: torch.Tensor | None = None, token_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, width]. Expert only: cond [R, width] is the time condition of each row and token_rows [T]
        the row of each token; the modulation is computed once per row, then spread over its tokens."""
        cfg = self.cfg
        if self.adaptive:
            h, gate = self.input_norm(x, self._modulation(self.input_norm, cond, token_rows))
        else:
            h, gate = self.input_norm(x), None
        t = x.shape[0]
        q = apply_rope(self.q_proj(h).view(t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(self.k_proj(h).view(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = self.v_proj(h).view(t, cfg.num_kv_heads, cfg.head_dim)
        a = self.o_proj(attend(q, k, v).reshape(t, cfg.num_heads * cfg.head_dim))
        x = x + a if gate is None else x + a * gate

        if self.adaptive:
            h, gate = self.post_attention_norm(x, self._modulation(self.post_attention_norm, cond, token_rows))
        else:
            h, gate = self.post_attention_norm(x), None
        m = self.down_proj(F.gelu(self.gate_proj(h), approximate="tanh") * self.up_proj(h))
        return x + m if gate is None else x + m * gate

    @staticmethod
    def _modulation(norm: AdaRMSNorm, cond: torch.Tensor, token_rows: torch.Tensor):
        return tuple(part[token_rows] for part in norm.modulation(cond))
