"""Frame preparation: an observation in robot units -> the model's prefix row, and the model's action
chunk -> robot units. The two policy-I/O steps are the two marked calls into `oxygen_ros.robot.policy_io.PolicyIO`
(`model_inputs` in `prepare`, `robot_actions` in `robot_actions`): the only places that know about the
robot's units.

Runs on the engine thread, before and after the model runner; the runner never sees robot units.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from oxygen_ros.model.config import Pi05Config
from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.robot.errors import InputError
from oxygen_ros.robot.policy_io import PolicyIO, RobotIOConfig


@dataclass
class PreparedFrame:
    row: PrefixRow
    stamp: float
    prompt_truncated: int       # prompt tokens cut off to fit max_token_len (reported, not silent)
    state: np.ndarray           # the robot's state, robot units (delta actions are relative to it)
    model_state: np.ndarray     # normalised state (in the prompt)
    # The prompt a text continuing the frame's prompt reads, where the prefill's tokens are not that prompt
    # (the joint recipe's actions' block with a lone space piece: tasks/hierarchy.py); None: the prefill's.
    text_prompt: torch.Tensor | None = None


class FramePreparer:
    def __init__(self, cfg: Pi05Config, tokenizer: Tokenizer, io: PolicyIO | None = None,
                 state_in_prompt: bool = True):
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} pieces, the model only {cfg.vocab_size}")
        # The robot side (transforms, resizing, (un)normalisation, deltas): oxygen_ros/robot/policy_io.py.
        self.io = io or PolicyIO(RobotIOConfig(), model_action_dim=cfg.action_dim, image_size=cfg.vision.image_size)
        if (self.io.model_action_dim, self.io.image_size) != (cfg.action_dim, cfg.vision.image_size):
            raise ValueError(f"policy I/O built for {self.io.model_action_dim} action dims and "
                             f"{self.io.image_size} px images, the model has {cfg.action_dim} and "
                             f"{cfg.vision.image_size}")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.state_in_prompt = state_in_prompt

    @property
    def robot_action_dim(self) -> int:
        return self.io.robot_action_dim

    def prepare(self, obs) -> PreparedFrame:
        """Validate and convert an observation (oxygen_ros.robot.sync.Observation or alike)."""
        stamp = obs.stamp_s
        if not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
            raise InputError(f"observation stamp must be a finite number of seconds, got {stamp!r}")
        slots = self.cfg.camera_slots
        try:
            state = np.asarray(obs.state, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise InputError(f"state must be a finite vector: {e}") from None
        inputs = self.io.model_inputs({s: obs.images.get(s) for s in slots if obs.image_masks.get(s, False)},
                                      state)                                      # policy input transform
        images = [inputs.images[s] for s in slots if s in inputs.images]
        if not images:
            raise InputError("observation has no valid camera image")
        return self._with_prompt(torch.stack(images), float(stamp), state, inputs.state_normalized, obs.prompt)

    def reprompt(self, frame: PreparedFrame, tokens: list[int], text_tokens: list[int] | None = None) -> PreparedFrame:
        """Same images and state, the prompt `tokens` exactly (BOS included: a pi052 format's prompt), cut to
        max_token_len; `text_tokens`: the prompt a text continuing the frame's prompt reads instead, when it
        is not `tokens` (`PreparedFrame.text_prompt`)."""
        n = self.cfg.max_token_len
        text = None if text_tokens is None or text_tokens[:n] == tokens[:n] else \
            torch.tensor(text_tokens[:n], dtype=torch.long)
        return PreparedFrame(PrefixRow(frame.row.images, torch.tensor(tokens[:n], dtype=torch.long)), frame.stamp,
                             max(0, len(tokens) - n), frame.state, frame.model_state, text)

    def _with_prompt(self, pixels, stamp, state, model_state, task: str) -> PreparedFrame:
        prompt = self.tokenizer.action_prompt(task, model_state if self.state_in_prompt else None,
                                              self.cfg.max_token_len)
        return PreparedFrame(PrefixRow(pixels, torch.tensor(prompt.tokens, dtype=torch.long)), stamp,
                             prompt.truncated, state, model_state)

    def robot_actions(self, model_actions: np.ndarray, frame: PreparedFrame) -> np.ndarray:
        """[H, action_dim] model space -> [H, robot_action_dim] robot units."""
        return self.io.robot_actions(model_actions, frame.state)                 # policy output transform
