"""Gemma decoder pieces shared by the VLM (PaliGemma's Gemma 2B) and the action expert (Gemma 300M).

Tokens are packed: hidden states are [T, width] for T tokens of any number of rows; attention is the only
operation that needs to know which row a token belongs to, and it is delegated to a callable so the
cache layout (paged pool) and the kernel (torch or Triton) stay out of the model.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from oxygen_ros.kernels import ops as kernel_ops

from .config import GemmaConfig

# attend(q [T, heads, hd], k [T, kv_heads, hd], v [T, kv_heads, hd]) -> [T, heads, hd], for one layer.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """Gemma RMSNorm: the weight is stored as an offset from 1 (y = x / rms(x) * (1 + w))."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))


class AdaRMSNorm(nn.Module):
    """π0.5's adaptive RMSNorm: scale, shift and a residual gate computed from the flow-matching time
    (y = x / rms(x) * (1 + scale) + shift; the gate multiplies the branch added to the residual)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(width, 3 * width)

    def modulation(self, cond: torch.Tensor, token_rows: torch.Tensor, dtype: torch.dtype):
        """(scale, shift, gate), each [T, width]: computed once per row (in the dense layer's dtype: a float32
        island in bfloat16 serving), then given to the row's tokens. scale and shift stay in that dtype (the
        norm computes in float32); the gate multiplies the residual branch, so it comes in `dtype`."""
        modulation = self.dense(cond.to(self.dense.weight.dtype))
        scale, shift, gate = (part[token_rows] for part in modulation.chunk(3, dim=-1))
        return scale, shift, gate.to(dtype)


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
                cond: torch.Tensor | None = None, token_rows: torch.Tensor | None = None,
                backend: str = "torch") -> torch.Tensor:
        """x [T, width]. Expert only: cond [R, width] is the time condition of each row and token_rows [T]
        the row of each token."""
        cfg, eps = self.cfg, self.cfg.rms_eps
        if self.adaptive:
            scale, shift, gate_attn = self.input_norm.modulation(cond, token_rows, x.dtype)
            post_scale, post_shift, gate_mlp = self.post_attention_norm.modulation(cond, token_rows, x.dtype)
            h = kernel_ops.ada_rms_norm(x, scale, shift, eps, backend)
        else:
            gate_attn = gate_mlp = None
            h = kernel_ops.rms_norm(x, self.input_norm.weight, eps, backend)
        t = x.shape[0]
        q = apply_rope(self.q_proj(h).view(t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(self.k_proj(h).view(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = self.v_proj(h).view(t, cfg.num_kv_heads, cfg.head_dim)
        a = self.o_proj(attend(q, k, v).reshape(t, cfg.num_heads * cfg.head_dim))
        # Residual add fused with the next norm: x + a (* gate), then its (ada)RMSNorm.
        if self.adaptive:
            x, h = kernel_ops.residual_ada_rms_norm(x, a, gate_attn, post_scale, post_shift, eps, backend)
        else:
            x, h = kernel_ops.residual_rms_norm(x, a, self.post_attention_norm.weight, eps, backend)
        m = self.down_proj(kernel_ops.gelu_tanh_mul(self.gate_proj(h), self.up_proj(h), backend))
        return x + m if gate_mlp is None else x + m * gate_mlp
