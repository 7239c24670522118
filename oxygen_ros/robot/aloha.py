"""ALOHA <-> the π internal runtime the base model was trained in (openpi's `adapt_to_pi`).

openpi's `AlohaInputs` decodes the robot's state before normalisation and `AlohaOutputs` encodes the
actions after `AbsoluteActions` (which adds the *decoded* state). Both are here, with the constants of
openpi's aloha_policy.py (Physical-Intelligence/openpi @ 15a9616), themselves from the ALOHA and
Interbotix code:
- joints: shoulder and elbow turn the other way in the π runtime (flip mask [1, -1, -1, 1, 1, 1, 1] per arm);
- gripper state: ALOHA publishes a linear finger position, normalised between the puppet's open/closed
  positions; the π runtime used the servo angle, normalised between encoder counts 2405..3110
  (0.5476..1.6296 rad). Decoding goes back through the Interbotix horn/arm geometry;
- gripper actions: the model predicts the normalised angle; ALOHA's gripper joint command is normalised
  between the puppet's joint limits (-0.6213..1.4910).
State and action layout: [left 6 joints, left gripper, right 6 joints, right gripper].
"""
from __future__ import annotations

import numpy as np

JOINT_FLIP = np.array([1, -1, -1, 1, 1, 1, 1] * 2, dtype=np.float64)
GRIPPERS = [6, 13]
DIM = 14

PUPPET_GRIPPER_POSITION_OPEN, PUPPET_GRIPPER_POSITION_CLOSED = 0.01844, 0.05800    # metres (sic, open < closed)
PUPPET_GRIPPER_JOINT_OPEN, PUPPET_GRIPPER_JOINT_CLOSE = -0.6213, 1.4910           # rad
PI_GRIPPER_MIN, PI_GRIPPER_MAX = 0.5476, 1.6296                                   # rad: encoder 2405..3110 of 4096
ARM_LENGTH, HORN_RADIUS = 0.036, 0.022                                            # m (Interbotix)


def _check(x: np.ndarray, what: str) -> np.ndarray:
    x = np.array(x, dtype=np.float64)    # a copy: callers keep their arrays
    if x.shape[-1] != DIM:
        raise ValueError(f"ALOHA {what} must have {DIM} values (two arms of 6 joints + gripper), got {x.shape[-1]}")
    return x


def gripper_to_angular(linear: np.ndarray) -> np.ndarray:
    """ALOHA's normalised linear gripper position -> the π runtime's normalised gripper angle."""
    position = linear * (PUPPET_GRIPPER_POSITION_CLOSED - PUPPET_GRIPPER_POSITION_OPEN) + PUPPET_GRIPPER_POSITION_OPEN
    # Inverse of Interbotix's angle -> linear conversion (law of cosines on the horn and the arm).
    cos_arg = (HORN_RADIUS**2 + position**2 - ARM_LENGTH**2) / (2 * HORN_RADIUS * position)
    angle = np.arcsin(np.clip(cos_arg, -1.0, 1.0))
    return (angle - PI_GRIPPER_MIN) / (PI_GRIPPER_MAX - PI_GRIPPER_MIN)


def gripper_from_angular(value: np.ndarray) -> np.ndarray:
    """The model's gripper action -> ALOHA's normalised gripper joint command (already radians: no scale)."""
    span = PUPPET_GRIPPER_JOINT_CLOSE - PUPPET_GRIPPER_JOINT_OPEN
    return (value + PI_GRIPPER_MIN - PUPPET_GRIPPER_JOINT_OPEN) / span


def gripper_from_angular_inv(value: np.ndarray) -> np.ndarray:
    return value * (PUPPET_GRIPPER_JOINT_CLOSE - PUPPET_GRIPPER_JOINT_OPEN) + PUPPET_GRIPPER_JOINT_OPEN - PI_GRIPPER_MIN


def decode_state(state: np.ndarray) -> np.ndarray:
    """Robot state -> model state (openpi `_decode_state(adapt_to_pi=True)`)."""
    s = _check(state, "state") * JOINT_FLIP
    s[..., GRIPPERS] = gripper_to_angular(s[..., GRIPPERS])
    return s


def encode_actions(actions: np.ndarray) -> np.ndarray:
    """Model actions (absolute, un-normalised) -> robot commands (openpi `_encode_actions`)."""
    a = _check(actions, "actions") * JOINT_FLIP
    a[..., GRIPPERS] = gripper_from_angular(a[..., GRIPPERS])
    return a


def encode_actions_inv(actions: np.ndarray) -> np.ndarray:
    """Robot commands -> model actions: the training-time inverse of encode_actions."""
    a = _check(actions, "actions") * JOINT_FLIP
    a[..., GRIPPERS] = gripper_from_angular_inv(a[..., GRIPPERS])
    return a
