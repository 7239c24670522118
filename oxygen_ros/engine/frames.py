"""Frame preparation: an observation in robot units -> the model's prefix row, and the model's action
chunk -> robot units. The two policy-I/O steps are the two marked calls (`normalize_state` in `prepare`,
`to_robot` in `robot_actions`): the only places that know about the robot's units.

Runs on the engine thread, before and after the model runner; the runner never sees robot units.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from oxygen_ros.model.config import Pi05Config
from oxygen_ros.model.normalize import Normalizer
from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.model.preprocess import to_pixels
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.robot.errors import InputError


@dataclass
class PreparedFrame:
    row: PrefixRow
    stamp: float
    prompt_truncated: int       # prompt tokens cut off to fit max_token_len (reported, not silent)
    state: np.ndarray           # the robot's state, robot units (delta actions are relative to it)
    model_state: np.ndarray     # normalised state (in the prompt)


class FramePreparer:
    def __init__(self, cfg: Pi05Config, tokenizer: Tokenizer, normalizer: Normalizer | None = None,
                 state_in_prompt: bool = True, robot_action_dim: int | None = None,
                 delta_action_mask: list[bool] | None = None):
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} pieces, the model only {cfg.vocab_size}")
        if robot_action_dim is not None and not 0 < robot_action_dim <= cfg.action_dim:
            raise ValueError(f"robot action dim {robot_action_dim} must be in 1..{cfg.action_dim}")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.normalizer = normalizer or Normalizer.identity()
        self.state_in_prompt = state_in_prompt
        self.robot_action_dim = robot_action_dim or cfg.action_dim
        # Dimensions the model predicts relative to the current state (openpi's AbsoluteActions output
        # transform: e.g. ALOHA joints, DROID joint-position checkpoints); grippers stay absolute.
        self.delta_action_mask = np.array(delta_action_mask or [], dtype=bool)
        if len(self.delta_action_mask) > self.robot_action_dim:
            raise ValueError(f"delta_action_mask has {len(self.delta_action_mask)} entries, the robot only "
                             f"{self.robot_action_dim} action dims")

    def prepare(self, obs) -> PreparedFrame:
        """Validate and convert an observation (oxygen_ros.robot.sync.Observation or alike)."""
        stamp = obs.stamp_s
        if not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
            raise InputError(f"observation stamp must be a finite number of seconds, got {stamp!r}")
        images = []
        for slot in self.cfg.camera_slots:
            img = obs.images.get(slot)
            if obs.image_masks.get(slot, False) and img is not None:
                try:
                    images.append(to_pixels(img, self.cfg.vision.image_size))
                except (ValueError, RuntimeError) as e:
                    raise InputError(f"camera '{slot}': {e}") from None
        if not images:
            raise InputError("observation has no valid camera image")
        try:
            state = np.asarray(obs.state, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise InputError(f"state must be a finite vector: {e}") from None
        if state.ndim != 1 or not np.all(np.isfinite(state)):
            raise InputError(f"state must be a finite vector, got {state.tolist()[:8]}")
        model_state = self.normalizer.normalize_state(state)                     # policy input transform
        return self._with_prompt(torch.stack(images), float(stamp), state, model_state, obs.prompt)

    def retokenize(self, frame: PreparedFrame, task: str) -> PreparedFrame:
        """Same images and state, another task text (π0.5 subtask mode)."""
        return self._with_prompt(frame.row.images, frame.stamp, frame.state, frame.model_state, task)

    def _with_prompt(self, pixels, stamp, state, model_state, task: str) -> PreparedFrame:
        prompt = self.tokenizer.action_prompt(task, model_state if self.state_in_prompt else None,
                                              self.cfg.max_token_len)
        return PreparedFrame(PrefixRow(pixels, torch.tensor(prompt.tokens, dtype=torch.long)), stamp,
                             prompt.truncated, state, model_state)

    def robot_actions(self, model_actions: np.ndarray, frame: PreparedFrame) -> np.ndarray:
        """[H, action_dim] model space -> [H, robot_action_dim] robot units."""
        robot = self.to_robot(model_actions)                                     # policy output transform
        if self.delta_action_mask.any():
            mask = np.flatnonzero(self.delta_action_mask)
            if len(frame.state) <= mask.max():
                raise InputError(f"delta actions need the state's dimensions {mask.tolist()}")
            robot[:, mask] += frame.state[mask]
        return robot

    def to_robot(self, model_actions: np.ndarray) -> np.ndarray:
        return self.normalizer.unnormalize_actions(model_actions.astype(np.float64))[:, :self.robot_action_dim]

    def prompt_tokens(self, text: str) -> list[int]:
        """BOS + text (subtask prompts)."""
        return [self.tokenizer.bos_id] + self.tokenizer.encode(text)
