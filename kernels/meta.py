"""What the attention kernels read: segments of pool blocks, the rows of a batch, and the per-forward
metadata built from them (torch's slot indices, Triton's block tables). Shared by ops.py (the torch
reference and the dispatch) and triton_attention.py, so neither imports the other at module level, and by
the model (model/attention.py re-exports Segment and CachedRow), so the kernels never import the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Segment:
    """Tokens 0..length-1 of a sequence stored in pool blocks, in order (block_size tokens per block)."""

    blocks: tuple[int, ...]
    length: int


@dataclass(frozen=True)
class CachedRow:
    """One row of a cached batch: n_new tokens appended to `own` after `own_before` tokens."""

    n_new: int
    own: Segment          # blocks that hold (or will hold) own_before + n_new tokens; length = that total
    prefix: Segment | None = None
    bidir: int = 0        # the first `bidir` new tokens attend to each other bidirectionally

    @property
    def own_before(self) -> int:
        return self.own.length - self.n_new


def token_slots(blocks, block_size: int, start: int, end: int) -> list[int]:
    """Flat pool slots of tokens start..end-1 of a sequence stored in `blocks` (the one place that maps a
    token index to its slot: block blocks[j // block_size], offset j % block_size)."""
    return [blocks[j // block_size] * block_size + j % block_size for j in range(start, end)]


def _slots(blocks, block_size: int, start: int, end: int, device) -> slice | torch.Tensor:
    """Flat pool slots of tokens start..end-1 of a segment: a slice (zero-copy view) when they are
    consecutive in the pool, else an index tensor."""
    slots = token_slots(blocks, block_size, start, end)
    if slots and slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[-1] + 1)
    return torch.tensor(slots, dtype=torch.long, device=device)


def _table(segments, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max([len(s.blocks) for s in segments if s is not None] + [1])
    table = torch.zeros(len(segments), width, dtype=torch.int32)
    lens = torch.zeros(len(segments), dtype=torch.int32)
    for r, s in enumerate(segments):
        if s is not None:
            table[r, :len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
            lens[r] = s.length
    return table.to(device), lens.to(device)


@dataclass
class CachedMeta:
    """Per-forward metadata of a cached batch, built once and shared by all layers."""

    cu: list[int]
    n_new: list[int]
    own_before: list[int]
    bidir: list[int]
    write_slots: torch.Tensor                         # [T] flat pool slot of each new token
    own_index: list                                   # per row: slots of the own segment (slice or tensor)
    prefix_key: list                                  # per row: key into prefix_index, or None
    prefix_index: dict                                # segment -> its slots (shared by rows of a frame)
    max_ctx: int = 0                                  # longest context of a row (prefix + own): plans split-KV
    tensors: dict = field(default_factory=dict)       # Triton's view: tables and lengths on the device

    @classmethod
    def decode_buffers(cls, bucket: int, write_slots: torch.Tensor, prefix_table: torch.Tensor,
                       prefix_lens: torch.Tensor, own_table: torch.Tensor, own_lens: torch.Tensor,
                       max_ctx: int) -> "CachedMeta":
        """A decode step of `bucket` rows (one new token each) whose slots, tables and lengths live in
        device buffers the caller refills before every call (CUDA graphs, engine/graphs.py). Only the
        Triton kernels read metadata from tensors, so the torch path's per-row slot lists stay empty."""
        dev = write_slots.device
        return cls(cu=list(range(bucket + 1)), n_new=[1] * bucket, own_before=[0] * bucket, bidir=[0] * bucket,
                   write_slots=write_slots, own_index=[], prefix_key=[None] * bucket, prefix_index={},
                   max_ctx=max_ctx,
                   tensors=dict(cu_q=torch.arange(bucket + 1, dtype=torch.int32, device=dev),
                                prefix_table=prefix_table, prefix_lens=prefix_lens, own_table=own_table,
                                own_lens=own_lens, bidir=torch.zeros(bucket, dtype=torch.int32, device=dev),
                                max_new=1))

    @classmethod
    def build(cls, rows, block_size: int, device, with_tensors: bool = False) -> "CachedMeta":
        cu = [0]
        for r in rows:
            cu.append(cu[-1] + r.n_new)
        write = []
        for r in rows:
            write += token_slots(r.own.blocks, block_size, r.own_before, r.own.length)
        prefix_index = {}
        for r in rows:
            if r.prefix is not None and r.prefix not in prefix_index:
                prefix_index[r.prefix] = _slots(r.prefix.blocks, block_size, 0, r.prefix.length, device)
        meta = cls(
            cu=cu, n_new=[r.n_new for r in rows], own_before=[r.own_before for r in rows],
            bidir=[r.bidir for r in rows],
            write_slots=torch.tensor(write, dtype=torch.long, device=device),
            own_index=[_slots(r.own.blocks, block_size, 0, r.own.length, device) for r in rows],
            prefix_key=[r.prefix for r in rows], prefix_index=prefix_index,
            max_ctx=max((r.prefix.length if r.prefix is not None else 0) + r.own.length for r in rows))
        if with_tensors:
            prefix_table, prefix_lens = _table([r.prefix for r in rows], device)
            own_table, own_lens = _table([r.own for r in rows], device)
            meta.tensors = dict(
                cu_q=torch.tensor(cu, dtype=torch.int32, device=device),
                prefix_table=prefix_table, prefix_lens=prefix_lens, own_table=own_table, own_lens=own_lens,
                bidir=torch.tensor(meta.bidir, dtype=torch.int32, device=device),
                max_new=max(meta.n_new))
        return meta


@dataclass
class ActionMeta:
    prefix_index: list                                # per row: slots of its frame prefix
    max_prefix: int = 0                               # longest prefix of a row: plans split-KV
    tensors: dict = field(default_factory=dict)

    @classmethod
    def prefix_buffers(cls, prefix_table: torch.Tensor, prefix_lens: torch.Tensor, max_prefix: int) -> "ActionMeta":
        """One row over a prefix whose table and length live in device buffers refilled before every call
        (CUDA graphs; Triton only, see CachedMeta.decode_buffers)."""
        return cls(prefix_index=[None], max_prefix=max_prefix,
                   tensors=dict(prefix_lens=prefix_lens, prefix_table=prefix_table))

    @classmethod
    def build(cls, prefixes, block_size: int, device, with_tensors: bool = False) -> "ActionMeta":
        meta = cls(prefix_index=[_slots(p.blocks, block_size, 0, p.length, device) for p in prefixes],
                   max_prefix=max(p.length for p in prefixes))
        if with_tensors:
            table, lens = _table(prefixes, device)
            meta.tensors = dict(prefix_table=table, prefix_lens=lens)
        return meta
