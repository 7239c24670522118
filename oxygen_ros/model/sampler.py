"""The one token sampler: greedy and temperature/top-p, vectorised over rows, NaN-safe per row.

Used by the serving engine (batched decode steps), π0.5 subtask mode and the reference generation of
`inference.greedy_generate`, so that "the same tokens" means the same function everywhere.

- greedy (temperature 0): argmax, the lowest id on ties (torch.argmax);
- temperature > 0: softmax(logits / temperature) restricted to the smallest set of tokens whose
  probability reaches top_p, then one draw per row with the row's own generator (Gumbel-style: argmax of
  probs / Exp(1) noise, gpt-fast's trick: no host sync per row, one argmax for the batch).

A row whose logits are not all finite cannot be sampled: it gets token -1 and ok False, and the other rows
are unaffected (nothing raises). Callers fail that row's request alone.
"""
from __future__ import annotations

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[R, vocab] -> [R] argmax (lowest id on ties)."""
    return torch.argmax(logits, dim=-1)


def sample(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[bool]]:
    """One token per row of logits [R, vocab] (float32). Returns (tokens, ok); ok[r] is False (token -1)
    when row r has a NaN or inf logit. Rows with temperature 0 are greedy; the others need a generator."""
    ok = torch.isfinite(logits).all(dim=-1)
    safe = torch.where(ok[:, None], logits, torch.zeros((), dtype=logits.dtype))
    tokens = greedy(safe)
    hot = [r for r, t in enumerate(temperatures) if t > 0]
    if hot:
        rows = torch.tensor(hot)
        temp = torch.tensor([temperatures[r] for r in hot], dtype=torch.float64)[:, None]
        probs = torch.softmax(safe[rows].double() / temp, dim=-1)
        top_p = torch.tensor([top_ps[r] for r in hot], dtype=torch.float64)[:, None]
        if (top_p < 1.0).any():
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            keep = (torch.cumsum(sorted_p, -1) - sorted_p < top_p) | (top_p >= 1.0)   # always keeps the top
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
        noise = torch.stack([torch.empty(probs.shape[-1], dtype=torch.float64).exponential_(generator=generators[r])
                             for r in hot])
        tokens[rows] = torch.argmax(probs / noise, dim=-1)
    out = torch.where(ok, tokens, -1)
    return out.tolist(), ok.tolist()
