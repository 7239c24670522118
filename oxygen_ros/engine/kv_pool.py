"""The KV pool: preallocated paged K/V storage, a reference-counted block allocator, and frame handles.

`BlockAllocator` knows nothing about models: it hands out block ids and counts references. `KVPool` pairs
it with the storage tensors (`PagedKV`) sized from a memory budget. A `FrameCache` is the handle to one
camera frame's prefix: the action task and every language request of that frame hold a reference to the
same blocks (no copy); the blocks return to the pool when the last reference is dropped.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from oxygen_ros.model.attention import PagedKV, Segment


class PoolExhausted(RuntimeError):
    """Not enough free blocks. Callers treat it as back-pressure (queue or refuse), never as a crash."""


class BlockAllocator:
    """Block ids 0..num_blocks-1 with reference counts. Allocation prefers a run of consecutive ids (the
    CPU attention path then reads a zero-copy slice of the pool)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("a pool needs at least one block")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free = set(range(num_blocks))
        self._lock = threading.Lock()
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> tuple[int, ...]:
        """n fresh blocks with one reference each."""
        with self._lock:
            if n > len(self._free):
                raise PoolExhausted(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
            blocks = self._consecutive_run(n) or sorted(self._free)[:n]
            for b in blocks:
                self._free.remove(b)
                self._refs[b] = 1
            self.peak_used = max(self.peak_used, self.num_blocks - len(self._free))
            return tuple(blocks)

    def _consecutive_run(self, n: int) -> list[int] | None:
        run: list[int] = []
        for b in sorted(self._free):
            run = run + [b] if run and b == run[-1] + 1 else [b]
            if len(run) == n:
                return run
        return None

    def incref(self, blocks) -> None:
        with self._lock:
            for b in blocks:
                if self._refs[b] <= 0:
                    raise RuntimeError(f"incref of free block {b}")
                self._refs[b] += 1

    def decref(self, blocks) -> None:
        with self._lock:
            for b in blocks:
                if self._refs[b] <= 0:
                    raise RuntimeError(f"decref of free block {b}")
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    self._free.add(b)


class KVPool:
    """Paged storage for the VLM's K/V of every layer plus its allocator.

    The storage has one block more than the allocator hands out: `scratch_block`, never allocated, where the
    padding rows of fixed-shape (CUDA-graph) decode steps write and read, so they never touch a real block."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.kv = PagedKV(layers, num_blocks + 1, block_size, kv_heads, head_dim, dtype, device)
        self.allocator = BlockAllocator(num_blocks)
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
        return -(-tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def occupancy(self) -> float:
        return self.allocator.num_used / self.allocator.num_blocks


@dataclass(eq=False)
class FrameCache:
    """Handle to one frame's prefix K/V. Created holding one reference (the creator's); `retain` adds one
    per holder, `release` drops one; the blocks are freed with the last reference."""

    pool: KVPool
    segment: Segment
    frame_index: int
    stamp: float
    last_hidden: torch.Tensor          # [width] final-norm hidden state of the last prefix token
    _holders: int = field(default=1, repr=False)

    def retain(self) -> "FrameCache":
        if self._holders <= 0:
            raise RuntimeError(f"frame {self.frame_index} was already released")
        self.pool.allocator.incref(self.segment.blocks)
        self._holders += 1
        return self

    def release(self) -> None:
        if self._holders <= 0:
            raise RuntimeError(f"frame {self.frame_index} released more often than retained")
        self._holders -= 1
        self.pool.allocator.decref(self.segment.blocks)
