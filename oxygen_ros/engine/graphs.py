"""Fixed-shape steps for CUDA graphs: the engine's two hot loops replayed with one launch each.

On a GPU the 70 Hz loop is bound by launches, not arithmetic: a π0.5 decode step is 18 layers of ~12
kernels for a handful of tokens, a chunk is 10 denoise steps of 18 expert layers. A CUDA graph replays a
captured sequence of kernels with one launch, but it replays *fixed* tensors: same shapes, same addresses,
no host work in between. So each step reads everything that varies from buffers refilled before a replay:

- `DecodeStep`: one generated token for each of B rows (B a batch bucket: 1, 2, 4, ... up to the engine's
  batch cap). Tokens, positions, write slots, block tables and lengths live in two flat device buffers;
  the tables are as wide as the longest prefix and reply the engine allows. Rows past the real batch are
  padding: one token at position 0, written to and read from the pool's scratch block (never allocated),
  so they touch no real block and attend to one key (finite, discarded).
- `DenoiseLoop`: the whole flow-matching loop of one frame (fixed step count): noise in, actions out, the
  frame's prefix table and the action tokens' positions in buffers.

Only the Triton kernels read their metadata from tensors (the torch path slices Python lists per call),
so the steps need the "triton" backend. With `capture=False` (the CPU) a replay runs the same function on
the same buffers eagerly, through Triton's interpreter: that is how the tests check that the fixed-shape
steps give the tokens and actions of the dynamic path; on CUDA the same tests capture real graphs.
"""
from __future__ import annotations

import torch

from oxygen_ros.kernels.meta import ActionMeta, CachedMeta, token_slots
from oxygen_ros.model.attention import ActionAttention, CachedAttention, CachedRow, Segment
from oxygen_ros.model.pi05 import Pi05

from .kv_pool import KVPool


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below the cap, then the cap: a batch of R runs in the smallest bucket >= R."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return tuple(sizes + [max_batch])


class _Replay:
    """Runs `fn` (no arguments, reads and writes fixed buffers) as a CUDA graph, or eagerly when not
    capturing. The first call warms up (Triton compiles, launch plans and workspaces are made) on a side
    stream, then captures; later calls replay. Each graph keeps its own memory pool: the intermediates of
    a π0.5 step are a few MB, not worth the ordering rules of a shared pool."""

    def __init__(self, fn, capture: bool):
        self.fn, self.capture = fn, capture
        self.graph = None
        self.out = None

    @torch.inference_mode()
    def __call__(self):
        if not self.capture:
            return self.fn()
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work of other threads (ROS callbacks) cannot invalidate the capture
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.out = self.fn()
        self.graph.replay()
        return self.out


class DecodeStep:
    """One new token for each of `bucket` rows over the paged pool (see the module docstring)."""

    def __init__(self, model: Pi05, pool: KVPool, bucket: int, prefix_blocks: int, own_blocks: int,
                 capture: bool):
        dev, b = model.device, bucket
        self.model, self.pool, self.bucket = model, pool, bucket
        self.prefix_blocks, self.own_blocks = prefix_blocks, own_blocks
        # int64: tokens | positions | write slots; int32: prefix lens | own lens | prefix table | own table
        self.long = torch.zeros(3 * b, dtype=torch.long, device=dev)
        self.int = torch.zeros(2 * b + b * (prefix_blocks + own_blocks), dtype=torch.int32, device=dev)
        tokens, positions, slots = self.long.view(3, b)
        plens, olens = self.int[:b], self.int[b:2 * b]
        ptable = self.int[2 * b:2 * b + b * prefix_blocks].view(b, prefix_blocks)
        otable = self.int[2 * b + b * prefix_blocks:].view(b, own_blocks)
        # split-KV is planned once, for the longest context a row may have
        meta = CachedMeta.decode_buffers(b, slots, ptable, plens, otable, olens,
                                         max_ctx=(prefix_blocks + own_blocks) * pool.block_size)
        self.tokens = tokens
        self.attn = CachedAttention.fixed(pool.kv, meta, positions,
                                          torch.arange(b, dtype=torch.long, device=dev), "triton")
        self._fill([])
        self._replay = _Replay(self._forward, capture)

    def fits(self, rows: list[CachedRow]) -> bool:
        return len(rows) <= self.bucket and all(
            r.n_new == 1 and len(r.own.blocks) <= self.own_blocks
            and (r.prefix is None or len(r.prefix.blocks) <= self.prefix_blocks) for r in rows)

    def _forward(self) -> torch.Tensor:
        return self.model.logits(self.model.extend(self.tokens, self.attn))

    def _fill(self, rows: list[CachedRow], tokens: list[int] | None = None) -> None:
        b, bs, scratch = self.bucket, self.pool.block_size, self.pool.scratch_block
        longs = torch.zeros(3, b, dtype=torch.long)
        ints = torch.zeros(self.int.numel(), dtype=torch.int32)
        plens, olens = ints[:b], ints[b:2 * b]
        ptable = ints[2 * b:2 * b + b * self.prefix_blocks].view(b, self.prefix_blocks)
        otable = ints[2 * b + b * self.prefix_blocks:].view(b, self.own_blocks)
        n = len(rows)
        longs[2, n:] = scratch * bs                 # padding rows: one token in the scratch block
        olens[n:] = 1
        otable[n:, 0] = scratch
        for r, row in enumerate(rows):
            j = row.own_before                      # index of the new token in the row's own segment
            prefix_len = row.prefix.length if row.prefix is not None else 0
            longs[0, r] = tokens[r]
            longs[1, r] = prefix_len + j
            longs[2, r] = token_slots(row.own.blocks, bs, j, j + 1)[0]
            olens[r] = row.own.length
            otable[r, :len(row.own.blocks)] = torch.tensor(row.own.blocks, dtype=torch.int32)
            if row.prefix is not None:
                plens[r] = prefix_len
                ptable[r, :len(row.prefix.blocks)] = torch.tensor(row.prefix.blocks, dtype=torch.int32)
        self.long.copy_(longs.view(-1))
        self.int.copy_(ints)

    def __call__(self, rows: list[CachedRow], tokens: list[int]) -> torch.Tensor:
        """Logits [len(rows), vocab] (float32) of one decode step; the new K/V land in the rows' blocks."""
        self._fill(rows, tokens)
        return self._replay()[:len(rows)].clone()


class DenoiseLoop:
    """The flow-matching loop of one frame (`steps` Euler steps) over a prefix of <= prefix_blocks blocks."""

    def __init__(self, model: Pi05, pool: KVPool, steps: int, prefix_blocks: int, capture: bool):
        dev, cfg = model.device, model.cfg
        self.model, self.pool, self.steps, self.prefix_blocks = model, pool, steps, prefix_blocks
        self.horizon = cfg.action_horizon
        self.noise = torch.zeros(1, cfg.action_horizon, cfg.action_dim, dtype=torch.float32, device=dev)
        self.int = torch.zeros(1 + prefix_blocks, dtype=torch.int32, device=dev)   # prefix len | table
        self.positions = torch.zeros(cfg.action_horizon, dtype=torch.long, device=dev)
        meta = ActionMeta.prefix_buffers(self.int[1:].view(1, prefix_blocks), self.int[:1],
                                         max_prefix=prefix_blocks * pool.block_size)
        self.attn = ActionAttention.fixed(pool.kv, meta, self.positions,
                                          torch.zeros(cfg.action_horizon, dtype=torch.long, device=dev), "triton")
        self._fill(Segment((pool.scratch_block,), 1))
        self._replay = _Replay(self._forward, capture)

    def fits(self, prefix: Segment, horizon: int) -> bool:
        return horizon == self.horizon and len(prefix.blocks) <= self.prefix_blocks

    def _forward(self) -> torch.Tensor:
        return self.model.sample_actions(self.noise, self.attn, self.steps)

    def _fill(self, prefix: Segment) -> None:
        ints = torch.zeros(self.int.numel(), dtype=torch.int32)
        ints[0] = prefix.length
        ints[1:1 + len(prefix.blocks)] = torch.tensor(prefix.blocks, dtype=torch.int32)
        self.int.copy_(ints)
        self.positions.copy_(torch.arange(prefix.length, prefix.length + self.horizon))

    def __call__(self, prefix: Segment, noise: torch.Tensor) -> torch.Tensor:
        """Actions [1, H, action_dim] (float32, model space) from noise [1, H, action_dim]."""
        self._fill(prefix)
        self.noise.copy_(noise.reshape(self.noise.shape))
        return self._replay().clone()


class StepGraphs:
    """The fixed-shape steps of one runner: a DecodeStep per batch bucket and a DenoiseLoop per step count,
    made on first use (`warm_up` makes them all ahead of time: a capture costs a few hundred ms on the
    engine thread, not something to pay in the middle of a control cycle)."""

    def __init__(self, model: Pi05, pool: KVPool, max_batch: int, prefix_tokens: int, own_tokens: int,
                 capture: bool):
        self.model, self.pool, self.capture = model, pool, capture
        self.buckets = batch_buckets(max_batch)
        self.prefix_blocks = pool.blocks_for(prefix_tokens)
        self.own_blocks = pool.blocks_for(own_tokens)
        self._decode: dict[int, DecodeStep] = {}
        self._denoise: dict[int, DenoiseLoop] = {}
        self.replays = 0            # steps served by a fixed-shape step
        self.fallbacks = 0          # steps that did not fit one (ran the dynamic path)

    def decode_step(self, bucket: int) -> DecodeStep:
        if bucket not in self._decode:
            self._decode[bucket] = DecodeStep(self.model, self.pool, bucket, self.prefix_blocks, self.own_blocks,
                                              self.capture)
        return self._decode[bucket]

    def denoise_loop(self, steps: int) -> DenoiseLoop:
        if steps not in self._denoise:
            self._denoise[steps] = DenoiseLoop(self.model, self.pool, steps, self.prefix_blocks, self.capture)
        return self._denoise[steps]

    def warm_up(self, denoise_steps: int) -> None:
        """Make (and on CUDA capture) every bucket and the denoise loop, on padding only."""
        for b in self.buckets:
            self.decode_step(b)([], [])
        loop = self.denoise_loop(denoise_steps)
        loop(Segment((self.pool.scratch_block,), 1), torch.zeros(loop.noise.shape))

    def decode_step_for(self, rows: list[CachedRow]) -> DecodeStep | None:
        """The fixed-shape step that runs this decode step, or None when it does not fit one (one new token
        per row, a bucket for the batch, tables wide enough): the caller then runs it eagerly."""
        if any(r.n_new != 1 for r in rows):
            return None                             # a question prefill, not a decode step
        bucket = next((b for b in self.buckets if b >= len(rows)), None)
        if bucket is None or not rows or not self.decode_step(bucket).fits(rows):
            self.fallbacks += 1
            return None
        self.replays += 1
        return self.decode_step(bucket)

    def denoise_loop_for(self, prefix: Segment, horizon: int, steps: int) -> DenoiseLoop | None:
        loop = self.denoise_loop(steps)
        if not loop.fits(prefix, horizon):
            self.fallbacks += 1
            return None
        self.replays += 1
        return loop
