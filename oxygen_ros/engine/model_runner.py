"""ModelRunner: the engine's only door to the model. It runs prefill, action sampling and text extension
on the KV pool, given rows and block tables; it never sees a request record and allocates only the
blocks of a frame it prefills (through the block manager), releasing them itself if the prefill fails.

Whether a step runs as a fixed-shape (CUDA-graph) step or eagerly is decided in one place, `_forward` /
`_denoise`: the fixed-shape step when one is enabled and the step fits it, else the eager forward.
Everything here runs on the engine thread, which owns the device.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from oxygen_ros.model import rtc
from oxygen_ros.model.attention import ActionAttention, CachedAttention, CachedRow, Segment
from oxygen_ros.model.pi05 import Pi05, PrefixRow

from .graphs import StepGraphs
from .kv_pool import FrameCache, KVPool

log = logging.getLogger("oxygen_ros.engine")


class EngineFault(RuntimeError):
    """A model computation produced something unusable (NaN/inf): the frame's results are discarded."""


@dataclass(frozen=True)
class TextRow:
    """New tokens appended to a sequence: its frame prefix, its own blocks and how many tokens they hold."""

    prefix: Segment
    blocks: tuple[int, ...]
    own_len: int
    tokens: list[int]


class ModelRunner:
    def __init__(self, model: Pi05, pool: KVPool, backend: str = "torch"):
        self.model, self.pool, self.backend = model, pool, backend
        self.cfg = model.cfg
        self.graphs: StepGraphs | None = None

    def start_graphs(self, config) -> str:
        """Fixed-shape steps (graphs.py) as the engine config asks: captured now on CUDA, not in the middle
        of a control cycle. By default (cuda_graphs unset) they are on when the model runs the Triton
        kernels on CUDA (what they are for), and a failed capture is not fatal: the runner stays eager and
        the reason is returned (for the log and diagnostics); asked for explicitly, a failure raises."""
        explicit = config.cuda_graphs is not None
        if not (config.cuda_graphs if explicit else self.graphs_by_default()):
            return ""
        capture = self.model.device.type == "cuda"
        try:
            steps = self.enable_graphs(config.max_active_requests, config.max_question_chars + config.max_tokens_limit,
                                       capture)
            if capture:
                steps.warm_up(config.denoise_steps or self.cfg.num_denoise_steps)
        except Exception as e:
            if explicit:
                raise
            self.disable_graphs()
            message = f"CUDA graphs unavailable, running eagerly (slower): {e}"
            log.warning(message)
            return message
        return ""

    def graphs_by_default(self) -> bool:
        return self.backend == "triton" and self.model.device.type == "cuda"

    def enable_graphs(self, max_batch: int, own_tokens: int, capture: bool) -> StepGraphs:
        """Serve decode steps and denoise loops from fixed-shape steps (CUDA graphs when `capture`; see
        graphs.py). They read their metadata from tensors, which only the Triton kernels do."""
        if self.backend != "triton":
            raise ValueError("fixed-shape steps (cuda_graphs) need the triton attention backend, "
                             f"the runner uses {self.backend!r}")
        if capture and self.model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {self.model.device}")
        self.graphs = StepGraphs(self.model, self.pool, max_batch, self.max_prefix_tokens(), own_tokens, capture)
        return self.graphs

    def disable_graphs(self) -> None:
        self.graphs = None

    def max_prefix_tokens(self) -> int:
        return len(self.cfg.camera_slots) * self.cfg.image_tokens + self.cfg.max_token_len

    # ------------------------------------------------------------------ frames
    @torch.inference_mode()
    def prefill(self, rows: list[PrefixRow], frame_indices: list[int], stamps: list[float]) -> list[FrameCache | EngineFault]:
        """Prefill several frames (one per robot) in ONE forward into fresh pool blocks. Each good frame's
        handle holds the caller's reference; a row whose values are not finite comes back as an EngineFault
        with its blocks released (rows never mix in the model, so the others stay good). On an exception
        every block taken here is released."""
        lengths = [self.model.prefix_length(r) for r in rows]
        taken: list[tuple[int, ...]] = []
        try:
            for n in lengths:
                taken.append(self.pool.blocks.allocate(self.pool.blocks_for(n)))
            cached = [CachedRow(n_new=n, own=Segment(b, n), bidir=self.model.prefix_bidir(r))
                      for r, n, b in zip(rows, lengths, taken)]
            hidden = self.model.prefill(rows, CachedAttention(self.pool.kv, cached, self.backend, self.model.device))
            finite = torch.isfinite(hidden).all(dim=-1).tolist()
        except BaseException:
            for b in taken:
                self.pool.blocks.decref(b)
            raise
        out: list[FrameCache | EngineFault] = []
        for i, (c, index, stamp) in enumerate(zip(cached, frame_indices, stamps)):
            if finite[i]:
                out.append(FrameCache(self.pool, c.own, index, stamp, hidden[i]))
            else:
                self.pool.blocks.decref(c.own.blocks)
                out.append(EngineFault(f"frame {index}: prefill produced non-finite values"))
        return out

    def prefill_one(self, row: PrefixRow, frame_index: int, stamp: float) -> FrameCache:
        """One frame (a request's own prefill in the isolated policy, the subtask text); raises EngineFault."""
        (frame,) = self.prefill([row], [frame_index], [stamp])
        if isinstance(frame, EngineFault):
            raise frame
        return frame

    @torch.inference_mode()
    def actions(self, frames: list[FrameCache], noise: torch.Tensor, steps: int | None = None,
                guides: list[rtc.RowGuide | None] | None = None, max_guidance: float = rtc.DEFAULT_MAX_GUIDANCE,
                correction: str = "vjp") -> list[np.ndarray | EngineFault]:
        """Model-space action chunks [H, action_dim] (float32) of several frames, denoised together (noise
        [R, H, action_dim], one row per frame). A chunk with non-finite values comes back as an EngineFault.
        guides: per frame, real-time chunking toward its robot's previous chunk (model/rtc.py), or None; with
        the guidance weight clip `max_guidance` (beta) and the `correction` ("vjp": the paper's; "error":
        LeRobot 0.6.1's; "prefix": the pinned rows given to a model trained with prefix conditioning).
        Frames without an active guide are denoised exactly as without guides (as their own batch)."""
        steps = steps or self.cfg.num_denoise_steps
        noise = noise.reshape(len(frames), *noise.shape[-2:])
        guided = rtc.guided_rows(guides)
        if not guided:
            x = self._sample(frames, noise, steps)
        else:
            plain = [i for i in range(len(frames)) if i not in guided]
            x = torch.empty(noise.shape, dtype=torch.float32, device=self.model.device)
            if plain:
                x[plain] = self._sample([frames[i] for i in plain], noise[plain], steps)
            x[guided] = self._sample_guided([frames[i] for i in guided], noise[guided], steps,
                                            rtc.Guidance.stack([guides[i] for i in guided], max_guidance,
                                                               correction))
        x = x.cpu().numpy()
        return [x[i] if np.all(np.isfinite(x[i])) else
                EngineFault(f"frame {f.frame_index}: the action expert produced non-finite actions")
                for i, f in enumerate(frames)]

    def _sample(self, frames: list[FrameCache], noise: torch.Tensor, steps: int) -> torch.Tensor:
        if len(frames) == 1:
            return self._denoise(frames[0].segment, noise, steps)
        # the fixed-shape (graph) loops are batch 1: several frames run the eager batched loop
        attn = ActionAttention(self.pool.kv, [f.segment for f in frames], noise.shape[-2], self.backend,
                               self.model.device)
        return self.model.sample_actions(noise, attn, steps)

    def _sample_guided(self, frames: list[FrameCache], noise: torch.Tensor, steps: int,
                       guidance: rtc.Guidance) -> torch.Tensor:
        """RTC rows. The guidance is a vector-Jacobian product through the expert, so these rows run with
        autograd on, outside inference mode (whose tensors autograd cannot save), eagerly on the torch
        attention and norms whatever the runner's backend: the Triton kernels have no backward, and a
        CUDA graph holds no autograd. The prefix K/V is read, never differentiated (it needs no gradient).
        Correction "prefix" (a model trained with prefix conditioning) needs no gradient: the runner's
        kernels, eagerly (the fixed-shape graph loops take one time per row)."""
        if guidance.correction == "prefix":
            attn = ActionAttention(self.pool.kv, [f.segment for f in frames], noise.shape[-2], self.backend,
                                   self.model.device)
            return self.model.sample_actions(noise, attn, steps, guidance=guidance)
        with torch.inference_mode(False):
            attn = ActionAttention(self.pool.kv, [f.segment for f in frames], noise.shape[-2], "torch",
                                   self.model.device)
            return self.model.sample_actions(noise, attn, steps, guidance=guidance)

    def _denoise(self, prefix: Segment, noise: torch.Tensor, steps: int) -> torch.Tensor:
        loop = self.graphs.denoise_loop_for(prefix, noise.shape[-2], steps) if self.graphs is not None else None
        if loop is not None:
            return loop(prefix, noise)
        attn = ActionAttention(self.pool.kv, [prefix], noise.shape[-2], self.backend, self.model.device)
        return self.model.sample_actions(noise, attn, steps)

    # ------------------------------------------------------------------ text
    @torch.inference_mode()
    def extend(self, rows: list[TextRow]) -> torch.Tensor:
        """Append each row's tokens (a question, or the last sampled token) in one batched forward; returns
        the logits of each row's last new token [R, vocab] (float32). The caller records the new lengths."""
        cached = []
        for r in rows:
            total = r.own_len + len(r.tokens)
            if total > len(r.blocks) * self.pool.block_size:
                raise RuntimeError(f"a sequence of {total} tokens outgrew its {len(r.blocks)} blocks")
            cached.append(CachedRow(n_new=len(r.tokens), own=Segment(r.blocks, total), prefix=r.prefix))
        return self._forward(cached, [t for r in rows for t in r.tokens])

    @torch.inference_mode()
    def extend_spans(self, frames: list[FrameCache], causal: list[list[int]],
                     tails: list[list[int]]) -> list[FrameCache]:
        """Each frame's prefix continued by a span (pi052's joint subtask span): `causal` tokens attended causally
        (the subtask's, as they were decoded), then `tails` tokens that see each other (EOS and the newline
        after it), two batched forwards. A new handle per frame (`FrameCache.fork`: the prefix shared, its
        partly filled last block copied on write) whose segment is the prefix plus the span, for the actions
        to read. The caller holds the new handles; on an exception they are released here."""
        forks: list[FrameCache] = []
        try:
            for f, c, t in zip(frames, causal, tails):
                forks.append(f.fork(len(c) + len(t)))
            for tail_block in (False, True):
                rows, tokens = [], []
                for fork, c, t in zip(forks, causal, tails):
                    new, end = (t, fork.segment.length) if tail_block else (c, fork.segment.length - len(t))
                    if new:
                        rows.append(CachedRow(n_new=len(new), own=Segment(fork.segment.blocks, end),
                                              bidir=len(new) if tail_block else 0))
                        tokens += new
                if rows:
                    self.model.extend(torch.tensor(tokens, dtype=torch.long),
                                      CachedAttention(self.pool.kv, rows, self.backend, self.model.device))
        except BaseException:
            for fork in forks:
                fork.release()
            raise
        return forks

    def _forward(self, rows: list[CachedRow], tokens: list[int]) -> torch.Tensor:
        step = self.graphs.decode_step_for(rows) if self.graphs is not None else None
        if step is not None:
            return step(rows, tokens)
        return self.model.logits(self.model.extend(
            torch.tensor(tokens, dtype=torch.long),
            CachedAttention(self.pool.kv, rows, self.backend, self.model.device)))

    @torch.inference_mode()
    def frame_logits(self, frame: FrameCache) -> torch.Tensor:
        """Logits of the token after the frame's prefix [1, vocab] (text with no question)."""
        return self.model.logits(frame.last_hidden[None])

    def noise(self, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(self.cfg.action_horizon, self.cfg.action_dim, generator=generator)
