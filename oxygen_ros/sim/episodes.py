"""Episodes of the reach task run in wall time, for the demo's simulated robot node (no ROS here).

The world advances in whole control periods of simulated time to catch up with the clock it is given,
holding the newest joint command. An episode ends when the tip touches the named cube (success), or
after `episode_s` (failure); the next one starts after `pause_s` with a new layout and a new task prompt,
drawn from `seed`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from oxygen_ros.robot.errors import ActionError

from .questions import Question, scene_questions
from .scene import CONTROL_PERIOD_S, JOINT_NAMES, Layout, ReachScene, task_prompt

MAX_CATCH_UP_STEPS = 35     # after a stall (a slow render, a busy CPU) jump ahead instead of racing


@dataclass
class EpisodeTally:
    episodes: int = 0
    successes: int = 0

    def line(self) -> str:
        return f"{self.successes}/{self.episodes} touched"


class ReachEpisodes:
    def __init__(self, seed: int = 0, image_size: int = 64, episode_s: float = 4.0, pause_s: float = 0.7):
        self.scene = ReachScene(image_size)
        self.rng = np.random.default_rng(seed)
        self._question_rng = np.random.default_rng([seed, 1])   # questions never shift the episodes
        self.episode_s, self.pause_s = episode_s, pause_s
        self.tally = EpisodeTally()
        self.command: np.ndarray | None = None
        self.last_outcome = ""
        self._clock: float | None = None
        self._episode_start = 0.0
        self._pause_until: float | None = None
        self.episode_index = -1
        self._questions_asked = 0
        self._new_episode()

    # ------------------------------------------------------------------ state
    @property
    def layout(self) -> Layout:
        return self.scene.layout

    @property
    def prompt(self) -> str:
        return task_prompt(self.layout.colours[self.target])

    def joints(self) -> np.ndarray:
        return self.scene.joints()

    def render(self, camera: str, size: int | None = None) -> np.ndarray:
        return self.scene.render(camera, size)

    def status(self) -> str:
        return (f"task '{self.prompt}' (tip {self.scene.distance_to(self.target) * 100:.0f} cm away) | "
                f"episodes {self.tally.line()}") + (
            f", last: {self.last_outcome}" if self.last_outcome else "")

    def next_question(self) -> Question:
        """A question about the scene as it is now, with its true answer (the kinds in turn)."""
        questions = scene_questions(self.layout, self.scene.tip(), self._question_rng)
        self._questions_asked += 1
        return questions[(self._questions_asked - 1) % len(questions)]

    # ------------------------------------------------------------------ inputs
    def set_command(self, positions) -> None:
        """Joint targets in JOINT_NAMES order. ActionError on a wrong size or non-finite values."""
        try:
            q = np.array(positions, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as e:
            raise ActionError(f"command positions are not numbers ({e})") from None
        if q.size != len(JOINT_NAMES):
            raise ActionError(f"command has {q.size} positions, the arm has {len(JOINT_NAMES)} joints")
        if not np.all(np.isfinite(q)):
            raise ActionError(f"command has non-finite positions {q.tolist()}")
        self.command = q

    def set_command_by_name(self, names, positions) -> None:
        names, values = list(names), list(positions)
        if len(names) != len(values):
            raise ActionError(f"command has {len(names)} names but {len(values)} positions")
        by_name = dict(zip(names, values))
        missing = [n for n in JOINT_NAMES if n not in by_name]
        if missing:
            raise ActionError(f"command lacks joints {missing}")
        self.set_command([by_name[n] for n in JOINT_NAMES])

    # ------------------------------------------------------------------ time
    def advance(self, now: float) -> bool:
        """Simulate up to `now` (seconds, any monotonic clock). True when a new episode started."""
        if self._clock is None:
            self._clock = now
        steps = int((now - self._clock) / CONTROL_PERIOD_S)
        self._clock += steps * CONTROL_PERIOD_S
        if steps > MAX_CATCH_UP_STEPS:
            self._clock = now
            steps = MAX_CATCH_UP_STEPS
        started = False
        for _ in range(steps):
            if self._pause_until is not None:
                if self._clock >= self._pause_until:
                    self._new_episode()
                    started = True
                continue
            self.scene.step(self.command if self.command is not None else self.layout.start)
            elapsed = self.scene.time - self._episode_start
            if self.scene.touching() == self.target:
                self._finish(True, f"touched the {self.layout.colours[self.target]} cube in {elapsed:.1f} s")
            elif elapsed >= self.episode_s:
                self._finish(False, f"timed out ({self.scene.distance_to(self.target) * 100:.0f} cm away)")
        return started

    def _finish(self, success: bool, outcome: str) -> None:
        self.tally.episodes += 1
        self.tally.successes += success
        self.last_outcome = outcome
        self._pause_until = self._clock + self.pause_s

    def _new_episode(self) -> None:
        layout = Layout.random(self.rng)
        self.target = int(self.rng.integers(len(layout.colours)))
        self.scene.reset(layout)
        self.command = None          # hold the start pose until the policy's first command for this task
        self._episode_start = self.scene.time
        self._pause_until = None
        self.episode_index += 1

    def close(self) -> None:
        self.scene.close()
