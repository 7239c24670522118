"""openpi's observation keys per robot config -> the package's Observation (oxygen_ros/robot/sync.py).

What each openpi example client sends (and openpi's `DroidInputs`, `AlohaInputs`, `LiberoInputs` read):

    droid   observation/exterior_image_1_left, observation/wrist_image_left, observation/joint_position (7),
            observation/gripper_position (1, or a scalar), prompt
    aloha   images: {cam_high, cam_low, cam_left_wrist, cam_right_wrist} (CHW or HWC; cam_high required,
            a missing wrist camera is masked, cam_low is accepted and unused as in openpi's pi05 inputs),
            state (14), prompt
    libero  observation/image, observation/wrist_image, observation/state (8), prompt
    demo    observation/image (the demo arm's base camera), observation/state (3 joints), prompt

Images are parsed as openpi parses them: a float image becomes uint8 as (255 x value) truncated, a
3-channel-first image is turned to HWC; the package's policy I/O (rotation, resize_with_pad, the state's
input transform and normalisation, the same code the openpi-exact oracle case_e checks) then runs in the
engine. Keys a layout does not use are ignored, as openpi's input transforms ignore them. Every problem of a
message is listed in one InputError.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from oxygen_ros.robot.errors import InputError
from oxygen_ros.robot.sync import Observation
from oxygen_ros.robot.text import validate_text

MAX_PROMPT_CHARS = 2000



def checked_prompt(prompt, what: str, problems: list[str], missing: str):
    """The prompt a client sent (or the server's default), validated; a problem listed instead when it is
    missing or bad (the caller raises once, with every problem of the observation)."""
    if prompt is None:
        problems.append(missing)
        return None
    try:
        return validate_text(prompt, what=what, max_chars=MAX_PROMPT_CHARS)
    except InputError as e:
        problems.append(str(e))
        return prompt

@dataclass(frozen=True)
class Camera:
    path: tuple[str, ...]      # where the image is in the message: ("observation/image",), ("images", "cam_high")
    slot: str                  # the model's camera slot
    required: bool = True

    @property
    def key(self) -> str:
        return ".".join(self.path)


@dataclass(frozen=True)
class StatePart:
    key: str
    size: int
    scalar_ok: bool = False    # openpi's DroidInputs takes the gripper position as a 0-d value too


@dataclass(frozen=True)
class Layout:
    name: str
    cameras: tuple[Camera, ...]
    state: tuple[StatePart, ...]          # concatenated in this order
    unused_cameras: tuple[str, ...] = ()  # accepted under the images map, not fed to the model (ALOHA cam_low)

    @property
    def slots(self) -> tuple[str, ...]:
        return tuple(c.slot for c in self.cameras)

    @property
    def state_dim(self) -> int:
        return sum(p.size for p in self.state)

    def keys(self) -> list[str]:
        return [c.key for c in self.cameras] + [p.key for p in self.state] + ["prompt"]

    def has_observation(self, message: dict) -> bool:
        return any(c.path[0] in message for c in self.cameras) or any(p.key in message for p in self.state)

    def describe(self) -> dict:
        """For the server's metadata: the keys a client sends."""
        return {"layout": self.name,
                "images": {c.key: {"slot": c.slot, "required": c.required} for c in self.cameras},
                "state": {p.key: p.size for p in self.state}, "prompt": "prompt"}

    def observation(self, message: dict, stamp: float, default_prompt: str | None = None) -> Observation:
        """The message as an Observation stamped `stamp`; InputError listing every problem."""
        problems: list[str] = []
        images = {}
        for camera in self.cameras:
            value, problem = _lookup(message, camera.path)
            if problem:
                problems.append(problem)
            elif value is None:
                if camera.required:
                    problems.append(f"missing image {camera.key}")
            else:
                try:
                    images[camera.slot] = parse_image(value, camera.key)
                except InputError as e:
                    problems.append(str(e))
        problems += self._unknown_cameras(message)
        parts = []
        for part in self.state:
            try:
                parts.append(parse_state(message.get(part.key), part))
            except InputError as e:
                problems.append(str(e))
        prompt = checked_prompt(message.get("prompt", default_prompt), "prompt", problems,
                                "missing prompt (openpi's 'prompt' key; or start the server with --default-prompt)")
        if problems:
            raise InputError(f"bad {self.name} observation: " + "; ".join(problems))
        return Observation(stamp_s=stamp, images=dict(images), image_masks={s: True for s in images},
                           state=np.concatenate(parts), prompt=prompt)

    def _unknown_cameras(self, message: dict) -> list[str]:
        """openpi's AlohaInputs refuses camera names it does not know; so does this."""
        nested = {c.path[0] for c in self.cameras if len(c.path) == 2}
        out = []
        for key in nested:
            group = message.get(key)
            if isinstance(group, dict):
                known = {c.path[1] for c in self.cameras if c.path[0] == key} | set(self.unused_cameras)
                unknown = sorted(str(k) for k in group if k not in known)
                if unknown:
                    out.append(f"{key} has unknown cameras {unknown}: expected some of {sorted(known)}")
        return out


def _lookup(message: dict, path: tuple[str, ...]):
    """(value or None, problem or '')."""
    value = message
    for i, key in enumerate(path):
        if not isinstance(value, dict):
            return None, f"{'.'.join(path[:i])} must be a map of camera name -> image, got {type(value).__name__}"
        value = value.get(key)
        if value is None:
            return None, ""
    return value, ""


def parse_image(value, key: str) -> np.ndarray:
    """An image as openpi's clients send it -> uint8 [H, W, 3]. Channels first when the first axis has 3
    (openpi's `_parse_image`), else last; a float image must lie in [0, 1] and becomes uint8 the way openpi
    converts it, (255 x value) truncated."""
    if not isinstance(value, np.ndarray):
        raise InputError(f"{key} must be an image array, got {type(value).__name__}")
    img = value
    if img.ndim != 3 or 3 not in (img.shape[0], img.shape[-1]):
        raise InputError(f"{key} must be an RGB image [H, W, 3] or [3, H, W], got shape {list(img.shape)}")
    if img.shape[0] == 3:
        img = np.moveaxis(img, 0, -1)
    if img.shape[0] == 0 or img.shape[1] == 0:
        raise InputError(f"{key} is empty: shape {list(value.shape)}")
    if np.issubdtype(img.dtype, np.floating):
        if not np.all(np.isfinite(img)) or img.min() < 0.0 or img.max() > 1.0:
            raise InputError(f"{key}: a float image must hold values in [0, 1] (openpi scales it by 255), got "
                             f"values in [{np.nanmin(img):.3g}, {np.nanmax(img):.3g}]"
                             + ("" if np.all(np.isfinite(img)) else " and non-finite values"))
        img = (255 * img).astype(np.uint8)
    elif img.dtype != np.uint8:
        raise InputError(f"{key} must be uint8 (or float in [0, 1]), got {img.dtype}")
    return np.array(img, order="C")             # our own copy: the message's bytes are read-only


def parse_state(value, part: StatePart) -> np.ndarray:
    if value is None:
        raise InputError(f"missing {part.key} ({part.size} values)")
    try:
        s = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"{part.key} must be {part.size} numbers, got {type(value).__name__}") from None
    if s.ndim == 0 and part.scalar_ok:
        s = s.reshape(1)
    if s.shape != (part.size,):
        raise InputError(f"{part.key} must have shape [{part.size}], got {list(s.shape)}")
    bad = np.flatnonzero(~np.isfinite(s))
    if bad.size:
        raise InputError(f"{part.key} has non-finite values at {bad.tolist()}: {s[bad].tolist()}")
    return s


LAYOUTS: dict[str, Layout] = {
    "droid": Layout("droid", (Camera(("observation/exterior_image_1_left",), "base_0_rgb"),
                              Camera(("observation/wrist_image_left",), "left_wrist_0_rgb")),
                    (StatePart("observation/joint_position", 7),
                     StatePart("observation/gripper_position", 1, scalar_ok=True))),
    "aloha": Layout("aloha", (Camera(("images", "cam_high"), "base_0_rgb"),
                              Camera(("images", "cam_left_wrist"), "left_wrist_0_rgb", required=False),
                              Camera(("images", "cam_right_wrist"), "right_wrist_0_rgb", required=False)),
                    (StatePart("state", 14),), unused_cameras=("cam_low",)),
    "libero": Layout("libero", (Camera(("observation/image",), "base_0_rgb"),
                                Camera(("observation/wrist_image",), "left_wrist_0_rgb")),
                     (StatePart("observation/state", 8),)),
    "demo": Layout("demo", (Camera(("observation/image",), "base_0_rgb"),), (StatePart("observation/state", 3),)),
}


# ------------------------------------------------------------------------------------------ LeRobot clients
STATE_FEATURE = "observation.state"
IMAGE_PREFIX = "observation.images."


@dataclass(frozen=True)
class LeRobotCamera:
    name: str                  # the camera's name in the LeRobot robot config (--robot.cameras="{front: ...}")
    slot: str                  # the model's camera slot
    required: bool = True


@dataclass(frozen=True)
class LeRobotLayout:
    """What a LeRobot robot sends (its `get_observation()`: one float per `<motor>.pos` key, an HWC uint8
    image per camera name, plus the client's "task") and where it goes: the joints in this order are the
    state, the cameras fill model slots, the task is the prompt."""

    name: str
    joints: tuple[str, ...]
    cameras: tuple[LeRobotCamera, ...]

    @property
    def slots(self) -> tuple[str, ...]:
        return tuple(c.slot for c in self.cameras)

    def feature_problems(self, features, rename_map: dict[str, str]) -> list[str]:
        """How the client's `lerobot_features` (LeRobot's hw_to_dataset_features of its robot) fail to match
        this layout: missing or extra joints and cameras by name, wrong image shapes. [] when they match."""
        if not isinstance(features, dict):
            return [f"lerobot_features must be a dict, got {type(features).__name__}"]
        out = []
        state = features.get(STATE_FEATURE)
        names = state.get("names") if isinstance(state, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            out.append(f"no {STATE_FEATURE} feature with its joint names (expected {list(self.joints)})")
        else:
            missing = [j for j in self.joints if j not in names]
            extra = [n for n in names if n not in self.joints]
            if missing:
                out.append(f"missing joints {missing}")
            if extra:
                out.append(f"extra joints {extra} (the {self.name} config has {list(self.joints)})")
            if not missing and not extra and tuple(names) != self.joints:
                out.append(f"joints in the order {names}; the {self.name} config's order is {list(self.joints)}")
        cameras = {}
        for key, value in features.items():
            if key.startswith(IMAGE_PREFIX):
                cameras[self.camera_name(key[len(IMAGE_PREFIX):], rename_map)] = value
            elif key != STATE_FEATURE:
                out.append(f"unexpected feature {key!r}")
        known = {c.name for c in self.cameras}
        missing = [c.name for c in self.cameras if c.required and c.name not in cameras]
        extra = sorted(n for n in cameras if n not in known)
        if missing:
            out.append(f"missing cameras {missing}")
        if extra:
            out.append(f"extra cameras {extra} (the {self.name} config has {sorted(known)}; rename them with the "
                       f"client's rename_map, e.g. {{'observation.images.{extra[0]}': "
                       f"'observation.images.{self.cameras[0].name}'}})")
        for name, value in cameras.items():
            shape = value.get("shape") if isinstance(value, dict) else None
            if name in known and (not isinstance(shape, (tuple, list)) or len(shape) != 3 or shape[2] != 3):
                out.append(f"camera {name}: an RGB image (H, W, 3) is needed, the client declares shape {shape}")
        return out

    @staticmethod
    def camera_name(name: str, rename_map: dict[str, str]) -> str:
        renamed = rename_map.get(IMAGE_PREFIX + name)
        return renamed[len(IMAGE_PREFIX):] if isinstance(renamed, str) and renamed.startswith(IMAGE_PREFIX) else name

    def observation(self, raw: dict, stamp: float, prompt_default: str | None,
                    rename_map: dict[str, str]) -> Observation:
        """A LeRobot raw observation as an Observation stamped `stamp`; InputError listing every problem."""
        problems = []
        state = []
        for joint in self.joints:
            value = raw.get(joint)
            if isinstance(value, np.ndarray) and value.shape == ():
                value = value[()]
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
                problems.append(f"{joint} must be a number, got {type(value).__name__ if value is not None else 'nothing'}")
            elif not np.isfinite(value):
                problems.append(f"{joint} is {value}")
            else:
                state.append(float(value))
        by_name = {self.camera_name(k, rename_map): v for k, v in raw.items() if isinstance(k, str)}
        images = {}
        for camera in self.cameras:
            value = by_name.get(camera.name)
            if value is None:
                if camera.required:
                    problems.append(f"missing camera {camera.name}")
                continue
            if hasattr(value, "numpy") and callable(value.numpy):      # a torch tensor from a plugin robot
                value = value.numpy()
            if (not isinstance(value, np.ndarray) or value.dtype != np.uint8 or value.ndim != 3
                    or value.shape[2] != 3 or 0 in value.shape):
                problems.append(f"camera {camera.name} must be a uint8 RGB image (H, W, 3), got "
                                f"{getattr(value, 'dtype', type(value).__name__)} {list(getattr(value, 'shape', []))}")
                continue
            images[camera.slot] = np.ascontiguousarray(value)
        task = raw.get("task")
        prompt = checked_prompt(task if isinstance(task, str) and task.strip() else prompt_default, "task", problems,
                                "no task (robot_client's --task) and no default prompt (oxygen_serve --default-prompt)")
        if problems:
            raise InputError(f"bad {self.name} observation: " + "; ".join(problems))
        return Observation(stamp_s=stamp, images=images, image_masks={s: True for s in images},
                           state=np.asarray(state, dtype=np.float64), prompt=prompt)


SO101_JOINTS = tuple(f"{m}.pos" for m in ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll",
                                           "gripper"))
LEROBOT_LAYOUTS: dict[str, LeRobotLayout] = {
    # LeRobot's SO-101 (and SO-100) follower: degrees for the body joints (use_degrees, LeRobot's default),
    # 0..100 for the gripper; a "front" camera, optionally a "wrist" one.
    "so101": LeRobotLayout("so101", SO101_JOINTS, (LeRobotCamera("front", "base_0_rgb"),
                                                    LeRobotCamera("wrist", "left_wrist_0_rgb", required=False))),
    # The demo's MuJoCo arm as a LeRobot robot: three joints (radians), the base camera.
    "demo": LeRobotLayout("demo", ("joint_1.pos", "joint_2.pos", "joint_3.pos"), (LeRobotCamera("base", "base_0_rgb"),)),
}
