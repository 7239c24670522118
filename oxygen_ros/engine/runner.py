"""ModelRunner: the engine's only door to the model. Turns observations into prefix rows, runs prefill,
action sampling and text extension on the KV pool, and converts actions to robot units.

Everything here runs on the engine thread, which owns the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oxygen_ros.model.attention import ActionAttention, CachedAttention, CachedRow, Segment
from oxygen_ros.model.pi05 import Pi05, PrefixRow
from oxygen_ros.model.preprocess import to_pixels
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.robot.errors import InputError
from oxygen_ros.robot.policy_io import PolicyIO, RobotIOConfig

from .graphs import StepGraphs
from .kv_pool import FrameCache, KVPool
from .requests import ActiveRequest


class EngineFault(RuntimeError):
    """A model computation produced something unusable (NaN/inf): the frame's results are discarded."""


@dataclass
class PreparedFrame:
    row: PrefixRow
    stamp: float
    prompt_truncated: int       # prompt tokens cut off to fit max_token_len (reported, not silent)
    images: list                # the valid cameras' pixels, reused by subtask mode
    state: np.ndarray           # normalised state


class ModelRunner:
    def __init__(self, model: Pi05, tokenizer: Tokenizer, pool: KVPool, io: PolicyIO | None = None,
                 backend: str = "torch", state_in_prompt: bool = True):
        cfg = model.cfg
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} pieces, the model only {cfg.vocab_size}")
        self.model, self.tokenizer, self.pool = model, tokenizer, pool
        # The robot side (transforms, resizing, (un)normalisation, deltas): oxygen_ros/robot/policy_io.py.
        self.io = io or PolicyIO(RobotIOConfig(), model_action_dim=cfg.action_dim, image_size=cfg.vision.image_size)
        if (self.io.model_action_dim, self.io.image_size) != (cfg.action_dim, cfg.vision.image_size):
            raise ValueError(f"policy I/O built for {self.io.model_action_dim} action dims and "
                             f"{self.io.image_size} px images, the model has {cfg.action_dim} and "
                             f"{cfg.vision.image_size}")
        self.backend = backend
        self.state_in_prompt = state_in_prompt
        self.cfg = cfg
        self.graphs: StepGraphs | None = None

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

    @property
    def robot_action_dim(self) -> int:
        return self.io.robot_action_dim

    # ------------------------------------------------------------------ sizes
    def max_prefix_tokens(self) -> int:
        return len(self.cfg.camera_slots) * self.cfg.image_tokens + self.cfg.max_token_len

    # ------------------------------------------------------------------ observation -> prefix
    def prepare(self, obs, task: str | None = None) -> PreparedFrame:
        """Validate and convert an observation (oxygen_ros.robot.sync.Observation or alike)."""
        slots = self.cfg.camera_slots
        inputs = self.io.model_inputs({s: obs.images.get(s) for s in slots if obs.image_masks.get(s, False)},
                                      obs.state)
        images = [to_pixels(inputs.images[s], self.cfg.vision.image_size) for s in slots if s in inputs.images]
        if not images:
            raise InputError("observation has no valid camera image")
        state = inputs.state_normalized
        prompt = self.tokenizer.action_prompt(obs.prompt if task is None else task,
                                              state if self.state_in_prompt else None, self.cfg.max_token_len)
        pixels = torch.stack(images)
        return PreparedFrame(PrefixRow(pixels, torch.tensor(prompt.tokens, dtype=torch.long)), obs.stamp_s,
                             prompt.truncated, images, state)

    def retokenize(self, frame: PreparedFrame, task: str) -> PreparedFrame:
        """Same images and state, another task text (π0.5 subtask mode)."""
        prompt = self.tokenizer.action_prompt(task, frame.state if self.state_in_prompt else None,
                                              self.cfg.max_token_len)
        return PreparedFrame(PrefixRow(frame.row.images, torch.tensor(prompt.tokens, dtype=torch.long)),
                             frame.stamp, prompt.truncated, frame.images, frame.state)

    @torch.inference_mode()
    def prefill(self, frame: PreparedFrame, frame_index: int, tokens: list[int] | None = None) -> FrameCache:
        """Prefill one frame into fresh pool blocks; `tokens` replaces the prompt (subtask generation)."""
        row = frame.row if tokens is None else PrefixRow(frame.row.images, torch.tensor(tokens, dtype=torch.long))
        n = self.model.prefix_length(row)
        blocks = self.pool.allocator.allocate(self.pool.blocks_for(n))
        try:
            cached = CachedRow(n_new=n, own=Segment(blocks, n), bidir=self.model.prefix_bidir(row))
            hidden = self.model.prefill([row], CachedAttention(self.pool.kv, [cached], self.backend,
                                                               self.model.device))
            if not torch.isfinite(hidden).all():
                raise EngineFault(f"frame {frame_index}: prefill produced non-finite values")
        except BaseException:
            self.pool.allocator.decref(blocks)
            raise
        return FrameCache(self.pool, cached.own, frame_index, frame.stamp, hidden[0])

    @torch.inference_mode()
    def actions(self, frame: FrameCache, noise: torch.Tensor, steps: int | None = None,
                state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Action chunk of a frame: (model-space actions [H, action_dim], robot units [H, robot_dim]).
        `state` (robot units) is needed when some dimensions are deltas (the robot's delta_action_mask)."""
        noise = noise.reshape(1, *noise.shape[-2:])
        x = None
        if self.graphs is not None:
            x = self.graphs.actions(frame.segment, noise, steps or self.cfg.num_denoise_steps)
        if x is None:
            attn = ActionAttention(self.pool.kv, [frame.segment], noise.shape[-2], self.backend, self.model.device)
            x = self.model.sample_actions(noise, attn, steps)
        x = x[0].cpu().numpy()
        if not np.all(np.isfinite(x)):
            raise EngineFault(f"frame {frame.frame_index}: the action expert produced non-finite actions")
        robot = self.io.robot_actions(x, state)
        return x, robot

    # ------------------------------------------------------------------ text
    @torch.inference_mode()
    def extend(self, items: list[tuple[ActiveRequest, list[int]]]) -> torch.Tensor:
        """Append tokens to each request (its question, or its last sampled token) in one batched forward;
        returns the logits of each request's last new token [R, vocab] (float32)."""
        rows = []
        for req, toks in items:
            total = req.own_len + len(toks)
            if total > len(req.blocks) * self.pool.block_size:
                raise RuntimeError(f"request {req.handle.id} outgrew its {len(req.blocks)} blocks")
            rows.append(CachedRow(n_new=len(toks), own=Segment(req.blocks, total), prefix=req.frame.segment))
        flat = [t for _, toks in items for t in toks]
        logits = None
        if self.graphs is not None and len(flat) == len(items):     # one token per row: a decode step
            logits = self.graphs.decode(rows, flat)
        if logits is None:
            tokens = torch.tensor(flat, dtype=torch.long)
            logits = self.model.logits(self.model.extend(
                tokens, CachedAttention(self.pool.kv, rows, self.backend, self.model.device)))
        for req, toks in items:
            req.own_len += len(toks)
        return logits

    @torch.inference_mode()
    def frame_logits(self, frame: FrameCache) -> torch.Tensor:
        """Logits of the token after the frame's prefix [1, vocab] (text with no question)."""
        return self.model.logits(frame.last_hidden[None])

    def question_tokens(self, text: str, template: str) -> list[int]:
        return self.tokenizer.encode(template.format(text=text)) if text else []

    def request_blocks(self, question_tokens: int, max_tokens: int) -> int:
        # The last sampled token is never fed back, so a reply of max_tokens stores max_tokens - 1 tokens.
        return max(1, self.pool.blocks_for(question_tokens + max_tokens - 1))

    def noise(self, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(self.cfg.action_horizon, self.cfg.action_dim, generator=generator)

