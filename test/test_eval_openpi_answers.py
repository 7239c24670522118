"""`python -m oxygen_ros.eval --openpi` judges the replies that came: a question the server answered with an
error (its timeout, a refusal) got no reply, and is counted as unanswered, not as a wrong answer."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("openpi_client")

from oxygen_ros.serve.eval_openpi import SceneQuestions, answer_summary  # noqa: E402
from oxygen_ros.sim.questions import Question  # noqa: E402


class ScriptedPolicy:
    """Answers each question from a script; a question scripted as an exception raises it, as openpi-client's
    `infer` raises RuntimeError when the server sends its error text."""

    def __init__(self, script: dict):
        self.script = script

    def infer(self, obs: dict) -> dict:
        out = self.script[obs["question"]]
        if isinstance(out, Exception):
            raise out
        return {"text": out, "finish_reason": "eos"}


def test_a_question_without_a_reply_is_unanswered_not_wrong():
    questions = [Question("colour", "which colour is left?", "red", 0.25),
                 Question("colour", "which colour is right?", "blue", 0.25),
                 Question("count", "how many cubes?", "three", 0.5)]
    policy = ScriptedPolicy({"which colour is left?": " red ",
                             "which colour is right?": RuntimeError("Error in inference server:\nRequestFailed: "
                                                                    "question failed (timeout): timed out after 30 s"),
                             "how many cubes?": "two"})
    env = SimpleNamespace(questions=questions, episodes=1, get_observation=lambda: {"prompt": "touch the red cube"},
                          outcomes=[{"episode": 0, "prompt": "touch the red cube", "success": True}])
    lines: list[str] = []
    asker = SceneQuestions(policy, env, lines.append)
    asker.on_episode_start()
    asker.on_episode_end()
    out = answer_summary(asker.answers, asker.unanswered)
    assert out["questions_asked"] == 3 and out["questions_unanswered"] == 1
    assert "timed out after 30 s" in out["unanswered"][0]["error"]
    assert out["answer_accuracy"] == pytest.approx(1 / 2)                   # red right, two wrong; none missing
    assert out["answer_accuracy_by_kind"] == {"colour": 1.0, "count": 0.0}
    assert out["wrong_answers"] == [{"question": "how many cubes?", "answer": "three", "reply": "two"}]
    assert lines == ["[eval --openpi] episode 1/1: 'touch the red cube' ok answers 1/3 (1 unanswered)"]
