"""The debug picture of one frame (plain numpy/OpenCV, no ROS): the camera image with the action chunk
drawn on it, and the latest reply.

- End-effector path: when the chunk's rows are end-effector positions (x, y, z first, in the robot's
  base frame) and the camera is calibrated (intrinsics fx, fy, cx, cy; camera pose in the base frame,
  optical axes: z forward, x right, y down), the path is projected onto the image, first row green to
  last row red.
- Joint-target strip otherwise: one lane per action dimension under the image, the chunk's targets over
  the horizon, scaled to the dimension's limits (or to the chunk's own range when there are none).
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

import cv2
import numpy as np
from transforms3d import quaternions

from oxygen_ros.robot.ee import xyzw_to_wxyz

WIDTH = 448                 # the picture's width; the camera image is scaled to it
LANE = 18                   # strip lane height, pixels
FONT = cv2.FONT_HERSHEY_SIMPLEX


@dataclass(frozen=True)
class Camera:
    """Pinhole calibration of the camera the path is drawn on."""
    fx: float
    fy: float
    cx: float
    cy: float
    position: np.ndarray            # camera origin in the base frame
    rotation: np.ndarray            # 3x3: camera axes in the base frame (columns)

    @classmethod
    def from_params(cls, intrinsics: list[float], pose: list[float]) -> Camera:
        if len(intrinsics) != 4 or len(pose) != 7:
            raise ValueError(f"camera calibration needs intrinsics [fx, fy, cx, cy] and pose [x, y, z, qx, qy, qz, "
                             f"qw], got {len(intrinsics)} and {len(pose)} values")
        q = xyzw_to_wxyz(pose[3:])
        if not np.isfinite(q).all() or np.linalg.norm(q) < 1e-9:
            raise ValueError(f"camera pose quaternion {list(pose[3:])} is not a rotation")
        rot = quaternions.quat2mat(q / np.linalg.norm(q))
        return cls(*map(float, intrinsics), np.asarray(pose[:3], dtype=np.float64), rot)

    def project(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Base-frame points [N, 3] -> pixels [N, 2] and a mask of the points in front of the camera."""
        cam = (np.asarray(points, dtype=np.float64) - self.position) @ self.rotation
        front = cam[:, 2] > 1e-6
        z = np.where(front, cam[:, 2], 1.0)
        return np.stack([self.fx * cam[:, 0] / z + self.cx, self.fy * cam[:, 1] / z + self.cy], axis=1), front


def _ascii(text: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 else (" " if c.isspace() else "?") for c in text)


def _put(img: np.ndarray, text: str, org, scale=0.42, color=(255, 255, 255)) -> None:
    """Text on a darkened band: readable on any image (a black outline ran the letters together on a light
    background, scaled to the console's width)."""
    (w, h), base = cv2.getTextSize(text, FONT, scale, 1)
    x, y = org
    y0, y1 = max(y - h - 4, 0), min(y + base + 2, img.shape[0])
    x0, x1 = max(x - 4, 0), min(x + w + 4, img.shape[1])
    img[y0:y1, x0:x1] = (img[y0:y1, x0:x1] * 0.3).astype(np.uint8)
    cv2.putText(img, text, org, FONT, scale, color, 1, cv2.LINE_AA)


def _gradient(k: int, n: int) -> tuple[int, int, int]:
    t = k / max(n - 1, 1)
    return int(255 * t), int(255 * (1 - t)), 40           # RGB: green (first row) -> red (last row)


def draw_path(img: np.ndarray, pixels: np.ndarray, front: np.ndarray) -> int:
    """Draws the projected path; returns how many of its points land inside the image."""
    h, w = img.shape[:2]
    inside = front & (pixels[:, 0] >= 0) & (pixels[:, 0] < w) & (pixels[:, 1] >= 0) & (pixels[:, 1] < h)
    pts = np.round(pixels).astype(np.int32)
    for k in range(len(pts) - 1):
        if front[k] and front[k + 1]:
            cv2.line(img, tuple(pts[k]), tuple(pts[k + 1]), _gradient(k, len(pts)), 2, cv2.LINE_AA)
    for k in (0, len(pts) - 1):
        if inside[k]:
            cv2.circle(img, tuple(pts[k]), 4, _gradient(k, len(pts)), -1, cv2.LINE_AA)
    return int(inside.sum())


def joint_strip(actions: np.ndarray, names: list[str], lower: np.ndarray | None, upper: np.ndarray | None,
                width: int = WIDTH) -> np.ndarray:
    """[H, D] chunk -> a D-lane picture: each lane the dimension's targets over the horizon."""
    horizon, dims = actions.shape
    strip = np.full((LANE * dims, width, 3), 24, np.uint8)
    lo = np.asarray(lower, dtype=np.float64) if lower is not None else actions.min(axis=0)
    hi = np.asarray(upper, dtype=np.float64) if upper is not None else actions.max(axis=0)
    span = np.where(hi - lo > 1e-9, hi - lo, 1.0)
    x0 = 70
    xs = x0 + np.arange(horizon) * (width - x0 - 6) / max(horizon - 1, 1)
    for d in range(dims):
        top = d * LANE
        cv2.line(strip, (x0, top + LANE - 1), (width, top + LANE - 1), (60, 60, 60), 1)
        frac = np.clip((actions[:, d] - lo[d]) / span[d], 0.0, 1.0)
        ys = top + LANE - 3 - frac * (LANE - 6)
        pts = np.stack([xs, ys], axis=1).round().astype(np.int32)
        cv2.polylines(strip, [pts], False, (90, 200, 255), 1, cv2.LINE_AA)
        label = names[d] if d < len(names) else f"a{d}"
        _put(strip, f"{label[:9]}", (3, top + LANE - 5), 0.35)
    return strip


def render(image: np.ndarray, actions: np.ndarray | None, *, names=(), lower=None, upper=None,
           camera: Camera | None = None, ee_path: bool = False, prompt: str = "", reply: str = "",
           header: str = "") -> np.ndarray:
    """The debug picture: RGB uint8, WIDTH wide."""
    scale = WIDTH / image.shape[1]
    img = cv2.resize(np.ascontiguousarray(image), (WIDTH, int(round(image.shape[0] * scale))),
                     interpolation=cv2.INTER_LINEAR)
    parts = [img]
    if actions is not None and ee_path and camera is not None:
        pixels, front = camera.project(actions[:, :3])
        draw_path(img, pixels * scale, front)
    elif actions is not None:
        parts.append(joint_strip(actions, list(names), lower, upper))
    if header:
        _put(img, _ascii(header), (6, 16))
    if prompt:
        _put(img, _ascii(f"task: {prompt}")[:70], (6, img.shape[0] - 8))
    lines = textwrap.wrap(_ascii(reply), 60)[-3:] if reply else []
    text = np.full((16 * len(lines) + (6 if lines else 0), WIDTH, 3), 12, np.uint8)
    for i, line in enumerate(lines):
        _put(text, line, (6, 16 + 16 * i), 0.42, (255, 230, 120))
    parts.append(text)
    return np.ascontiguousarray(np.concatenate(parts, axis=0))
