"""Attention objects for training: the same interface as oxygen_ros/model/attention.py (`positions`,
`last_token`, `token_rows`, `layer(i)`), but over dense padded rows with autograd, so the model code that
serves is the code that trains (the model never sees a cache layout either way).

A batch of B rows is packed as the model expects ([T, width], row after row); attention unpacks it into
[B, L] with a boolean mask (same row, key valid, and key < bidir or key <= query), i.e. the π0.5 prefix
rule of kernels/ops.py. The VLM forward keeps each layer's prefix K/V so that the action expert, run
next, attends to it exactly as it attends to the pool's prefix blocks when serving.

Forks (the joint hierarchical format): a row may end with causal branches that each continue the row's
bidirectional part on their own, as the engine decodes every text request from the end of a frame's prompt
(a subtask, a memory, a question): a fork's tokens see the first `bidir` tokens and the fork's own earlier
tokens, never the row's causal trunk (the subtask span the actions read) or another fork, and its positions
start at `bidir`, where the engine's extension of the frame starts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class TrainPrefixAttention:
    """One VLM forward over B rows: row b has `lengths[b]` tokens, the first `bidir[b]` mutually visible,
    the rest causal; the action expert will read its first `prefix[b]` tokens (images + prompt).
    `read`: the packed indices whose final hidden states the forward returns (the LM loss positions)."""

    def __init__(self, lengths: list[int], bidir: list[int], prefix: list[int], read: torch.Tensor,
                 forks: list[list[int]] | None = None, tail: list[int] | None = None):
        """`forks[b]`: the lengths of row b's forks, which end the row (after its trunk); see the module.
        `tail[b]`: the last tail[b] tokens the actions read see each other (pi052's joint [EOS, "\\n"])."""
        forks = forks or [[] for _ in lengths]
        tail = tail or [0 for _ in lengths]
        self.lengths, self.bidir, self.prefix, self.forks = lengths, bidir, prefix, forks
        b, l_max = len(lengths), max(lengths)
        self.pack = torch.cat([torch.arange(n) + i * l_max for i, n in enumerate(lengths)])
        segment = torch.zeros(b, l_max, dtype=torch.long)       # 0: the trunk, k: the row's fork k
        positions = []
        for r, (n, d, row_forks) in enumerate(zip(lengths, bidir, forks)):
            trunk = n - sum(row_forks)
            if trunk < d or trunk < prefix[r]:
                raise ValueError(f"row {r}: forks of {row_forks} tokens leave a trunk of {trunk}, shorter than "
                                 f"its bidirectional part ({d}) or what the actions read ({prefix[r]})")
            parts, start = [torch.arange(trunk)], trunk
            for k, f in enumerate(row_forks, 1):
                parts.append(torch.arange(d, d + f))
                segment[r, start:start + f] = k
                start += f
            positions.append(torch.cat(parts))
        self.positions = torch.cat(positions)
        self.last_token = read
        i = torch.arange(l_max)[:, None]
        j = torch.arange(l_max)[None, :]
        n = torch.tensor(lengths)[:, None, None]
        d = torch.tensor(bidir)[:, None, None]
        same = segment[:, :, None] == segment[:, None, :]                 # [B, L(query), L(key)]
        lo = torch.tensor([p - t for p, t in zip(prefix, tail)])[:, None, None]
        hi = torch.tensor(prefix)[:, None, None]
        in_tail = ((i >= lo) & (i < hi)) & ((j >= lo) & (j < hi))
        self.mask = ((j < n) & ((j < d) | ((j <= i) & same) | in_tail))[:, None]    # [B, 1, L, L]
        self.mask |= torch.eye(l_max, dtype=torch.bool)                # padding queries see themselves
        self.b, self.l_max = b, l_max
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # layer -> padded [B, kvh, L, hd]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, h, hd] packed -> [B, h, L, hd]."""
        out = x.new_zeros(self.b * self.l_max, *x.shape[1:]).index_copy(0, self.pack, x)
        return out.view(self.b, self.l_max, *x.shape[1:]).transpose(1, 2)

    def layer(self, layer: int):
        def attend(q, k, v):
            kp, vp = self.pad(k), self.pad(v)
            self.kv[layer] = (kp, vp)
            out = F.scaled_dot_product_attention(self.pad(q), kp, vp, attn_mask=self.mask, enable_gqa=True)
            return out.transpose(1, 2).reshape(self.b * self.l_max, *q.shape[1:])[self.pack]
        return attend


class TrainActionAttention:
    """One expert forward: `horizon` action tokens per row over the row's prefix K/V (from the VLM forward
    just run) and each other."""

    def __init__(self, vlm: TrainPrefixAttention, horizon: int):
        self.vlm, self.horizon = vlm, horizon
        b = vlm.b
        self.positions = torch.cat([torch.arange(p, p + horizon) for p in vlm.prefix])
        self.token_rows = torch.arange(b).repeat_interleave(horizon)
        j = torch.arange(vlm.l_max)[None, :]
        prefix_mask = j < torch.tensor(vlm.prefix)[:, None]                               # [B, L]
        self.mask = torch.cat([prefix_mask, torch.ones(b, horizon, dtype=torch.bool)], 1)[:, None, None]

    def layer(self, layer: int):
        def attend(q, k, v):
            b, h = self.vlm.b, self.horizon
            kp, vp = self.vlm.kv[layer]
            split = lambda x: x.view(b, h, *x.shape[1:]).transpose(1, 2)  # noqa: E731
            keys = torch.cat([kp, split(k)], dim=2)
            values = torch.cat([vp, split(v)], dim=2)
            out = F.scaled_dot_product_attention(split(q), keys, values, attn_mask=self.mask, enable_gqa=True)
            return out.transpose(1, 2).reshape(b * h, *q.shape[1:])
        return attend
