"""DemoClient: what a user of the package does, over DDS like any other process would: asks the
conversation service a question now and then and listens to the scene captions. With `questions` (the
simulated robot's, in the demo) each question comes with its true answer and the reply is marked."""
from __future__ import annotations

import itertools
from typing import Callable

from rclpy.node import Node

QUESTIONS = ["How many cubes are there?", "What colour is the leftmost cube?", "Which cube is nearest the gripper?",
             "Is there a red cube?"]


class DemoClient(Node):
    def __init__(self, period_s: float = 4.0, printer=print,
                 questions: Callable[[], tuple[str, str | None]] | None = None, **node_kwargs):
        super().__init__("oxygen_demo_client", **node_kwargs)
        from oxygen_interfaces.msg import Caption
        from oxygen_interfaces.srv import Converse

        self._Converse = Converse
        self.client = self.create_client(Converse, "/oxygen/converse")
        self.create_subscription(Caption, "/oxygen/memory", self._on_caption, 10)
        fixed = itertools.cycle(QUESTIONS)
        self.questions = questions or (lambda: (next(fixed), None))
        self.printer = printer
        self.replies = 0
        self.correct = 0
        self.checked = 0
        self.captions = 0
        self.create_timer(period_s, self._ask)

    def _ask(self) -> None:
        if not self.client.service_is_ready():
            return
        question, truth = self.questions()
        future = self.client.call_async(self._Converse.Request(text=question, max_tokens=16))
        future.add_done_callback(lambda f, q=question, t=truth: self._on_reply(q, t, f.result()))

    def _on_reply(self, question: str, truth: str | None, r) -> None:
        self.replies += 1
        if not r.success:
            self.printer(f"[converse] {question!r} failed: {r.error}")
            return
        verdict = ""
        if truth is not None:
            self.checked += 1
            ok = r.reply.strip() == truth
            self.correct += ok
            verdict = f" [{'right' if ok else 'wrong, truth: ' + repr(truth)}; {self.correct}/{self.checked} right]"
        self.printer(f"[converse] {question!r} -> {r.reply!r}{verdict} ({r.tokens} tokens, "
                     f"{r.latency_s * 1e3:.0f} ms, frame {r.frame_index})")

    def _on_caption(self, msg) -> None:
        self.captions += 1
        self.printer(f"[memory] frame {msg.frame_index}: {msg.text!r}")
