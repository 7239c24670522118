"""A simulated 7-joint arm (6 revolute joints + a gripper) over a table with three objects.

Plain Python (numpy + OpenCV drawing), no ROS: the demo's `SimRobotNode` wraps it. The arm is a
position-controlled stick arm: a command is a vector of 7 target joint positions, clamped to the joint
limits; every `step(dt)` moves each joint towards its target by at most `max_speed * dt`, so the arm stays
stable whatever the policy outputs (random weights give arbitrary actions). Without new commands the
arm keeps following the last target and then holds it; before any command the target is the current
pose (hold). The arm does not pass through the table top: a step that would take a joint or the tool tip
below it is shortened, joints that can still move safely do (the arm stops on or slides along the table
instead of passing through it; the gripper always moves).

World frame: z up, the table top is the plane z = 0, the arm base stands at the origin, +x points away
from the robot across the table. Objects (fixed names and colours, positions jittered by the seed):
red cup, blue block, green bowl.

Kinematics (link lengths in metres): base column 0.30 up; joint_1 yaw about z; joint_2 shoulder pitch
about the local y axis, upper arm 0.35 along local z; joint_3 elbow pitch, forearm 0.30; joint_4 roll
about the link axis; joint_5 wrist pitch, wrist link 0.08; joint_6 roll of the tool; fingers 0.10 beyond
the flange. The gripper is the opening: 0 = closed, 1 = fully open.

Cameras: "base" is a fixed third-person pinhole view of the table, objects and arm; "wrist" is a pinhole
camera on the flange looking along the tool axis (the table, its grid and the objects in perspective, with
the two fingers overlaid at the bottom of the image, their gap following the gripper). Both images are
drawn with OpenCV on numpy: well under a millisecond per 224x224 frame on one core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from .errors import ActionError, ConfigError

JOINT_NAMES: tuple[str, ...] = ("joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6", "gripper")
NUM_JOINTS = len(JOINT_NAMES)
CAMERAS: tuple[str, ...] = ("base", "wrist")

LOWER_LIMITS = np.array([-2.9, -1.8, -2.6, -2.9, -2.1, -2.9, 0.0])
UPPER_LIMITS = np.array([2.9, 1.8, 2.6, 2.9, 2.1, 2.9, 1.0])
HOME = np.array([0.0, 0.5, 1.5, 0.0, 1.1, 0.0, 1.0])  # tool pointing down 0.3 m above the table, open
DEFAULT_MAX_SPEED = 2.0  # rad/s for the joints; opening fraction per second for the gripper

BASE_HEIGHT, UPPER_ARM, FOREARM, WRIST_LINK, FINGER_LENGTH = 0.30, 0.35, 0.30, 0.08, 0.10
TABLE_X, TABLE_Y = (-0.15, 0.85), (-0.45, 0.45)  # table top extent, metres
GRID_STEP = 0.1

_SHIFT = 4  # OpenCV fixed-point bits: sub-pixel drawing, so small joint motions change the image
_ONE = 1 << _SHIFT
_NEAR = 0.02  # near plane of the cameras, metres


@dataclass(frozen=True)
class SceneObject:
    name: str
    kind: str  # "cup" | "block" | "bowl"
    color: tuple[int, int, int]  # RGB
    position: tuple[float, float]  # x, y on the table top


# name, kind, RGB colour, nominal (x, y); the seed jitters positions by up to 3 cm.
_OBJECTS = (
    ("red cup", "cup", (200, 30, 30), (0.45, -0.20)),
    ("blue block", "block", (40, 70, 205), (0.55, 0.12)),
    ("green bowl", "bowl", (40, 160, 60), (0.30, 0.28)),
)


def _rot_z(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _rot_y(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def _circle(center: Sequence[float], radius: float, z: float, n: int = 16) -> np.ndarray:
    a = np.linspace(0.0, 2.0 * np.pi, n, endpoint=False)
    return np.stack([center[0] + radius * np.cos(a), center[1] + radius * np.sin(a), np.full(n, z)], axis=1)


def _object_pieces(obj: SceneObject) -> list[tuple[np.ndarray, tuple[int, int, int]]]:
    """3-D point sets, each drawn as the filled convex hull of its projection, in drawing order."""
    x, y = obj.position
    r, g, b = obj.color
    dark = (r * 6 // 10, g * 6 // 10, b * 6 // 10)
    light = (min(255, r + 60), min(255, g + 60), min(255, b + 60))
    if obj.kind == "cup":
        top = _circle((x, y), 0.040, 0.11)
        return [(np.vstack([_circle((x, y), 0.032, 0.0), top]), obj.color), (top, dark)]
    if obj.kind == "block":
        h = 0.03
        corners = np.array([[x + sx * h, y + sy * h, z] for z in (0.0, 2 * h) for sx, sy in
                            ((-1, -1), (1, -1), (1, 1), (-1, 1))])
        return [(corners, obj.color), (corners[4:], light)]
    if obj.kind == "bowl":
        top = _circle((x, y), 0.075, 0.05)
        return [(np.vstack([_circle((x, y), 0.040, 0.0), top]), obj.color), (top, dark)]
    raise ConfigError(f"unknown object kind {obj.kind!r}")


class _Camera:
    """Pinhole camera: rows of `rot` are the camera x (right), y (down), z (forward) axes in the world."""

    def __init__(self, eye: np.ndarray, rot: np.ndarray, focal: float, size: int):
        self.eye, self.rot, self.size = eye, rot, size
        self.focal, self.center = focal * size, (size - 1) / 2.0

    @classmethod
    def look_at(cls, eye: Sequence[float], target: Sequence[float], focal: float, size: int) -> _Camera:
        eye = np.asarray(eye, float)
        fwd = np.asarray(target, float) - eye
        fwd /= np.linalg.norm(fwd)
        right = np.cross(fwd, [0.0, 0.0, 1.0])
        right /= np.linalg.norm(right)
        down = np.cross(fwd, right)
        return cls(eye, np.stack([right, down, fwd]), focal, size)

    def to_cam(self, pts: np.ndarray) -> np.ndarray:
        return (pts - self.eye) @ self.rot.T

    def project_cam(self, pc: np.ndarray) -> np.ndarray:
        """Camera-frame points (z >= near) -> fixed-point int32 pixel coordinates."""
        uv = self.focal * pc[:, :2] / pc[:, 2:3] + self.center
        lim = 50.0 * self.size
        return np.round(np.clip(uv, -lim, lim) * _ONE).astype(np.int32)

    def depth(self, pts: np.ndarray) -> np.ndarray:
        return (pts - self.eye) @ self.rot[2]


def _clip_polygon(pc: np.ndarray) -> np.ndarray:
    """Sutherland-Hodgman against the near plane z = _NEAR (camera-frame polygon)."""
    out = []
    n = len(pc)
    for i in range(n):
        a, b = pc[i], pc[(i + 1) % n]
        a_in, b_in = a[2] >= _NEAR, b[2] >= _NEAR
        if a_in:
            out.append(a)
        if a_in != b_in:
            t = (_NEAR - a[2]) / (b[2] - a[2])
            out.append(a + t * (b - a))
    return np.array(out).reshape(-1, 3)


def _clip_segments(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Camera-frame segments a[i]-b[i] clipped to z >= _NEAR; segments fully behind are dropped."""
    a_in, b_in = a[:, 2] >= _NEAR, b[:, 2] >= _NEAR
    keep = a_in | b_in
    a, b, a_in, b_in = a[keep], b[keep], a_in[keep], b_in[keep]
    dz = b[:, 2] - a[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(dz != 0.0, (_NEAR - a[:, 2]) / dz, 0.0)[:, None]
    cut = a + t * (b - a)
    return np.where(a_in[:, None], a, cut), np.where(b_in[:, None], b, cut)


def _vertical_gradient(size: int, top: Sequence[int], bottom: Sequence[int]) -> np.ndarray:
    w = np.linspace(0.0, 1.0, size)[:, None, None]
    col = (1.0 - w) * np.asarray(top, float) + w * np.asarray(bottom, float)
    return np.ascontiguousarray(np.broadcast_to(col, (size, size, 3)).astype(np.uint8))


_TABLE_COLOR = (176, 134, 92)
_GRID_COLOR = (150, 112, 75)
_TABLE_CORNERS = np.array([[TABLE_X[0], TABLE_Y[0], 0.0], [TABLE_X[1], TABLE_Y[0], 0.0],
                           [TABLE_X[1], TABLE_Y[1], 0.0], [TABLE_X[0], TABLE_Y[1], 0.0]])


def _grid_segments() -> tuple[np.ndarray, np.ndarray]:
    xs = np.arange(TABLE_X[0] + GRID_STEP / 2, TABLE_X[1], GRID_STEP)
    ys = np.arange(TABLE_Y[0] + GRID_STEP / 2, TABLE_Y[1], GRID_STEP)
    a = [(x, TABLE_Y[0], 0.0) for x in xs] + [(TABLE_X[0], y, 0.0) for y in ys]
    b = [(x, TABLE_Y[1], 0.0) for x in xs] + [(TABLE_X[1], y, 0.0) for y in ys]
    return np.array(a), np.array(b)


_GRID_A, _GRID_B = _grid_segments()


class SimArm:
    """The simulated arm and its tabletop world. Not thread-safe: use it from one thread at a time."""

    joint_names = JOINT_NAMES
    cameras = CAMERAS

    def __init__(self, seed: int = 0, max_speed: float | Sequence[float] = DEFAULT_MAX_SPEED,
                 initial_positions: Sequence[float] | None = None, table_collision: bool = True):
        self.seed = int(seed)
        self.table_collision = bool(table_collision)
        self.lower = LOWER_LIMITS.copy()
        self.upper = UPPER_LIMITS.copy()
        speed = np.broadcast_to(np.asarray(max_speed, dtype=np.float64), (NUM_JOINTS,)).copy()
        if not np.all(np.isfinite(speed) & (speed > 0)):
            raise ConfigError(f"max_speed must be positive and finite, got {speed.tolist()}")
        self.max_speed = speed
        rng = np.random.default_rng(self.seed)
        self.objects: tuple[SceneObject, ...] = tuple(
            SceneObject(name, kind, color, (x + float(dx), y + float(dy)))
            for (name, kind, color, (x, y)), (dx, dy) in zip(_OBJECTS, rng.uniform(-0.03, 0.03, (len(_OBJECTS), 2)))
        )
        self._pieces = [_object_pieces(o) for o in self.objects]
        self._centers = np.array([[o.position[0], o.position[1], 0.05] for o in self.objects])
        self._base_bg: dict[int, np.ndarray] = {}
        self._wrist_bg: dict[int, np.ndarray] = {}
        self.reset(initial_positions)

    # ---------------------------------------------------------------- state and control

    def reset(self, positions: Sequence[float] | None = None) -> None:
        """Puts the arm at `positions` (default: HOME), at rest, holding there."""
        q = HOME if positions is None else self._validated(positions, "initial positions")
        self._q = np.clip(q, self.lower, self.upper)
        self._target = self._q.copy()
        self._velocity = np.zeros(NUM_JOINTS)
        self.time = 0.0  # simulated seconds (sum of the dt of step())

    @property
    def positions(self) -> np.ndarray:
        return self._q.copy()

    @property
    def target(self) -> np.ndarray:
        return self._target.copy()

    @property
    def velocities(self) -> np.ndarray:
        """Joint velocities over the last step (zero when holding)."""
        return self._velocity.copy()

    def _validated(self, values: Any, what: str) -> np.ndarray:
        try:
            vec = np.array(values, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ActionError(f"{what} are not numbers ({e})") from e
        if vec.shape != (NUM_JOINTS,):
            raise ActionError(f"{what} must be {NUM_JOINTS} values ({', '.join(JOINT_NAMES)}), got shape {vec.shape}")
        bad = np.flatnonzero(~np.isfinite(vec))
        if bad.size:
            raise ActionError(f"{what} have non-finite values for " +
                              ", ".join(f"{JOINT_NAMES[i]} ({vec[i]})" for i in bad))
        return vec

    def set_target(self, command: Any) -> np.ndarray:
        """7 target joint positions (joint_1..joint_6 in rad, gripper 0..1), clamped to the limits.

        Raises ActionError (a ValueError) on a wrong size, non-numbers, NaN or inf; the target is then
        unchanged. Returns the clamped target.
        """
        self._target = np.clip(self._validated(command, "command positions"), self.lower, self.upper)
        return self._target.copy()

    def set_target_by_name(self, names: Sequence[str], positions: Sequence[float]) -> np.ndarray:
        """Targets for the named joints (e.g. from a sensor_msgs/JointState); other joints keep theirs.

        Names that are not joints of this arm are ignored; at least one must be. Raises ActionError on a
        length mismatch, no known joint, a joint named twice or a non-finite known position.
        """
        names = list(names)
        try:
            values = np.array(positions, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as e:
            raise ActionError(f"command positions are not numbers ({e})") from e
        if len(names) != values.size:
            raise ActionError(f"command has {len(names)} names but {values.size} positions")
        index = {n: i for i, n in enumerate(JOINT_NAMES)}
        picked: dict[int, float] = {}
        for name, value in zip(names, values):
            if name not in index:
                continue
            if index[name] in picked:
                raise ActionError(f"command names joint {name!r} twice")
            if not np.isfinite(value):
                raise ActionError(f"command has non-finite position for {name} ({value})")
            picked[index[name]] = float(value)
        if not picked:
            raise ActionError(f"command names none of the joints {', '.join(JOINT_NAMES)} (got {names[:8]})")
        target = self._target.copy()
        target[list(picked)] = list(picked.values())
        self._target = np.clip(target, self.lower, self.upper)
        return self._target.copy()

    def step(self, dt: float) -> None:
        """Advances dt seconds: each joint moves towards its target by at most max_speed * dt."""
        dt = float(dt)
        if not np.isfinite(dt) or dt <= 0.0:
            self._velocity = np.zeros(NUM_JOINTS)
            return
        max_step = self.max_speed * dt
        delta = np.clip(self._target - self._q, -max_step, max_step)
        if self.table_collision and np.any(delta[:6]):
            delta = self._collision_free(delta)
        self._q = np.clip(self._q + delta, self.lower, self.upper)
        self._velocity = delta / dt
        self.time += dt

    def _lowest(self, q: np.ndarray) -> float:
        return float(self.forward_kinematics(q)[0][2:, 2].min())  # elbow, wrist, flange, tool tip

    def _collision_free(self, delta: np.ndarray) -> np.ndarray:
        """Shortens the arm's part of a step so that no joint or the tool tip goes below the table top
        (z = 0) -- or, if already there, deeper: the arm stops on the table instead of passing through."""
        floor = min(0.0, self._lowest(self._q))
        if self._lowest(self._q + delta) >= floor:
            return delta
        lo, hi = 0.0, 1.0  # largest safe fraction of the arm's step, by bisection
        for _ in range(6):
            mid = 0.5 * (lo + hi)
            if self._lowest(self._q + mid * delta) >= floor:
                lo = mid
            else:
                hi = mid
        out = delta.copy()
        out[:6] *= lo
        # Then each joint's remaining motion on its own where that is safe: the arm slides along the
        # table towards its target instead of sticking to it.
        for j in range(6):
            if delta[j] != out[j]:
                trial = out.copy()
                trial[j] = delta[j]
                if self._lowest(self._q + trial) >= floor:
                    out = trial
        return out

    def apply(self, command: Any, dt: float) -> None:
        """set_target(command), then step(dt)."""
        self.set_target(command)
        self.step(dt)

    # ---------------------------------------------------------------- kinematics

    def forward_kinematics(self, q: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """-> (points, tool_rotation): points are the base foot, shoulder, elbow, wrist, flange and tool
        tip (6x3, world frame); tool_rotation's columns are the tool x, y, z axes (z along the fingers)."""
        q = self._q if q is None else np.asarray(q, float)
        pts = [np.zeros(3), np.array([0.0, 0.0, BASE_HEIGHT])]
        rot = _rot_z(q[0]) @ _rot_y(q[1])
        pts.append(pts[-1] + UPPER_ARM * rot[:, 2])
        rot = rot @ _rot_y(q[2])
        pts.append(pts[-1] + FOREARM * rot[:, 2])
        rot = rot @ _rot_z(q[3]) @ _rot_y(q[4])
        pts.append(pts[-1] + WRIST_LINK * rot[:, 2])
        rot = rot @ _rot_z(q[5])
        pts.append(pts[-1] + FINGER_LENGTH * rot[:, 2])
        return np.array(pts), rot

    def ee_position(self) -> np.ndarray:
        """Tool tip (between the fingertips), world frame."""
        return self.forward_kinematics()[0][-1]

    # ---------------------------------------------------------------- rendering

    def render(self, camera: str, size: int = 224) -> np.ndarray:
        """-> size x size x 3 uint8 RGB image of `camera` ("base" or "wrist")."""
        size = int(size)
        if size < 8 or size > 4096:
            raise ConfigError(f"image size {size} is out of range (8..4096)")
        if camera == "base":
            return self._render_base(size)
        if camera == "wrist":
            return self._render_wrist(size)
        raise ConfigError(f"unknown camera {camera!r} (known: {', '.join(CAMERAS)})")

    def _base_camera(self, size: int) -> _Camera:
        return _Camera.look_at((0.55, -0.95, 0.78), (0.33, 0.02, 0.22), focal=0.8, size=size)

    def _draw_scene(self, img: np.ndarray, cam: _Camera) -> None:
        """Table, its grid and the objects (far to near), clipped to the near plane."""
        table = _clip_polygon(cam.to_cam(_TABLE_CORNERS))
        if len(table) >= 3:
            cv2.fillPoly(img, [cam.project_cam(table)], _TABLE_COLOR, cv2.LINE_AA, _SHIFT)
        a, b = _clip_segments(cam.to_cam(_GRID_A), cam.to_cam(_GRID_B))
        if len(a):
            pa, pb = cam.project_cam(a), cam.project_cam(b)
            width = max(1, cam.size // 224)
            for p, q in zip(pa.tolist(), pb.tolist()):
                cv2.line(img, p, q, _GRID_COLOR, width, cv2.LINE_AA, _SHIFT)
        for k in np.argsort(-cam.depth(self._centers)):
            for pts, color in self._pieces[k]:
                pc = cam.to_cam(pts)
                pc = pc[pc[:, 2] >= _NEAR]
                if len(pc) >= 3:
                    cv2.fillConvexPoly(img, cv2.convexHull(cam.project_cam(pc)), color, cv2.LINE_AA, _SHIFT)

    def _render_base(self, size: int) -> np.ndarray:
        cam = self._base_camera(size)
        bg = self._base_bg.get(size)
        if bg is None:  # the table and objects do not move: drawn once per size
            bg = _vertical_gradient(size, (205, 215, 228), (120, 124, 130))
            self._draw_scene(bg, cam)
            self._base_bg[size] = bg
        img = bg.copy()
        pts, rot = self.forward_kinematics()
        # Shadow of the hand on the table: a depth cue for height.
        hand = pts[4:6].mean(axis=0)
        if hand[2] > 0.0 and TABLE_X[0] < hand[0] < TABLE_X[1] and TABLE_Y[0] < hand[1] < TABLE_Y[1]:
            ring = _circle(hand[:2], 0.035, 0.0, n=12)
            pc = cam.to_cam(ring)
            if np.all(pc[:, 2] >= _NEAR):
                cv2.fillConvexPoly(img, cam.project_cam(pc), (120, 90, 62), cv2.LINE_AA, _SHIFT)
        pc = cam.to_cam(pts)
        if np.any(pc[:, 2] < _NEAR):  # the arm reached behind the camera: not drawn
            return img
        uv = cam.project_cam(pc).tolist()
        scale = cam.focal / pc[:, 2]  # pixels per metre at each point
        radii = (0.045, 0.04, 0.032, 0.026, 0.02)
        colors = ((70, 70, 78), (225, 225, 230), (225, 225, 230), (205, 205, 212), (190, 190, 198))
        for i, (r, col) in enumerate(zip(radii, colors)):
            width = max(1, int(round(r * 2 * 0.5 * (scale[i] + scale[i + 1]))))
            if i == 4:  # the flange-to-tip segment is drawn as fingers below
                break
            cv2.line(img, uv[i], uv[i + 1], (40, 40, 46), width + 2, cv2.LINE_AA, _SHIFT)
            cv2.line(img, uv[i], uv[i + 1], col, width, cv2.LINE_AA, _SHIFT)
        for i in (1, 2, 3):
            cv2.circle(img, uv[i], int(0.035 * scale[i] * _ONE), (235, 120, 30), -1, cv2.LINE_AA, _SHIFT)
        # Gripper: a palm across the flange and two fingers; the gap follows the opening.
        flange, x_axis, z_axis = pts[4], rot[:, 0], rot[:, 2]
        half = 0.012 + 0.038 * float(self._q[6])
        finger = np.array([flange + 0.05 * x_axis, flange - 0.05 * x_axis,
                           flange + half * x_axis, flange + half * x_axis + FINGER_LENGTH * z_axis,
                           flange - half * x_axis, flange - half * x_axis + FINGER_LENGTH * z_axis])
        fc = cam.to_cam(finger)
        if np.all(fc[:, 2] >= _NEAR):
            fuv = cam.project_cam(fc).tolist()
            width = max(1, int(round(0.018 * scale[4])))
            for a, b in ((0, 1), (2, 3), (4, 5)):
                cv2.line(img, fuv[a], fuv[b], (55, 55, 60), width, cv2.LINE_AA, _SHIFT)
        return img

    def _wrist_camera(self, size: int) -> _Camera:
        pts, rot = self.forward_kinematics()
        x_tool, y_tool, z_tool = rot[:, 0], rot[:, 1], rot[:, 2]
        # Image down = tool x, forward = tool z; a little behind the fingers, off the axis.
        eye = pts[4] - 0.02 * z_tool + 0.03 * x_tool
        return _Camera(eye, np.stack([-y_tool, x_tool, z_tool]), focal=0.55, size=size)

    def _render_wrist(self, size: int) -> np.ndarray:
        bg = self._wrist_bg.get(size)
        if bg is None:
            bg = _vertical_gradient(size, (150, 150, 156), (96, 98, 104))
            self._wrist_bg[size] = bg
        img = bg.copy()
        self._draw_scene(img, self._wrist_camera(size))
        # Fingers, fixed to the camera: two dark trapezoids at the bottom, gap from the gripper opening.
        s = size / 224.0
        gap = (14.0 + 56.0 * float(self._q[6])) * s
        c, bottom, tip = (size - 1) / 2.0, float(size), size * 0.62
        for sign in (-1.0, 1.0):
            inner_tip, inner_base = c + sign * gap, c + sign * (gap + 10.0 * s)
            poly = np.array([[inner_tip, tip], [inner_tip + sign * 22.0 * s, tip],
                             [inner_base + sign * 42.0 * s, bottom], [inner_base, bottom]])
            cv2.fillConvexPoly(img, np.round(poly * _ONE).astype(np.int32), (58, 58, 64), cv2.LINE_AA, _SHIFT)
        return img
