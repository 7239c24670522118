"""Attention over the paged KV pool: metadata, the torch implementation (CPU path and reference of the
Triton kernels) and the dispatch to Triton.

Visibility rule, shared by every implementation. A batch packs the new tokens of R rows: row r owns
q[cu[r]:cu[r+1]] (n_new tokens). Its context is
- a prefix segment (prefix_len tokens in pool blocks `prefix_table`): visible to all its new tokens;
- an own segment (own_len tokens in `own_table`, the row's new tokens being the last n_new of them, written
  to the pool before attending): new token i sees own token j iff j < own_before + max(i + 1, bidir),
  with own_before = own_len - n_new. bidir = n_new makes the row fully bidirectional (upstream openpi
  prefix), bidir = image tokens gives the OxyGen prefix (images bidirectional, language causal), bidir = 0
  is plain causal decoding.
Action batches: H query tokens per row see their row's prefix segment and all H action keys (dense).
Scores are scaled by head_dim ** -0.5, softmax in float32; query head h uses kv head h // (heads/kv_heads).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .meta import ActionMeta, CachedMeta

BACKENDS = ("torch", "triton")


def default_backend(device: torch.device) -> str:
    """Triton on CUDA, torch elsewhere. OXYGEN_ATTENTION=torch|triton overrides (triton on the CPU runs
    through the interpreter, TRITON_INTERPRET=1: correct and slow, for tests)."""
    forced = os.environ.get("OXYGEN_ATTENTION", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"OXYGEN_ATTENTION must be one of {BACKENDS}, got {forced!r}")
        return forced
    return "triton" if device.type == "cuda" else "torch"


def _attend_segments(q: torch.Tensor, segments: list) -> torch.Tensor:
    """q [n, heads, hd]; segments: (k [S, kvh, hd], v [S, kvh, hd], mask [n, S] bool or None).
    One softmax across all segments, float32."""
    n, heads, hd = q.shape
    kvh = segments[0][0].shape[1]
    g = heads // kvh
    # Per KV head, the g query heads of its group and the n tokens form one [g*n, hd] matrix, so each
    # segment costs two plain 2-D matmuls (multi-query attention has a single KV head).
    qg = q.float().view(n, kvh, g, hd).permute(1, 2, 0, 3).reshape(kvh, g * n, hd)
    out = torch.empty(kvh, g * n, hd, dtype=torch.float32, device=q.device)
    for h in range(kvh):
        scores = []
        for k, _, mask in segments:
            s = qg[h] @ k[:, h].float().T                                   # [g*n, S]
            if mask is not None:
                s = s.view(g, n, -1).masked_fill(~mask, float("-inf")).view(g * n, -1)
            scores.append(s)
        p = torch.softmax(torch.cat(scores, dim=-1) * hd ** -0.5, dim=-1)
        acc, start = None, 0
        for k, v, _ in segments:
            part = p[:, start:start + k.shape[0]] @ v[:, h].float()
            acc = part if acc is None else acc + part
            start += k.shape[0]
        out[h] = acc
    return out.view(kvh, g, n, hd).permute(2, 0, 1, 3).reshape(n, heads, hd).to(q.dtype)


def torch_cached_attention(q, k, v, k_cache, v_cache, meta: CachedMeta) -> torch.Tensor:
    """Store the new k/v at their slots, then attend (see the module docstring for the rule)."""
    kvh, hd = k_cache.shape[-2:]
    kf, vf = k_cache.view(-1, kvh, hd), v_cache.view(-1, kvh, hd)
    kf[meta.write_slots] = k.to(kf.dtype)
    vf[meta.write_slots] = v.to(vf.dtype)
    prefix_kv = {key: (kf[idx], vf[idx]) for key, idx in meta.prefix_index.items()}
    out = torch.empty_like(q)
    for r in range(len(meta.n_new)):
        qr = q[meta.cu[r]:meta.cu[r + 1]]
        n, before, bidir = meta.n_new[r], meta.own_before[r], meta.bidir[r]
        own_k, own_v = kf[meta.own_index[r]], vf[meta.own_index[r]]
        if meta.prefix_key[r] is None and before == 0 and bidir >= n:
            # A whole bidirectional sequence (upstream prefill): the fused kernel, no mask.
            out[meta.cu[r]:meta.cu[r + 1]] = F.scaled_dot_product_attention(
                qr.transpose(0, 1)[None], own_k.transpose(0, 1)[None], own_v.transpose(0, 1)[None],
                enable_gqa=True)[0].transpose(0, 1)
            continue
        mask = None
        if n > 1 and bidir < n:
            i = torch.arange(n, device=q.device)[:, None]
            j = torch.arange(own_k.shape[0], device=q.device)[None, :]
            mask = j < before + torch.clamp(i + 1, min=bidir)
        segments = [(own_k, own_v, mask)]
        if meta.prefix_key[r] is not None:
            segments.insert(0, (*prefix_kv[meta.prefix_key[r]], None))
        out[meta.cu[r]:meta.cu[r + 1]] = _attend_segments(qr, segments)
    return out


def torch_action_attention(q, k, v, k_cache, v_cache, meta: ActionMeta) -> torch.Tensor:
    """q [R*H, heads, hd], k/v [R*H, kvh, hd]: each row's H tokens see its prefix and each other."""
    kvh, hd = k_cache.shape[-2:]
    kf, vf = k_cache.view(-1, kvh, hd), v_cache.view(-1, kvh, hd)
    rows = len(meta.prefix_index)
    h = q.shape[0] // rows
    out = torch.empty_like(q)
    for r, idx in enumerate(meta.prefix_index):
        sl = slice(r * h, (r + 1) * h)
        out[sl] = _attend_segments(q[sl], [(kf[idx], vf[idx], None), (k[sl], v[sl], None)])
    return out


# ---------------------------------------------------------------------------------------------- norms
# Gemma norms compute the statistics in float32 whatever the storage dtype, and return the input dtype.

def torch_rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def torch_ada_rms_norm(x, scale, shift, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + scale.float()) + shift.float()
    return y.to(x.dtype)


def rms_norm(x, weight, eps: float, backend: str):
    """y = x / rms(x) * (1 + weight)."""
    if backend == "triton":
        from . import triton_norms

        return triton_norms.rms_norm(x, weight, eps)
    return torch_rms_norm(x, weight, eps)


def ada_rms_norm(x, scale, shift, eps: float, backend: str):
    """y = x / rms(x) * (1 + scale) + shift, scale/shift per token [T, width]."""
    if backend == "triton":
        from . import triton_norms

        return triton_norms.ada_rms_norm(x, scale, shift, eps)
    return torch_ada_rms_norm(x, scale, shift, eps)


def residual_rms_norm(x, branch, weight, eps: float, backend: str):
    """(x + branch, rms_norm(x + branch)): the residual add fused with the next norm."""
    if backend == "triton":
        from . import triton_norms

        return triton_norms.residual_rms_norm(x, branch, weight, eps)
    x = x + branch
    return x, torch_rms_norm(x, weight, eps)


def residual_ada_rms_norm(x, branch, gate, scale, shift, eps: float, backend: str):
    """(x + branch * gate, ada_rms_norm(that)): π0.5's gated residual fused with the next adaRMSNorm."""
    if backend == "triton":
        from . import triton_norms

        return triton_norms.residual_ada_rms_norm(x, branch, gate, scale, shift, eps)
    x = x + branch * gate
    return x, torch_ada_rms_norm(x, scale, shift, eps)


def gelu_tanh_mul(gate, up, backend: str):
    """Gemma's gated MLP activation: gelu_tanh(gate) * up."""
    if backend == "triton":
        from . import triton_norms

        return triton_norms.gelu_tanh_mul(gate, up)
    return F.gelu(gate, approximate="tanh") * up


# ---------------------------------------------------------------------------------------------- dispatch
def cached_attention(q, k, v, k_cache, v_cache, meta: CachedMeta, backend: str) -> torch.Tensor:
    if backend == "triton":
        from . import triton_attention

        return triton_attention.cached_attention(q, k, v, k_cache, v_cache, meta)
    return torch_cached_attention(q, k, v, k_cache, v_cache, meta)


def action_attention(q, k, v, k_cache, v_cache, meta: ActionMeta, backend: str) -> torch.Tensor:
    if backend == "triton":
        from . import triton_attention

        return triton_attention.action_attention(q, k, v, k_cache, v_cache, meta)
    return torch_action_attention(q, k, v, k_cache, v_cache, meta)
