"""DemoClient: what a user of the package does, over DDS like any other process would: asks the
conversation service a question now and then and listens to the scene captions."""
from __future__ import annotations

import itertools

from rclpy.node import Node

QUESTIONS = ["What is on the table?", "Where is the red cup?", "Is the gripper open?", "What should the robot do next?"]


class DemoClient(Node):
    def __init__(self, period_s: float = 4.0, printer=print, **node_kwargs):
        super().__init__("oxygen_demo_client", **node_kwargs)
        from oxygen_interfaces.msg import Caption
        from oxygen_interfaces.srv import Converse

        self._Converse = Converse
        self.client = self.create_client(Converse, "/oxygen/converse")
        self.create_subscription(Caption, "/oxygen/memory", self._on_caption, 10)
        self.questions = itertools.cycle(QUESTIONS)
        self.printer = printer
        self.replies = 0
        self.captions = 0
        self.create_timer(period_s, self._ask)

    def _ask(self) -> None:
        if not self.client.service_is_ready():
            return
        question = next(self.questions)
        future = self.client.call_async(self._Converse.Request(text=question, max_tokens=16))
        future.add_done_callback(lambda f, q=question: self._on_reply(q, f.result()))

    def _on_reply(self, question: str, r) -> None:
        self.replies += 1
        if r.success:
            self.printer(f"[converse] {question!r} -> {r.reply!r} ({r.tokens} tokens, {r.latency_s * 1e3:.0f} ms, "
                         f"frame {r.frame_index})")
        else:
            self.printer(f"[converse] {question!r} failed: {r.error}")

    def _on_caption(self, msg) -> None:
        self.captions += 1
        self.printer(f"[memory] frame {msg.frame_index}: {msg.text!r}")
