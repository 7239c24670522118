"""The KV pool: preallocated paged K/V storage, its block manager, and frame handles.

`BlockManager` (block_manager.py) knows nothing about models: it hands out block ids and counts
references. `KVPool` pairs it with the storage tensors (`PagedKV`) sized from a memory budget. A
`FrameCache` is the handle to one camera frame's prefix: the action task and every language request of
that frame hold a reference to the same blocks (no copy); the blocks return to the pool when the last
reference is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oxygen_ros.model.attention import PagedKV, Segment

from .block_manager import BlockManager


class KVPool:
    """Paged storage for the VLM's K/V of every layer plus its block manager.

    The storage has one block more than the block manager hands out: `scratch_block`, never allocated, where the
    padding rows of fixed-shape (CUDA-graph) decode steps write and read, so they never touch a real block."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.kv = PagedKV(layers, num_blocks + 1, block_size, kv_heads, head_dim, dtype, device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.scratch_block = num_blocks

    @classmethod
    def from_budget(cls, budget_bytes: int, layers: int, kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype, device: torch.device | str) -> "KVPool":
        per_block = 2 * layers * block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        num_blocks = budget_bytes // per_block - 1         # the scratch block counts against the budget
        if num_blocks < 1:
            raise ValueError(f"KV budget of {budget_bytes} bytes holds less than two blocks of {per_block} bytes "
                             "(one is the scratch block)")
        return cls(layers, kv_heads, head_dim, block_size, int(num_blocks), dtype, device)

    def blocks_for(self, tokens: int) -> int:
        return self.blocks.blocks_for(tokens)

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def occupancy(self) -> float:
        return self.blocks.num_used / self.blocks.num_blocks

    def copy_block(self, src: int, dst: int) -> None:
        """Block `dst` gets `src`'s K/V in every layer (copy on write of a shared, partly filled block)."""
        self.kv.k[:, dst] = self.kv.k[:, src]
        self.kv.v[:, dst] = self.kv.v[:, src]


@dataclass(eq=False)
class FrameCache:
    """Handle to one frame's prefix K/V. Created holding one reference (the creator's); `retain` adds one
    per holder, `release` drops one; the blocks are freed with the last reference. As a context manager it
    releases the creator's reference on exit, whatever happened inside."""

    pool: KVPool
    segment: Segment
    frame_index: int
    stamp: float
    last_hidden: torch.Tensor          # [width] final-norm hidden state of the last prefix token
    _holders: int = field(default=1, repr=False)

    def retain(self) -> "FrameCache":
        if self._holders <= 0:
            raise RuntimeError(f"frame {self.frame_index} was already released")
        self.pool.blocks.incref(self.segment.blocks)
        self._holders += 1
        return self

    def __enter__(self) -> "FrameCache":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def fork(self, extra_tokens: int) -> "FrameCache":
        """A new handle over this prefix followed by room for `extra_tokens` more (a causal span the caller
        writes, e.g. pi052's joint subtask span that the actions read): the full blocks are shared (one more
        reference each), a partly filled last block is copied on write, the rest is fresh. Its segment
        already has the final length; releasing it drops every block it holds once."""
        blocks, size = self.pool.blocks, self.pool.block_size
        full, tail = divmod(self.segment.length, size)
        shared = self.segment.blocks[:full]
        fresh = blocks.allocate(blocks.blocks_for(self.segment.length + extra_tokens) - full)
        if shared:
            blocks.incref(shared)
        if tail:
            self.pool.copy_block(self.segment.blocks[full], fresh[0])
        return FrameCache(self.pool, Segment(shared + fresh, self.segment.length + extra_tokens), self.frame_index,
                          self.stamp, self.last_hidden)

    def release(self) -> None:
        if self._holders <= 0:
            raise RuntimeError(f"frame {self.frame_index} released more often than retained")
        self._holders -= 1
        self.pool.blocks.decref(self.segment.blocks)
