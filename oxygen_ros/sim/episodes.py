"""Episodes of the reach task run in wall time, for the demo's simulated robot node (no ROS here).

The world advances in whole control periods of simulated time to catch up with the clock it is given,
holding the newest joint command. Each episode has two phases:
- *ready* (`pause_s`): the new layout is shown and its task announced (`advance` returns True: the node
  publishes the prompt), the arm holds its start pose and commands are ignored. Commands in flight were
  computed for the previous task and pose (chunks in the action publisher, its velocity limit ramping
  from the last command): executed, they yanked the arm back towards where the last episode ended, and
  the first task was not announced before its episode was over.
- *running*: the newest command is followed; the episode ends when the tip touches the named cube
  (success) or after `episode_s` (failure), and the next ready phase starts.
Episode k's layout and named cube are drawn from seed (seed, k), as the in-process evaluation draws its
episode k (oxygen_ros/eval.py): the same seed gives the same scenes on both paths.

`multistep=True`: each episode is a 2-3 step task (sim/tasks.py: "touch the red cube, then the blue one",
"touch every cube from left to right"), drawn as the multi-step evaluation draws it, judged step by step
(a touched cube darkens), with `episode_s` per step; `subtask` and `memory` are the simulator's truth of the
current step, against which the demo judges the model's own.

Around each ready phase the node switches the policy's output off and on again (ResetSwitch), as an
operator resetting a scene does: the engine then knows the chunks are not played, and real-time chunking
does not continue them across the reset (docs/rtc.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from oxygen_ros.robot.errors import ActionError

from .questions import Question, scene_questions
from .scene import CONTROL_PERIOD_S, JOINT_NAMES, Layout, ReachScene, draw_episode
from .tasks import StepJudge, draw_multistep_episode, named_task, progress_memory, subtask_text

MAX_CATCH_UP_STEPS = 35     # after a stall (a slow render, a busy CPU) jump ahead instead of racing


@dataclass(frozen=True)
class EpisodeOutcome:
    index: int
    prompt: str
    success: bool
    seconds: float          # simulated time from the start of the running phase
    distance_cm: float      # tip to the named cube's touch point at the end
    steps_done: int = 1
    steps: int = 1

    def line(self) -> str:
        result = f"touched in {self.seconds:.2f} s" if self.success else f"timed out {self.distance_cm:.1f} cm away"
        steps = f" ({self.steps_done}/{self.steps} steps)" if self.steps > 1 else ""
        return f"episode {self.index}: '{self.prompt}': {result}{steps}"


@dataclass
class EpisodeTally:
    episodes: int = 0
    successes: int = 0

    def line(self) -> str:
        return f"{self.successes}/{self.episodes} touched"


class ResetSwitch:
    """When to switch the robot's action output off and on around the scene's resets (no ROS here).

    A reset begins (running -> ready): switch the output off, if it is on; that is judged from the commands
    (one within `on_within_s`): an output someone else switched off stays off. The episode starts (ready ->
    running): switch it back on, only if this switched it off."""

    def __init__(self, on_within_s: float = 0.25):
        self.on_within_s = on_within_s
        self.switched_off = False

    def on_phase_change(self, running: bool, now: float, last_command: float | None,
                        reachable: bool = True) -> bool | None:
        """The switch wanted now (False: off, True: on) or None. `now` and `last_command`: one clock, s.
        `reachable`: whether the switch can be made now; an off that cannot is not switched back on."""
        if not running:
            off = last_command is not None and now - last_command <= self.on_within_s
            self.switched_off = off and reachable
            return False if off else None
        if self.switched_off:
            self.switched_off = False
            return True
        return None


class ReachEpisodes:
    def __init__(self, seed: int = 0, image_size: int = 64, episode_s: float = 4.0, pause_s: float = 0.7,
                 multistep: bool = False):
        self.scene = ReachScene(image_size)
        self.seed, self.multistep = seed, multistep
        # Questions never shift the episodes: their own stream, not one of the per-episode seeds (seed, k).
        self._question_rng = np.random.default_rng([seed, 1 << 20])
        self.episode_s, self.pause_s = episode_s, pause_s
        self.tally = EpisodeTally()
        self.outcomes: list[EpisodeOutcome] = []
        self.command: np.ndarray | None = None
        self._clock: float | None = None
        self._episode_start = 0.0
        self._ready_until: float | None = None    # None: running
        self.episode_index = -1
        self._questions_asked = 0
        self._new_episode()

    # ------------------------------------------------------------------ state
    @property
    def layout(self) -> Layout:
        return self.scene.layout

    @property
    def prompt(self) -> str:
        return self.task.text

    @property
    def target(self) -> int:
        """The cube of the current step."""
        return self.judge.target if self.judge.target is not None else self.task.order[-1]

    @property
    def subtask(self) -> str:
        """The current step's subtask, from the simulator (the truth the model's subtask is judged against)."""
        return subtask_text(self.layout, self.task, self.judge.done)

    @property
    def memory(self) -> str:
        """The progress so far, from the simulator ("red touched; next: blue"; "" before the first step)."""
        return progress_memory(self.layout, self.task, self.judge.done)

    def joints(self) -> np.ndarray:
        return self.scene.joints()

    def render(self, camera: str, size: int | None = None) -> np.ndarray:
        return self.scene.render(camera, size)

    @property
    def running(self) -> bool:
        return self._ready_until is None

    @property
    def last_outcome(self) -> str:
        return self.outcomes[-1].line() if self.outcomes else ""

    def status(self) -> str:
        steps = f"step {self.judge.done + 1}/{self.task.steps}, " if self.task.steps > 1 else ""
        return (f"task '{self.prompt}' ({steps}tip {self.scene.distance_to(self.target) * 100:.0f} cm away"
                f"{'' if self.running else ', getting ready'}) | episodes {self.tally.line()}") + (
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
        """Simulate up to `now` (seconds, any monotonic clock). True when the task should be announced
        (a ready phase began, or the running phase: a second announcement for a subscriber that missed
        the first)."""
        if self._clock is None:
            self._clock = now
            announce = True             # the first episode's ready phase starts with the first call
            self._ready_until = now + self.pause_s
        else:
            announce = False
        steps = int((now - self._clock) / CONTROL_PERIOD_S)
        self._clock += steps * CONTROL_PERIOD_S
        if steps > MAX_CATCH_UP_STEPS:
            self._clock = now
            steps = MAX_CATCH_UP_STEPS
        for _ in range(steps):
            if self._ready_until is not None:
                if self._clock >= self._ready_until:
                    self._ready_until = None
                    self.command = None     # commands from the ready phase were for the held start pose
                    self._episode_start = self.scene.time
                    announce = True
                continue
            self.scene.step(self.command if self.command is not None else self.layout.start)
            elapsed = self.scene.time - self._episode_start
            if self.judge.update(self.scene.touching(), int(round(elapsed / CONTROL_PERIOD_S))):
                self.scene.mark_touched(self.task.order[self.judge.done - 1])
            if self.judge.finished:
                self._finish(True, elapsed)
                announce = True
            elif elapsed >= self.episode_s * self.task.steps:
                self._finish(False, elapsed)
                announce = True
        return announce

    def _finish(self, success: bool, elapsed: float) -> None:
        self.tally.episodes += 1
        self.tally.successes += success
        self.outcomes.append(EpisodeOutcome(self.episode_index, self.prompt, success, round(elapsed, 3),
                                            round(self.scene.distance_to(self.target) * 100, 1),
                                            self.judge.done, self.task.steps))
        self._new_episode()
        self._ready_until = self._clock + self.pause_s

    def _new_episode(self) -> None:
        self.episode_index += 1
        if self.multistep:
            drawn = draw_multistep_episode(self.seed, self.episode_index)
            layout, self.task = drawn.layout, drawn.task
        else:       # a one-step task: "touch the red cube"
            episode = draw_episode(self.seed, self.episode_index)
            layout, self.task = episode.layout, named_task(episode.layout, (episode.target,))
        self.judge = StepJudge(self.task)
        self.scene.reset(layout)
        self.command = None          # hold the start pose until the policy's first command for this task

    def close(self) -> None:
        self.scene.close()
