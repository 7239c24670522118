"""Scene questions with answers from the simulator's ground truth, and how likely a guess is right.

Left and right are as seen by the base camera, which looks over the arm's shoulder: left = +y.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scene import COLOUR_NAMES, Layout

NUMBERS = {2: "two", 3: "three"}
CAPTION_QUESTION = "Describe the scene."


@dataclass(frozen=True)
class Question:
    kind: str
    text: str
    answer: str
    chance: float    # probability that a uniform guess among the plausible answers is right


def _left_to_right(layout: Layout) -> list[str]:
    return [layout.colours[i] for i in np.argsort(-layout.positions[:, 1])]


def caption(layout: Layout) -> str:
    names = [f"a {c} cube" for c in _left_to_right(layout)]
    return ", ".join(names[:-1]) + " and " + names[-1]


def scene_questions(layout: Layout, tip: np.ndarray, rng: np.random.Generator) -> list[Question]:
    """One question of each kind about this scene (the pair, the absent colour... drawn with rng)."""
    n = len(layout.colours)
    order = _left_to_right(layout)
    nearest = layout.colours[int(np.argmin(np.linalg.norm(layout.positions - tip[None], axis=1)))]
    a, b = rng.choice(n, size=2, replace=False)
    side = "left" if layout.positions[a, 1] > layout.positions[b, 1] else "right"
    asked = str(rng.choice(COLOUR_NAMES))
    orderings = 1
    for i in range(n):
        orderings *= len(COLOUR_NAMES) - i
    return [
        Question("count", "How many cubes are there?", NUMBERS[n], 1 / len(NUMBERS)),
        Question("leftmost", "What colour is the leftmost cube?", order[0], 1 / n),
        Question("rightmost", "What colour is the rightmost cube?", order[-1], 1 / n),
        Question("left_right", f"Is the {layout.colours[a]} cube left or right of the {layout.colours[b]} cube?",
                 side, 1 / 2),
        Question("nearest", "Which cube is nearest the gripper?", nearest, 1 / n),
        Question("present", f"Is there a {asked} cube?", "yes" if asked in layout.colours else "no", 1 / 2),
        Question("caption", CAPTION_QUESTION, caption(layout), 1 / orderings),
    ]
