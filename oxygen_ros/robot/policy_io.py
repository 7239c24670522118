"""The robot side of a policy: what runs around the network, built from a robot config and following
where the checkpoint comes from.

openpi checkpoints, in openpi's order:
  In (observation -> model inputs):
    images: optional 180° rotation per camera (LIBERO's training images are upside down), then
            resize_with_pad to the model's size (antialiased linear on uint8, model/preprocess.py), [-1, 1];
    state:  the robot's input transform (ALOHA: openpi adapt_to_pi; a linear gripper in robot units ->
            the model's [0, 1]), then normalisation (openpi's rule for a norm_stats.json).
  Out (model actions -> robot commands):
    un-normalisation, the robot's action dimensions, delta -> absolute (adding the *transformed* state,
    as openpi's AbsoluteActions does), then the robot's output transform.
LeRobot pi05 checkpoints (`lerobot` given: checkpoint.LeRobotPolicy), as LeRobot 0.6.1 serves them:
  images: rotation as above, then LeRobot's float resize-with-pad without antialiasing
          (preprocess.lerobot_pixels), after the checkpoint's VISUAL normalisation if it has one;
  state:  the robot's input transform, then float32 and LeRobot's normaliser (model/normalize.py);
  out:    the chunk cut to the action feature's size, LeRobot's unnormaliser (float32), relative ->
          absolute on the checkpoint's relative_mask dimensions (adding the state, float32, as its
          AbsoluteActionsProcessorStep does; the robot config's delta_action_mask is not used), then the
          robot's action dimensions and output transform.

The engine calls `model_inputs` and `robot_actions`; the policy_io tool runs the same two on raw arrays.
`build_policy_io` decides, from the checkpoint and the `norm_stats` parameter, which of the two and which
statistics (a LeRobot folder's own unless `norm_stats` names others), and says so in `description`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.model.checkpoint import LeRobotPolicy, lerobot_policy
from oxygen_ros.model.normalize import LeRobotNormalizer, Normalizer, load_normalizer
from oxygen_ros.model.preprocess import lerobot_pixels, to_pixels

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
    images: dict[str, torch.Tensor]    # slot -> float32 [3, size, size] in [-1, 1] (what the network sees),
    #                                    only the cameras that have an image
    state: np.ndarray                  # after the robot's input transform (model units, not normalised)
    state_normalized: np.ndarray


@dataclass
class PolicyIO:
    config: RobotIOConfig
    normalizer: Normalizer | LeRobotNormalizer = field(default_factory=Normalizer.identity)
    model_action_dim: int = 32
    image_size: int = 224
    lerobot: LeRobotPolicy | None = None           # a LeRobot checkpoint: LeRobot's pipeline (module docstring)
    camera_features: dict[str, str] = field(default_factory=dict)   # slot -> LeRobot image feature
    description: str = ""                          # which pipeline and statistics (logged at start)

    def __post_init__(self):
        problems = self.config.problems(self.model_action_dim)
        lerobot_dim = self.lerobot.action_dim if self.lerobot is not None else None
        if lerobot_dim is not None:
            if lerobot_dim > self.model_action_dim:
                problems.append(f"the LeRobot checkpoint's action feature has {lerobot_dim} dims, the model "
                                f"{self.model_action_dim}")
            elif self.config.robot_action_dim > lerobot_dim:
                problems.append(f"robot_action_dim {self.config.robot_action_dim} exceeds the LeRobot "
                                f"checkpoint's {lerobot_dim} action dims")
        resolution = self.lerobot.image_resolution if self.lerobot is not None else None
        if resolution is not None and resolution != (self.image_size, self.image_size):
            problems.append(f"the LeRobot checkpoint's image_resolution {list(resolution)} is not the model's "
                            f"{self.image_size} px")
        if problems:
            raise ConfigError("\n".join(problems))
        self.robot_action_dim = self.config.robot_action_dim or lerobot_dim or self.model_action_dim
        self._delta = np.flatnonzero(np.array(self.config.delta_action_mask, dtype=bool))
        if self.lerobot is not None:
            self._delta = np.flatnonzero(np.array(self.lerobot.relative_mask, dtype=bool))

    @property
    def control_period_s(self) -> float:
        return self.config.control_period_s

    @property
    def delta_dims(self) -> np.ndarray:
        """Model action dimensions predicted as changes from the state (robot_actions adds the state back):
        the robot config's delta_action_mask, or a LeRobot checkpoint's relative_mask."""
        return self._delta

    # ------------------------------------------------------------------ in
    def image(self, slot: str, image: np.ndarray) -> torch.Tensor:
        """A camera image (uint8 [H, W, 3]) -> the model's pixels, float32 [3, size, size] in [-1, 1]."""
        img = np.asarray(image)
        if img.dtype != np.uint8 or img.ndim != 3 or img.shape[-1] != 3:
            raise InputError(f"camera '{slot}': expected an RGB uint8 image [H, W, 3], got {img.dtype} "
                             f"{list(img.shape)}")
        if slot in self.config.rotate_180:
            img = img[::-1, ::-1]
        try:
            if self.lerobot is None:
                return to_pixels(np.ascontiguousarray(img), self.image_size)
            normalize = None
            if isinstance(self.normalizer, LeRobotNormalizer) and slot in self.camera_features:
                feature = self.camera_features[slot]
                normalize = lambda x: self.normalizer.normalize_image(feature, x)  # noqa: E731
            return lerobot_pixels(img, self.image_size, self.image_size, normalize)
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
        pixels = {slot: self.image(slot, img) for slot, img in images.items() if img is not None}
        s = self.model_state(state)
        try:
            normalized = self.normalizer.normalize_state(s)
        except ValueError as e:
            raise InputError(str(e)) from None
        return ModelInputs(pixels, s, normalized)

    # ------------------------------------------------------------------ out
    def robot_actions(self, model_actions: np.ndarray, state: np.ndarray | None = None) -> np.ndarray:
        """Model-space actions [H, A] -> robot commands [H, robot_action_dim]. `state`: the robot state
        (robot units) of the observation, needed when some dimensions are deltas."""
        a = np.asarray(model_actions, dtype=np.float64 if self.lerobot is None else np.float32)
        if self.lerobot is not None and self.lerobot.action_dim is not None:
            a = a[:, :self.lerobot.action_dim]          # PI05Policy.predict_action_chunk's cut
        try:
            a = np.array(self.normalizer.unnormalize_actions(a))
        except ValueError as e:
            raise InputError(str(e)) from None
        if self._delta.size:
            if state is None:
                raise InputError(f"delta actions need the state's dimensions {self._delta.tolist()}")
            s = self.model_state(state)
            if len(s) <= self._delta.max():
                raise InputError(f"delta actions need the state's dimensions {self._delta.tolist()}, the state "
                                 f"has {len(s)}")
            a[:, self._delta] += s[self._delta].astype(a.dtype)
        a = a[:, :self.robot_action_dim]
        if self.config.transform == "aloha":
            return aloha.encode_actions(a)
        if self.config.gripper_dims:
            lo, hi = self.config.gripper_range
            a[:, list(self.config.gripper_dims)] = lo + a[:, list(self.config.gripper_dims)] * (hi - lo)
        return a


def build_policy_io(config: RobotIOConfig, *, checkpoint: str | Path | None = None,
                    norm_stats: str | Path | None = None, asset_id: str | None = None,
                    model_action_dim: int = 32, image_size: int = 224,
                    camera_slots: tuple[str, ...] = ()) -> PolicyIO:
    """The policy I/O a checkpoint was trained with: LeRobot's pipeline for a LeRobot pi05 directory,
    openpi's otherwise. Statistics: `norm_stats` when given (a LeRobot directory, an openpi norm_stats.json
    or a checkpoint directory holding assets/<asset_id>/norm_stats.json: each with its own rule), else a
    LeRobot checkpoint's own, else none. `camera_slots`: the model's, for a LeRobot checkpoint's VISUAL
    normalisation (its i-th camera feature feeds the i-th slot)."""
    lerobot = lerobot_policy(checkpoint) if checkpoint else None
    if norm_stats:
        normalizer = load_normalizer(norm_stats, asset_id)
    elif lerobot is not None:
        folder = Path(checkpoint)
        normalizer = LeRobotNormalizer.load(folder if folder.is_dir() else folder.parent)
    else:
        normalizer = Normalizer.identity()
    cameras: dict[str, str] = {}
    if lerobot is None:
        pipeline = "openpi pipeline: openpi's resize-with-pad (antialiased)"
        if config.delta_action_mask:
            pipeline += f", delta actions on dims {np.flatnonzero(config.delta_action_mask).tolist()}"
    else:
        features, problems = lerobot.camera_slots(camera_slots)
        normalized = list(normalizer.images) if isinstance(normalizer, LeRobotNormalizer) else []
        if normalized and (problems or any(f not in features for f in normalized)):
            raise ConfigError("\n".join(problems or [f"the LeRobot checkpoint normalises cameras {normalized}: "
                                                      f"they need model slots (camera_slots {list(camera_slots)})"]))
        cameras = {slot: feature for feature, slot in features.items()}
        pipeline = (f"LeRobot pipeline (checkpoint {checkpoint}): LeRobot's resize-with-pad (bilinear, no "
                    f"antialiasing)")
        relative = np.flatnonzero(lerobot.relative_mask).tolist()
        pipeline += f", relative actions on dims {relative}" if relative else ", absolute actions"
        if config.delta_action_mask and tuple(config.delta_action_mask) != lerobot.relative_mask:
            pipeline += f" (the robot config's delta_action_mask {list(config.delta_action_mask)} is not used)"
    if norm_stats:
        stats = f"norm stats from the norm_stats parameter: {normalizer.describe()}"
    elif lerobot is not None:
        stats = f"norm stats: the LeRobot folder's own (norm_stats is empty): {normalizer.describe()}"
    else:
        stats = "norm stats: none (norm_stats is empty): no (un)normalisation"
    return PolicyIO(config, normalizer, model_action_dim, image_size, lerobot, cameras, f"{pipeline}; {stats}")
