"""End-effector actions <-> ROS poses and twists.

Quaternion order: ROS messages (geometry_msgs/Quaternion) and this module's public functions use
(x, y, z, w); transforms3d uses (w, x, y, z). The conversion happens here and nowhere else.
Returned quaternions are unit length with w >= 0 (q and -q are the same rotation; one sign makes
outputs deterministic and keeps axis-angle angles in [0, pi]).

Rotation conventions of the action's rotation part, after the position (x, y, z):
- "axis_angle": a rotation vector (axis * angle, radians), 3 values;
- "euler_xyz": roll, pitch, yaw about the fixed x, y, z axes (transforms3d "sxyz", what ROS's
  tf2 setRPY uses: R = Rz(yaw) Ry(pitch) Rx(roll)), 3 values;
- "quaternion_wxyz": (w, x, y, z), 4 values, normalised here.
Values after the pose (a gripper, ...) are the caller's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from transforms3d import euler, quaternions

from .errors import ActionError, ConfigError

ROTATION_SIZES = {"axis_angle": 3, "euler_xyz": 3, "quaternion_wxyz": 4}
_TINY = 1e-12  # below this a rotation vector is the identity and a quaternion has no direction


def wxyz_to_xyzw(q: Any) -> np.ndarray:
    return np.asarray(q, dtype=np.float64)[[1, 2, 3, 0]]


def xyzw_to_wxyz(q: Any) -> np.ndarray:
    return np.asarray(q, dtype=np.float64)[[3, 0, 1, 2]]


def _rotation_size(rotation: str) -> int:
    if rotation not in ROTATION_SIZES:
        raise ConfigError(f"unknown rotation {rotation!r} (supported: {', '.join(ROTATION_SIZES)})")
    return ROTATION_SIZES[rotation]


def _leading(values: Any, size: int, what: str) -> np.ndarray:
    """The first `size` values as finite float64."""
    try:
        vec = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as e:
        raise ActionError(f"{what} is not numbers ({e})") from e
    if vec.size < size:
        raise ActionError(f"{what} needs at least {size} values, got {vec.size}")
    vec = vec[:size]
    bad = np.flatnonzero(~np.isfinite(vec))
    if bad.size:
        raise ActionError(f"{what} has non-finite values at indices {bad.tolist()}")
    return vec


def _unit_wxyz(q: np.ndarray, what: str) -> np.ndarray:
    norm = np.linalg.norm(q)
    if norm < _TINY:
        raise ActionError(f"{what} has zero length and is no rotation")
    q = q / norm
    return -q if q[0] < 0 else q


def pose_from_action(action: Any, rotation: str = "axis_angle") -> tuple[np.ndarray, np.ndarray]:
    """action[:6 or 7] -> (position [3], quaternion [4] in ROS order x, y, z, w)."""
    size = 3 + _rotation_size(rotation)
    vec = _leading(action, size, f"pose action ({rotation})")
    position, rot = vec[:3].copy(), vec[3:]
    if rotation == "axis_angle":
        angle = np.linalg.norm(rot)
        if angle < _TINY:
            q = np.array([1.0, 0.0, 0.0, 0.0])
        else:
            q = quaternions.axangle2quat(rot / angle, angle, is_normalized=True)
    elif rotation == "euler_xyz":
        q = euler.euler2quat(*rot, axes="sxyz")
    else:
        q = rot
    return position, wxyz_to_xyzw(_unit_wxyz(np.asarray(q), f"rotation of pose action ({rotation})"))


def action_from_pose(position: Any, quaternion_xyzw: Any, rotation: str = "axis_angle") -> np.ndarray:
    """The inverse of pose_from_action: (position, ROS-order quaternion) -> action [6 or 7]."""
    _rotation_size(rotation)
    position = _leading(position, 3, "position")
    q = _unit_wxyz(xyzw_to_wxyz(_leading(quaternion_xyzw, 4, "quaternion")), "quaternion")
    if rotation == "axis_angle":
        axis, angle = quaternions.quat2axangle(q)
        rot = np.asarray(axis) * angle
    elif rotation == "euler_xyz":
        rot = np.asarray(euler.quat2euler(q, axes="sxyz"))
    else:
        rot = q
    return np.concatenate([position, rot])


def twist_from_action(action: Any) -> tuple[np.ndarray, np.ndarray]:
    """action[:6] -> (linear [3], angular [3]) for a geometry_msgs/Twist."""
    vec = _leading(action, 6, "twist action")
    return vec[:3].copy(), vec[3:].copy()
