"""The one attention interface of the model: attention over K/V kept in a paged pool.

The model never sees a cache layout. It hands each layer's q/k/v to an `Attention` object built for the
forward pass; that object knows, per row of packed tokens, which pool blocks hold the context:

- a *prefix* segment: a frame's prefix K/V, read-only and shared (the action chunk and every language
  request of that frame point at the same blocks);
- an *own* segment: blocks the row writes to (the frame's blocks during its prefill, a request's
  question/reply blocks during decode). New tokens are stored there, then attended to causally, except
  the first `bidir` new tokens of the row, which see each other (the image block, or the whole prefix in
  upstream openpi mode).

The action expert's tokens are not cached: `ActionAttention` attends from them to their frame's prefix
segment plus their own dense K/V, all mutually visible.

The maths lives in `oxygen_ros.kernels` (torch for the CPU, Triton on CUDA); this file only builds the
per-forward metadata and picks the implementation.
"""
from __future__ import annotations

import torch

from oxygen_ros.kernels import ops as kernel_ops
from oxygen_ros.kernels.meta import CachedRow, Segment  # noqa: F401 - the model's names for them


class PagedKV:
    """Paged K/V storage for every VLM layer: k, v [layers, num_blocks, block_size, kv_heads, head_dim].

    Plain tensors: allocation (which blocks belong to whom) is the engine's business (`KVPool`)."""

    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()


class CachedAttention:
    """One forward over packed new tokens that are stored into the pool (a prefill or a decode step)."""

    def __init__(self, kv: PagedKV, rows: list[CachedRow], backend: str, device: torch.device | str):
        bs = kv.block_size
        for r in rows:
            if r.n_new < 1 or r.own_before < 0 or len(r.own.blocks) * bs < r.own.length:
                raise ValueError(f"inconsistent cached row {r}")
            if r.prefix is not None and len(r.prefix.blocks) * bs < r.prefix.length:
                raise ValueError(f"inconsistent prefix segment {r.prefix}")
        self.kv, self.rows, self.backend = kv, rows, backend
        self.meta = kernel_ops.CachedMeta.build(rows, bs, device, with_tensors=backend == "triton")
        # RoPE position of each new token: after the prefix and the row's earlier own tokens.
        self.positions = torch.tensor(
            [(r.prefix.length if r.prefix else 0) + r.own_before + i for r in rows for i in range(r.n_new)],
            dtype=torch.long, device=device)
        self.last_token = torch.tensor(self.meta.cu[1:], dtype=torch.long, device=device) - 1

    @classmethod
    def fixed(cls, kv: PagedKV, meta, positions: torch.Tensor, last_token: torch.Tensor, backend: str):
        """Over metadata held in fixed buffers that the caller refills between calls (CUDA graphs,
        oxygen_ros/engine/graphs.py); `rows` is then unknown (None)."""
        self = cls.__new__(cls)
        self.kv, self.rows, self.backend, self.meta = kv, None, backend, meta
        self.positions, self.last_token = positions, last_token
        return self

    def layer(self, layer: int):
        def attend(q, k, v):
            return kernel_ops.cached_attention(q, k, v, self.kv.k[layer], self.kv.v[layer], self.meta,
                                               self.backend)
        return attend


class ActionAttention:
    """One expert forward: `horizon` action tokens per row over the row's frame prefix."""

    def __init__(self, kv: PagedKV, prefixes: list[Segment], horizon: int, backend: str,
                 device: torch.device | str):
        self.kv, self.backend = kv, backend
        self.meta = kernel_ops.ActionMeta.build(prefixes, kv.block_size, device, with_tensors=backend == "triton")
        self.positions = torch.cat([torch.arange(p.length, p.length + horizon) for p in prefixes]).to(device)
        self.token_rows = torch.arange(len(prefixes), device=device).repeat_interleave(horizon)

    @classmethod
    def fixed(cls, kv: PagedKV, meta, positions: torch.Tensor, token_rows: torch.Tensor, backend: str):
        """Over metadata held in fixed buffers (see CachedAttention.fixed)."""
        self = cls.__new__(cls)
        self.kv, self.backend, self.meta = kv, backend, meta
        self.positions, self.token_rows = positions, token_rows
        return self

    def layer(self, layer: int):
        def attend(q, k, v):
            return kernel_ops.action_attention(q, k, v, self.kv.k[layer], self.kv.v[layer], self.meta,
                                               self.backend)
        return attend


def default_backend(device: torch.device | str) -> str:
    """Triton on CUDA, torch elsewhere; OXYGEN_ATTENTION=torch|triton overrides (see kernels/ops.py)."""
    return kernel_ops.default_backend(torch.device(device))
