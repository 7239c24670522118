"""The scripted expert of the reach task: analytic inverse kinematics of the 3-joint arm and a joint-space
straight line at a bounded speed towards the touch pose. Its action chunks are the training targets."""
from __future__ import annotations

import numpy as np

from .scene import CONTROL_PERIOD_S, LOWER_LIMITS, UPPER_LIMITS

SHOULDER_HEIGHT = 0.12      # joint_2's axis above the table (MJCF: 0.06 + 0.06)
UPPER_ARM = 0.2
FOREARM = 0.2
MAX_JOINT_SPEED = 1.5       # rad/s on the joint that moves most; the others are scaled to arrive together


def inverse_kinematics(target: np.ndarray) -> np.ndarray:
    """Joint angles that put the tip at `target` (x, y, z), elbow bent forward."""
    x, y, z = target
    yaw = np.arctan2(y, x)
    r, dz = np.hypot(x, y), z - SHOULDER_HEIGHT
    d2 = r * r + dz * dz
    cos_elbow = (d2 - UPPER_ARM**2 - FOREARM**2) / (2 * UPPER_ARM * FOREARM)
    elbow = np.arccos(np.clip(cos_elbow, -1.0, 1.0))
    shoulder = np.arctan2(r, dz) - np.arctan2(FOREARM * np.sin(elbow), UPPER_ARM + FOREARM * np.cos(elbow))
    return np.clip(np.array([yaw, shoulder, elbow]), LOWER_LIMITS, UPPER_LIMITS)


def forward_kinematics(q: np.ndarray) -> np.ndarray:
    yaw, shoulder, elbow = q
    r = UPPER_ARM * np.sin(shoulder) + FOREARM * np.sin(shoulder + elbow)
    z = SHOULDER_HEIGHT + UPPER_ARM * np.cos(shoulder) + FOREARM * np.cos(shoulder + elbow)
    return np.array([r * np.cos(yaw), r * np.sin(yaw), z])


def expert_chunk(q: np.ndarray, goal: np.ndarray, horizon: int) -> np.ndarray:
    """The next `horizon` joint targets [horizon, 3] from joint state q towards goal angles."""
    step = MAX_JOINT_SPEED * CONTROL_PERIOD_S
    delta = goal - q
    n_steps = np.abs(delta).max() / step
    k = np.arange(1, horizon + 1)[:, None]
    fraction = np.minimum(k / max(n_steps, 1e-9), 1.0)
    return q[None, :] + fraction * delta[None, :]
