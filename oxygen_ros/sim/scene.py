"""The reach scene in MuJoCo: a 3-joint arm, 2-3 coloured cubes at random places on a table, two cameras.

Task: "touch the <colour> cube". Success is judged from the simulator's state: the arm's tip comes within
`TOUCH_RADIUS` of the top of the named cube. The cubes are mocap bodies (they never move) and nothing
collides, so an episode is a pure reaching problem whose only difficulty is *which* cube.

Control: joint position targets, one per control period (`CONTROL_PERIOD_S`, 1/70 s = the action
publisher's tick), each held for 7 physics steps; the position servos follow with a small lag.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from importlib import resources

import numpy as np

# Mesa's llvmpipe (the CPU renderer behind EGL) and triton each load an LLVM: importing triton after a
# first render crashes the process (seen with mujoco 4.0 / triton 3.9; torch imports triton lazily, e.g.
# when an optimizer is built). Loaded in this order, both work.
try:
    import triton  # noqa: F401
except ImportError:
    pass

# EGL renders offscreen without a display (Mesa llvmpipe on a CPU); osmesa does not work with mujoco 4.
os.environ.setdefault("MUJOCO_GL", "egl")
import mujoco  # noqa: E402  (after MUJOCO_GL)

JOINT_NAMES = ("joint_1", "joint_2", "joint_3")
LOWER_LIMITS = np.array([-1.6, -0.6, 0.0])
UPPER_LIMITS = np.array([1.6, 1.7, 2.6])
COLOURS = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.75, 0.15), "blue": (0.1, 0.25, 0.95),
           "yellow": (0.95, 0.85, 0.1)}
COLOUR_NAMES = tuple(COLOURS)
# A touched cube of a multi-step task darkens, as a pressed button would (sim/tasks.py): the progress is in
# the camera image. Its colour is still its colour (questions, captions), only darker.
TOUCHED_SHADE = 0.4
MAX_CUBES = 3
CUBE_HALF = 0.025
TOUCH_RADIUS = 0.04                 # tip within 4 cm of the cube's top centre = touched
CONTROL_PERIOD_S = 1.0 / 70.0
PHYSICS_STEPS_PER_CONTROL = 7       # timestep 1/490 s in the MJCF
# Where cubes may be: a ring sector in front of the arm that the tip reaches.
RADIUS_RANGE = (0.17, 0.31)
ANGLE_RANGE = (-0.85, 0.85)
MIN_CUBE_DISTANCE = 0.09
HIDDEN = np.array([0.0, 0.0, -5.0])  # an unused cube slot sits under the floor, out of every camera


def scene_xml() -> str:
    return (resources.files("oxygen_ros.sim") / "assets" / "reach_scene.xml").read_text()


@dataclass(frozen=True)
class Layout:
    """One episode's scene: which colours, where (cube centres, metres), and the arm's start pose."""

    colours: tuple[str, ...]
    positions: np.ndarray   # [n, 3]
    start: np.ndarray       # [3] joint angles

    @classmethod
    def random(cls, rng: np.random.Generator, n_cubes: int | None = None) -> "Layout":
        n = n_cubes or int(rng.integers(2, MAX_CUBES + 1))
        colours = tuple(rng.choice(COLOUR_NAMES, size=n, replace=False).tolist())
        positions = []
        while len(positions) < n:
            r, a = rng.uniform(*RADIUS_RANGE), rng.uniform(*ANGLE_RANGE)
            p = np.array([r * np.cos(a), r * np.sin(a), CUBE_HALF])
            if all(np.linalg.norm(p[:2] - q[:2]) >= MIN_CUBE_DISTANCE for q in positions):
                positions.append(p)
        start = np.array([rng.uniform(-0.5, 0.5), rng.uniform(-0.2, 0.4), rng.uniform(0.9, 1.6)])
        return cls(colours, np.array(positions), start)

    def index(self, colour: str) -> int:
        if colour not in self.colours:
            raise ValueError(f"no {colour} cube in this scene (colours: {', '.join(self.colours)})")
        return self.colours.index(colour)


def task_prompt(colour: str) -> str:
    return f"touch the {colour} cube"


def touch_point(cube_position: np.ndarray) -> np.ndarray:
    """Where the tip should be to touch a cube: just above its top face."""
    return cube_position + np.array([0.0, 0.0, CUBE_HALF + 0.012])


@dataclass(frozen=True)
class Episode:
    """Episode k of a seed: its scene, named cube and the seed of its chunks' noise."""
    layout: Layout
    target: int
    prompt: str
    noise_seed: int
    rng: np.random.Generator        # the episode's later draws (its scene questions)


def draw_episode(seed: int, k: int) -> Episode:
    """Episode k of `seed`, drawn the same way on every path (the in-process evaluation, the simulated robot
    node, the openpi client's environment, the aim diagnosis): the same seed gives the same scenes."""
    rng = np.random.default_rng([seed, k])
    layout = Layout.random(rng)
    target = int(rng.integers(len(layout.colours)))
    return Episode(layout, target, task_prompt(layout.colours[target]), int(rng.integers(2**31)), rng)


def _release_gl_context() -> None:
    """An EGL context is current in one thread at a time, and mujoco's Renderer leaves it current after
    rendering: release it, so that another thread (a ROS executor's, the one that shuts down) may render
    or free it."""
    if os.environ.get("MUJOCO_GL") == "egl":
        from mujoco import egl

        if egl.EGL_DISPLAY is not None:
            egl.EGL.eglMakeCurrent(egl.EGL_DISPLAY, egl.EGL.EGL_NO_SURFACE, egl.EGL.EGL_NO_SURFACE,
                                   egl.EGL.EGL_NO_CONTEXT)


class ReachScene:
    """The MuJoCo model and data of one scene; `reset(layout)` starts an episode."""

    def __init__(self, image_size: int = 64):
        self.model = mujoco.MjModel.from_xml_string(scene_xml())
        self.data = mujoco.MjData(self.model)
        self.image_size = image_size
        self._renderers: dict[int, mujoco.Renderer] = {}
        # A render leaves its GL context current until it returns: close() waits for it (another thread).
        self._render_lock = threading.Lock()
        self._tip = self.model.site("tip").id
        self._qpos = [self.model.joint(n).qposadr[0] for n in JOINT_NAMES]
        self._mocap = [self.model.body(f"cube_{i}").mocapid[0] for i in range(MAX_CUBES)]
        self._cube_geoms = [self.model.body(f"cube_{i}").geomadr[0] for i in range(MAX_CUBES)]
        self.layout: Layout | None = None

    def reset(self, layout: Layout) -> None:
        mujoco.mj_resetData(self.model, self.data)
        for i in range(MAX_CUBES):
            if i < len(layout.colours):
                self.data.mocap_pos[self._mocap[i]] = layout.positions[i]
                self.model.geom_rgba[self._cube_geoms[i]] = (*COLOURS[layout.colours[i]], 1.0)
            else:
                self.data.mocap_pos[self._mocap[i]] = HIDDEN
        self.layout = layout
        self.set_joints(layout.start)

    def mark_touched(self, cube: int) -> None:
        """Darken cube `cube` (a step of a multi-step task done); `reset` restores every colour."""
        colour = np.array(COLOURS[self.layout.colours[cube]]) * TOUCHED_SHADE
        self.model.geom_rgba[self._cube_geoms[cube]] = (*colour, 1.0)

    def set_joints(self, q: np.ndarray) -> None:
        """Put the arm at q at rest (data generation, resets); the servo targets follow."""
        self.data.qpos[self._qpos] = q
        self.data.qvel[:] = 0.0
        self.data.ctrl[:] = q
        mujoco.mj_forward(self.model, self.data)

    def step(self, command: np.ndarray) -> None:
        """One control period towards joint targets `command` (clipped to the joint limits)."""
        self.data.ctrl[:] = np.clip(command, LOWER_LIMITS, UPPER_LIMITS)
        mujoco.mj_step(self.model, self.data, nstep=PHYSICS_STEPS_PER_CONTROL)

    @property
    def time(self) -> float:
        return float(self.data.time)

    def joints(self) -> np.ndarray:
        return self.data.qpos[self._qpos].copy()

    def tip(self) -> np.ndarray:
        return self.data.site_xpos[self._tip].copy()

    def distance_to(self, cube: int) -> float:
        return float(np.linalg.norm(self.tip() - touch_point(self.layout.positions[cube])))

    def touching(self) -> int | None:
        """Index of the cube the tip touches, if any."""
        for i in range(len(self.layout.colours)):
            if self.distance_to(i) <= TOUCH_RADIUS:
                return i
        return None

    def render(self, camera: str = "base", size: int | None = None) -> np.ndarray:
        """RGB uint8 [size, size, 3] from a named camera ("base" or "wrist")."""
        size = size or self.image_size
        with self._render_lock:
            if size not in self._renderers:
                self._renderers[size] = mujoco.Renderer(self.model, size, size)
            r = self._renderers[size]
            r.update_scene(self.data, camera)
            image = r.render().copy()
            _release_gl_context()
        return image

    def close(self) -> None:
        with self._render_lock:
            for r in self._renderers.values():
                r.close()
            self._renderers.clear()
