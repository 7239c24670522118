"""DemoClient: what a user of the package does, over DDS like any other process would: asks the
conversation service a question now and then and listens to the scene captions. With `questions` (the
simulated robot's scene questions, in the demo) each question comes with a judge and the reply is marked
right or wrong.

A reply is judged against the scene of the frame it was computed from (the reply's frame_stamp), not
the scene when the question was asked: near an episode change the engine may answer from a frame of the
next episode, and a right answer was logged wrong (3 cases, matched against a recording).
"""
from __future__ import annotations

import copy
import itertools
from typing import Callable

import numpy as np
from rclpy.node import Node

QUESTIONS = ["How many cubes are there?", "What colour is the leftmost cube?", "Which cube is nearest the gripper?",
             "Is there a red cube?"]
Judge = Callable[[int], "str | None"]       # frame stamp (ns) -> the true answer on that frame, None: unknown
Scene = tuple                               # (sim.scene.Layout: the episode's cubes, the gripper tip [3])


class SceneQuestions:
    """The demo's scene questions (oxygen_ros/sim/questions.py, the kinds in turn), each with a judge that
    answers it again on the scene of the frame a reply names. `now()` is the scene at ask time,
    `scene_at(stamp_ns)` the scene a camera image of that stamp showed (None: not known)."""

    def __init__(self, now: Callable[[], Scene], scene_at: Callable[[int], "Scene | None"], seed: int = 0):
        self.now, self.scene_at = now, scene_at
        self.rng = np.random.default_rng([seed, 1 << 21])
        self.asked = 0

    def __call__(self) -> tuple[str, Judge]:
        from oxygen_ros.sim.questions import scene_questions

        state = copy.deepcopy(self.rng.bit_generator.state)
        questions = scene_questions(*self.now(), self.rng)
        kind = self.asked % len(questions)
        self.asked += 1
        question = questions[kind]

        def judge(stamp_ns: int) -> str | None:
            frame = self.scene_at(stamp_ns)
            if frame is None:
                return None
            # The same draws on that frame's scene: the same question, answered there (a question naming a
            # cube that frame's scene lacks comes out differently: it cannot be judged there).
            rng = np.random.default_rng()
            rng.bit_generator.state = state
            there = scene_questions(*frame, rng)[kind]
            return there.answer if there.text == question.text else None

        return question.text, judge


class DemoClient(Node):
    def __init__(self, period_s: float = 4.0, printer=print,
                 questions: Callable[[], tuple[str, Judge | None]] | None = None, **node_kwargs):
        super().__init__("oxygen_demo_client", **node_kwargs)
        from oxygen_interfaces.msg import Caption
        from oxygen_interfaces.srv import Converse

        self._Converse = Converse
        self.client = self.create_client(Converse, "oxygen/converse")
        self.create_subscription(Caption, "oxygen/memory", self._on_caption, 10)
        fixed = itertools.cycle(QUESTIONS)
        self.questions = questions or (lambda: (next(fixed), None))
        self.printer = printer
        self.replies = 0
        self.correct = 0
        self.checked = 0
        self.unjudged = 0
        self.captions = 0
        self.create_timer(period_s, self._ask)

    def _ask(self) -> None:
        if not self.client.service_is_ready():
            return
        question, judge = self.questions()
        future = self.client.call_async(self._Converse.Request(text=question, max_tokens=16))
        future.add_done_callback(lambda f, q=question, j=judge: self._on_reply(q, j, f.result()))

    def _on_reply(self, question: str, judge: Judge | None, r) -> None:
        self.replies += 1
        if not r.success:
            self.printer(f"[converse] {question!r} failed: {r.error}")
            return
        verdict = ""
        if judge is not None:
            truth = judge(r.frame_stamp.sec * 1_000_000_000 + r.frame_stamp.nanosec)
            if truth is None:
                self.unjudged += 1
                verdict = f" [not judged: frame {r.frame_index}'s scene is unknown or lacks what the question names"
            else:
                self.checked += 1
                ok = r.reply.strip() == truth
                self.correct += ok
                verdict = f" [{'right' if ok else 'wrong, truth: ' + repr(truth)}"
            verdict += f"; {self.correct}/{self.checked} right]"
        self.printer(f"[converse] {question!r} -> {r.reply!r}{verdict} ({r.tokens} tokens, "
                     f"{r.latency_s * 1e3:.0f} ms, frame {r.frame_index})")

    def _on_caption(self, msg) -> None:
        self.captions += 1
        self.printer(f"[memory] frame {msg.frame_index}: {msg.text!r}")
