"""Multi-step tasks of the reach scene, judged from the simulator's state step by step, with the labels a
hierarchical policy is trained on: the current subtask and a progress memory, both written from the truth.

Tasks (the colours and the order drawn per episode):
- named: "touch the red cube, then the blue one" (2 or 3 steps; 1 step is today's "touch the red cube");
- spatial: "touch every cube from left to right" / "... from right to left" (every cube of the scene, left
  and right as the base camera sees them: left = +y, as the scene questions).

A step is done when the tip touches its cube (`TOUCH_RADIUS`) while it is the current step; the cube then
darkens (`ReachScene.mark_touched`, a pressed button), so that the progress is in the camera image and a
subtask can be read off one frame, as pi052 generates it (the task and the frame, no memory). Touching
another cube first is counted (`wrong_touches`) and does not advance the task.

Labels: the subtask is the current step's single-step task ("touch the blue cube"); the progress memory
after k steps lists what is done and what comes next ("red touched; next: blue", "red, blue touched; next:
green", "red, blue, green touched; done"), "" before the first step is done.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .scene import Layout, draw_episode, task_prompt

ORDERS = ("named", "left_to_right", "right_to_left")


def left_to_right(layout: Layout) -> tuple[int, ...]:
    """Cube indices ordered left to right as the base camera sees them (left = +y)."""
    return tuple(int(i) for i in np.argsort(-layout.positions[:, 1]))


@dataclass(frozen=True)
class MultiStepTask:
    text: str                    # the whole task, as the operator gives it
    order: tuple[int, ...]       # cube indices, in the order they are to be touched
    kind: str                    # one of ORDERS

    @property
    def steps(self) -> int:
        return len(self.order)


def named_task(layout: Layout, order: tuple[int, ...]) -> MultiStepTask:
    colours = [layout.colours[i] for i in order]
    text = task_prompt(colours[0]) + "".join(f", then the {c} one" for c in colours[1:])
    return MultiStepTask(text, tuple(order), "named")


def spatial_task(layout: Layout, kind: str) -> MultiStepTask:
    order = left_to_right(layout)
    if kind == "right_to_left":
        order = order[::-1]
    elif kind != "left_to_right":
        raise ValueError(f"spatial task kind must be left_to_right or right_to_left, got {kind!r}")
    direction = "left to right" if kind == "left_to_right" else "right to left"
    return MultiStepTask(f"touch every cube from {direction}", order, kind)


def draw_task(layout: Layout, rng: np.random.Generator, min_steps: int = 2) -> MultiStepTask:
    """A task of `min_steps`..len(cubes) steps: named (colours in a random order) two times in three, else
    every cube left to right or right to left. min_steps=1 also draws today's single-step reach."""
    n = len(layout.colours)
    if not 1 <= min_steps <= n:
        raise ValueError(f"min_steps must be in 1..{n} (cubes in the scene), got {min_steps}")
    if n >= 2 and min_steps <= n and rng.random() < 1 / 3:
        return spatial_task(layout, ORDERS[1 + int(rng.integers(2))])
    steps = int(rng.integers(min_steps, n + 1))
    return named_task(layout, tuple(int(i) for i in rng.permutation(n)[:steps]))


def subtask_text(layout: Layout, task: MultiStepTask, done: int) -> str:
    """The current step's subtask ("touch the blue cube"); "" when every step is done."""
    return task_prompt(layout.colours[task.order[done]]) if done < task.steps else ""


def progress_memory(layout: Layout, task: MultiStepTask, done: int) -> str:
    """What is done and what comes next, from the truth: "red, blue touched; next: green"."""
    if done == 0:
        return ""
    touched = ", ".join(layout.colours[i] for i in task.order[:done])
    rest = f"next: {layout.colours[task.order[done]]}" if done < task.steps else "done"
    return f"{touched} touched; {rest}"


@dataclass
class StepJudge:
    """Judges one multi-step episode from the simulator's state, one control tick at a time (`update` with
    the cube the tip touches, `ReachScene.touching()`). `step_ticks[k]`: the tick step k was done at."""

    task: MultiStepTask
    done: int = 0
    wrong_touches: int = 0
    step_ticks: list[int] = field(default_factory=list)
    _inside: int | None = None          # the cube the tip was touching at the previous tick

    @property
    def finished(self) -> bool:
        return self.done == self.task.steps

    @property
    def target(self) -> int | None:
        """The cube of the current step (None when finished)."""
        return None if self.finished else self.task.order[self.done]

    def update(self, touching: int | None, tick: int) -> bool:
        """True when this tick completed a step. A touch of a cube that is neither the current one nor
        already done counts as a wrong touch once per entry."""
        completed = False
        if touching is not None and touching == self.target:
            self.done += 1
            self.step_ticks.append(tick)
            completed = True
        elif touching is not None and touching != self._inside and touching not in self.task.order[:self.done]:
            self.wrong_touches += 1
        self._inside = touching
        return completed


@dataclass(frozen=True)
class MultiStepEpisode:
    """Episode k of a seed with a multi-step task: the scene (as `draw_episode` draws it), the task and the
    seed of its chunks' noise."""
    layout: Layout
    task: MultiStepTask
    noise_seed: int


def draw_multistep_episode(seed: int, k: int, min_steps: int = 2) -> MultiStepEpisode:
    """Episode k of `seed`, the same on every path (the evaluation, the demo's simulated robot, the tests):
    the scene of `draw_episode(seed, k)` and a task of `min_steps`.. steps drawn from its own stream."""
    episode = draw_episode(seed, k)
    rng = np.random.default_rng([seed, k, 2])
    return MultiStepEpisode(episode.layout, draw_task(episode.layout, rng, min_steps), episode.noise_seed)
