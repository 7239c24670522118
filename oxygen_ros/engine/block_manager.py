"""BlockManager: the only code that hands out and takes back KV pool blocks.

Block ids 0..num_blocks-1 with reference counts: a frame's prefix blocks are shared (the action chunk and
every request of the frame hold one reference each), a request's own blocks have one holder. Free ids wait
in a FIFO: allocation and release cost O(blocks requested), whatever the pool size or its fragmentation;
a fresh pool hands out consecutive runs (the CPU attention path then reads a zero-copy slice), and blocks
released together come back together, so runs mostly survive churn.
"""
from __future__ import annotations

import collections
import threading


class PoolExhausted(RuntimeError):
    """Not enough free blocks. Callers treat it as back-pressure (queue or refuse), never as a crash."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("a pool needs at least one block")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._refs = [0] * num_blocks
        self._free = collections.deque(range(num_blocks))
        self._lock = threading.Lock()
        self.peak_used = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

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
            blocks = tuple(self._free.popleft() for _ in range(n))
            for b in blocks:
                self._refs[b] = 1
            self.peak_used = max(self.peak_used, self.num_blocks - len(self._free))
            return blocks

    def incref(self, blocks) -> None:
        with self._lock:
            for b in blocks:
                if self._refs[b] <= 0:
                    raise RuntimeError(f"incref of free block {b}")
            for b in blocks:
                self._refs[b] += 1

    def decref(self, blocks) -> None:
        with self._lock:
            for b in blocks:
                if self._refs[b] <= 0:
                    raise RuntimeError(f"decref of free block {b}")
            for b in blocks:
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    self._free.append(b)

    def reset_peak(self) -> None:
        """Start a new peak measurement from what is in use now (the benchmark, between settings)."""
        with self._lock:
            self.peak_used = self.num_used
