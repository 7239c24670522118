"""The demo's MuJoCo arm behind LeRobot's Robot interface.

Observations: `joint_1.pos`..`joint_3.pos` (radians) and the `base` camera ([h, w, 3] uint8), the keys of
oxygen_ros's LeRobot mapping `demo`. Each `send_action` is one control tick: the joint targets are applied
for one control period of simulated time (1/70 s). The episode ends when the tip touches the named cube
(success) or after `steps` ticks; the outcome goes to `result_file` and later actions are ignored (the arm
holds). The simulation advances only when an action comes: a client waiting for its next chunk holds the
arm, as a position-controlled arm holds its last target.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
from lerobot.robots.robot import Robot

from .config_oxygen_demo import OxygenDemoConfig

JOINTS = ("joint_1", "joint_2", "joint_3")
CAMERA = "base"


class OxygenDemo(Robot):
    config_class = OxygenDemoConfig
    name = "oxygen_demo"

    def __init__(self, config: OxygenDemoConfig):
        super().__init__(config)
        self.config = config
        self.scene = None
        self._lock = threading.Lock()       # the control loop and a disconnect may overlap
        self._tick, self._done, self._touched_other = 0, False, False

    @property
    def observation_features(self) -> dict:
        size = self.config.image_size
        return {f"{j}.pos": float for j in JOINTS} | {CAMERA: (size, size, 3)}

    @property
    def action_features(self) -> dict:
        return {f"{j}.pos": float for j in JOINTS}

    @property
    def is_connected(self) -> bool:
        return self.scene is not None

    @property
    def is_calibrated(self) -> bool:
        return True

    def calibrate(self) -> None:
        pass

    def configure(self) -> None:
        pass

    def connect(self, calibrate: bool = True) -> None:
        from oxygen_ros.sim.scene import ReachScene, draw_episode

        self.episode = draw_episode(self.config.seed, self.config.episode)
        self.scene = ReachScene(self.config.image_size)
        self.scene.reset(self.episode.layout)
        self._started = time.monotonic()

    def get_observation(self) -> dict:
        with self._lock:
            joints = self.scene.joints()
            image = self.scene.render(CAMERA)
        return {f"{j}.pos": float(q) for j, q in zip(JOINTS, joints)} | {CAMERA: image}

    def send_action(self, action: dict) -> dict:
        with self._lock:
            if self._done:
                return action
            self.scene.step(np.array([action[f"{j}.pos"] for j in JOINTS], dtype=np.float64))
            self._tick += 1
            touched = self.scene.touching()
            success = touched == self.episode.target
            self._touched_other |= touched is not None and not success
            if success or self._tick >= self.config.steps:
                self._finish(success)
        return action

    def _finish(self, success: bool) -> None:
        self._done = True
        outcome = {"seed": self.config.seed, "episode": self.config.episode, "prompt": self.episode.prompt,
                   "success": bool(success), "steps": self._tick, "touched_other_first": self._touched_other,
                   "final_distance_cm": round(100 * self.scene.distance_to(self.episode.target), 1),
                   "wall_s": round(time.monotonic() - self._started, 2)}
        if self.config.result_file:
            path = Path(self.config.result_file)
            path.with_suffix(".tmp").write_text(json.dumps(outcome))
            path.with_suffix(".tmp").replace(path)          # whole or absent: the driver polls for it

    def disconnect(self) -> None:
        with self._lock:
            if self.scene is not None:
                self.scene.close()
                self.scene = None
