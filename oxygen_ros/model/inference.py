"""Standalone π0.5 inference without the engine: a contiguous cache (blocks handed out in order) and the
three operations chained the way openpi chains them. Used by the oracle tool, by the equivalence tests as
the reference each engine policy must reproduce, and by the command-line smoke run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import ActionAttention, CachedAttention, CachedRow, PagedKV, Segment, default_backend
from .pi05 import Pi05, PrefixRow
from .sampler import greedy


class ContiguousCache:
    """A PagedKV whose blocks are handed out in order and never freed: a contiguous cache."""

    def __init__(self, model: Pi05, tokens: int, block_size: int = 16):
        c = model.cfg.vlm
        self.kv = PagedKV(c.depth, -(-tokens // block_size) + 1, block_size, c.num_kv_heads, c.head_dim,
                          model.dtype, model.device)
        self.next_block = 0

    def allocate(self, tokens: int) -> tuple[int, ...]:
        n = -(-tokens // self.kv.block_size)
        if self.next_block + n > self.kv.num_blocks:
            raise RuntimeError("contiguous cache is full")
        self.next_block += n
        return tuple(range(self.next_block - n, self.next_block))


@dataclass
class Prefill:
    segments: list[Segment]   # each row's prefix in the cache
    hidden: torch.Tensor      # [R, width] final-norm hidden state of each row's last prefix token


@torch.inference_mode()
def prefill(model: Pi05, cache: ContiguousCache, rows: list[PrefixRow], backend: str | None = None) -> Prefill:
    backend = backend or default_backend(model.device)
    cached = []
    for r in rows:
        n = model.prefix_length(r)
        cached.append(CachedRow(n_new=n, own=Segment(cache.allocate(n), n), bidir=model.prefix_bidir(r)))
    hidden = model.prefill(rows, CachedAttention(cache.kv, cached, backend, model.device))
    return Prefill([r.own for r in cached], hidden)


@torch.inference_mode()
def prefill_blocks(model: Pi05, row: PrefixRow, blocks: list[tuple[list[int], int]],
                   backend: str | None = None) -> tuple[ContiguousCache, Segment]:
    """One prefix in attention blocks, on a cache of its own: `row` (images + its tokens, as `prefill`), then
    each (tokens, bidir) block extended in order: `bidir` of its last tokens see each other (0: causal). As
    one forward under the blocks' mask (pi052's joint recipe: prompt, subtask, [EOS, newline]): each block
    sees only itself and the blocks before it, so the K/V are the same. Returns the cache and the prefix."""
    backend = backend or default_backend(model.device)
    done = model.prefix_length(row)
    total = done + sum(len(tokens) for tokens, _ in blocks)
    cache = ContiguousCache(model, total)
    own = cache.allocate(total)
    model.prefill([row], CachedAttention(cache.kv, [CachedRow(done, Segment(own, done), bidir=model.prefix_bidir(row))],
                                         backend, model.device))
    for tokens, bidir in blocks:
        if tokens:
            done += len(tokens)
            model.extend(torch.tensor(tokens), CachedAttention(
                cache.kv, [CachedRow(len(tokens), Segment(own, done), bidir=bidir)], backend, model.device))
    return cache, Segment(own, total)


@torch.inference_mode()
def sample_actions(model: Pi05, cache: ContiguousCache, prefixes: list[Segment], noise: torch.Tensor,
                   steps: int | None = None, backend: str | None = None, record: list | None = None):
    backend = backend or default_backend(model.device)
    attn = ActionAttention(cache.kv, prefixes, noise.shape[1], backend, model.device)
    return model.sample_actions(noise, attn, steps, record)


@torch.inference_mode()
def greedy_generate(model: Pi05, cache: ContiguousCache, prefix: Segment, first_hidden: torch.Tensor | None,
                    question: list[int], max_new_tokens: int, eos_id: int | None = None,
                    backend: str | None = None, record_logits: list | None = None) -> list[int]:
    """Greedy text after a prefix: the question tokens (if any) are appended first; the first reply token
    comes from the last question token's logits, or from the prefix's last token (`first_hidden`) when
    there is no question. Ties go to the lowest token id (torch.argmax)."""
    backend = backend or default_backend(model.device)
    blocks = cache.allocate(len(question) + max_new_tokens)
    own_len = 0
    if question:
        own_len = len(question)
        attn = CachedAttention(cache.kv, [CachedRow(len(question), Segment(blocks, own_len), prefix)],
                               backend, model.device)
        hidden = model.extend(torch.tensor(question, dtype=torch.long), attn)
    else:
        hidden = first_hidden.reshape(1, -1)
    out = []
    for _ in range(max_new_tokens):
        logits = model.logits(hidden)
        if record_logits is not None:
            record_logits.append(logits[0].clone())
        token = int(greedy(logits)[0])
        out.append(token)
        if token == eos_id or len(out) == max_new_tokens:
            break
        own_len += 1
        attn = CachedAttention(cache.kv, [CachedRow(1, Segment(blocks, own_len), prefix)], backend, model.device)
        hidden = model.extend(torch.tensor([token], dtype=torch.long), attn)
    return out
