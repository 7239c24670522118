"""The robot side of a policy: what openpi runs around the network, built from a robot config.

In (observation -> model inputs), in openpi's order:
    images: optional 180° rotation per camera (LIBERO's training images are upside down), then
            resize_with_pad to the model's size (antialiased linear on uint8, model/preprocess.py);
    state:  the robot's input transform (ALOHA: openpi adapt_to_pi; a linear gripper in robot units ->
            the model's [0, 1]), then quantile normalisation.
Out (model actions -> robot commands):
    un-normalisation, the robot's action dimensions, delta -> absolute (adding the *transformed* state,
    as openpi's AbsoluteActions does), then the robot's output transform.

The engine calls `model_inputs` and `robot_actions`; the policy_io tool runs the same two on raw arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np

from oxygen_ros.model.normalize import Normalizer
from oxygen_ros.model.preprocess import resize_with_pad

from . import aloha
from .errors import ConfigError, InputError

TRANSFORMS = ("none", "aloha")


@dataclass(frozen=True)
class RobotIOConfig:
    transform: str = "none"                        # named input/output transform ("aloha": openpi adapt_to_pi)
    robot_action_dim: int = 0                      # action dimensions the robot uses (0: all of the model's)
    delta_action_mask: tuple[bool, ...] = ()       # true where the model predicts a change from the state
    gripper_dims: tuple[int, ...] = ()             # state/action dims of a linear gripper in robot units...
    gripper_range: tuple[float, ...] = ()          # ...whose robot values at model 0 (open) and 1 (closed)
    rotate_180: tuple[str, ...] = ()               # camera slots turned upside down (LIBERO)
    control_period_s: float = 0.0                  # time between chunk rows (0: one row per publish tick)

    @classmethod
    def from_params(cls, params: dict) -> "RobotIOConfig":
        """From a node's parameters (robot config YAML): the keys named like the fields; others ignored."""
        names = {f.name for f in fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items() if k in names}
        return cls(**values)

    def replace(self, **changes) -> "RobotIOConfig":
        return replace(self, **changes)

    def problems(self, model_action_dim: int, camera_slots: tuple[str, ...] = ()) -> list[str]:
        """Every inconsistency, one line each (listed before refusing to start). `camera_slots`: the model's,
        to check rotate_180 against (not checked when empty)."""
        out = []
        unknown = [c for c in self.rotate_180 if camera_slots and c not in camera_slots]
        if unknown:
            out.append(f"rotate_180 names {unknown}, not camera slots of the model ({', '.join(camera_slots)})")
        if self.transform not in TRANSFORMS:
            out.append(f"transform {self.transform!r} is not one of {', '.join(TRANSFORMS)}")
        dim = self.robot_action_dim or model_action_dim
        if not 0 < dim <= model_action_dim:
            out.append(f"robot_action_dim {self.robot_action_dim} must be in 1..{model_action_dim}")
        if self.transform == "aloha" and dim != aloha.DIM:
            out.append(f"transform aloha needs robot_action_dim {aloha.DIM}, got {dim}")
        if len(self.delta_action_mask) > dim:
            out.append(f"delta_action_mask has {len(self.delta_action_mask)} entries, the robot only {dim} "
                       "action dims")
        if self.gripper_dims and len(self.gripper_range) != 2:
            out.append(f"gripper_range needs two values (robot units at model 0 and 1), got {list(self.gripper_range)}")
        elif self.gripper_dims and self.gripper_range[0] == self.gripper_range[1]:
            out.append(f"gripper_range {list(self.gripper_range)} is empty")
        if any(not 0 <= d < dim for d in self.gripper_dims):
            out.append(f"gripper_dims {list(self.gripper_dims)} must be action dims in 0..{dim - 1}")
        if self.gripper_dims and self.transform != "none":
            out.append(f"gripper_dims and transform {self.transform!r} both convert the gripper: choose one")
        if not (self.control_period_s >= 0 and np.isfinite(self.control_period_s)):
            out.append(f"control_period_s {self.control_period_s} must be >= 0")
        return out


@dataclass
class ModelInputs:
    images: dict[str, np.ndarray]      # slot -> uint8 [size, size, 3], only the cameras that have an image
    state: np.ndarray                  # after the robot's input transform (model units, not normalised)
    state_normalized: np.ndarray


@dataclass
class PolicyIO:
    config: RobotIOConfig
    normalizer: Normalizer = field(default_factory=Normalizer.identity)
    model_action_dim: int = 32
    image_size: int = 224

    def __post_init__(self):
        problems = self.config.problems(self.model_action_dim)
        if problems:
            raise ConfigError("\n".join(problems))
        self.robot_action_dim = self.config.robot_action_dim or self.model_action_dim
        self._delta = np.flatnonzero(np.array(self.config.delta_action_mask, dtype=bool))

    @property
    def control_period_s(self) -> float:
        return self.config.control_period_s

    # ------------------------------------------------------------------ in
    def image(self, slot: str, image: np.ndarray) -> np.ndarray:
        img = np.asarray(image)
        if img.dtype != np.uint8 or img.ndim != 3 or img.shape[-1] != 3:
            raise InputError(f"camera '{slot}': expected an RGB uint8 image [H, W, 3], got {img.dtype} "
                             f"{list(img.shape)}")
        if slot in self.config.rotate_180:
            img = img[::-1, ::-1]
        try:
            return resize_with_pad(np.ascontiguousarray(img), self.image_size, self.image_size)
        except ValueError as e:
            raise InputError(f"camera '{slot}': {e}") from None

    def model_state(self, state: np.ndarray) -> np.ndarray:
        """Robot state -> the model's state units (before normalisation)."""
        s = np.array(state, dtype=np.float64)
        if s.ndim != 1 or not np.all(np.isfinite(s)):
            raise InputError(f"state must be a finite vector, got {s.tolist()[:8]}")
        if self.config.transform == "aloha":
            try:
                return aloha.decode_state(s)
            except ValueError as e:
                raise InputError(str(e)) from None
        if self.config.gripper_dims:
            dims = list(self.config.gripper_dims)
            if max(dims) >= len(s):
                raise InputError(f"state has {len(s)} values, gripper_dims {dims} needs {max(dims) + 1}")
            lo, hi = self.config.gripper_range
            s[dims] = (s[dims] - lo) / (hi - lo)
        return s

    def model_inputs(self, images: dict[str, np.ndarray | None], state: np.ndarray) -> ModelInputs:
        resized = {slot: self.image(slot, img) for slot, img in images.items() if img is not None}
        s = self.model_state(state)
        return ModelInputs(resized, s, self.normalizer.normalize_state(s))

    # ------------------------------------------------------------------ out
    def robot_actions(self, model_actions: np.ndarray, state: np.ndarray | None = None) -> np.ndarray:
        """Model-space actions [H, A] -> robot commands [H, robot_action_dim]. `state`: the robot state
        (robot units) of the observation, needed when some dimensions are deltas."""
        a = self.normalizer.unnormalize_actions(np.asarray(model_actions, dtype=np.float64))
        a = a[:, :self.robot_action_dim].copy()
        if self._delta.size:
            if state is None:
                raise InputError(f"delta actions need the state's dimensions {self._delta.tolist()}")
            s = self.model_state(state)
            if len(s) <= self._delta.max():
                raise InputError(f"delta actions need the state's dimensions {self._delta.tolist()}, the state "
                                 f"has {len(s)}")
            a[:, self._delta] += s[self._delta]
        if self.config.transform == "aloha":
            return aloha.encode_actions(a)
        if self.config.gripper_dims:
            lo, hi = self.config.gripper_range
            a[:, list(self.config.gripper_dims)] = lo + a[:, list(self.config.gripper_dims)] * (hi - lo)
        return a
