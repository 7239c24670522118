"""`python -m oxygen_ros.eval --openpi`: the demo's MuJoCo episodes through openpi's own client runtime.

`oxygen_serve --robot demo` (the shipped demo weights) runs in a subprocess; the episodes run in this process
as an openpi-client `Environment`, driven by its `Runtime` with a `PolicyAgent` over an `ActionChunkBroker`
over a `WebsocketClientPolicy`, exactly as openpi's example robots run: a chunk is asked for every `replan`
control ticks and its rows are executed one per tick. The episodes are the in-process evaluation's (same
seed: same scenes, starts, named cubes; eval.py `evaluate`), success judged by the simulator (the tip within
the touch radius of the named cube within `steps` ticks). At each episode's start the scene questions of the
in-process evaluation are asked on the same socket (an unmodified `infer` of {observation, "question"}) and
judged as the demo client judges replies (stripped text == the simulator's answer); a question the server
answers with an error (its timeout, a refusal) got no reply: it is counted as unanswered, not as wrong, and the
accuracy is over the questions replied to (as eval.py's).
"""
from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from openpi_client.action_chunk_broker import ActionChunkBroker
from openpi_client.runtime import environment as _environment
from openpi_client.runtime import runtime as _runtime
from openpi_client.runtime import subscriber as _subscriber
from openpi_client.runtime.agents.policy_agent import PolicyAgent
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from oxygen_ros.sim.questions import scene_questions
from oxygen_ros.sim.scene import ReachScene, draw_episode

QUESTION_TOKENS = 16          # as the in-process evaluation and the demo client ask


class ReachEpisodes(_environment.Environment):
    """The in-process evaluation's episodes (eval.py `evaluate`: the same draws from the same seeds) as an
    openpi runtime environment; each `reset` starts the next one (the runtime's final reset is a no-op)."""

    def __init__(self, episodes: int, seed: int, steps: int, image_size: int = 64):
        self.scene = ReachScene(image_size)
        self.episodes, self.seed, self.steps = episodes, seed, steps
        self.index = -1
        self.outcomes: list[dict] = []
        self.questions: list = []             # the current episode's scene questions
        self._tick, self._touched_other, self._done = 0, False, False

    def reset(self) -> None:
        if self.index + 1 >= self.episodes:
            return
        self.index += 1
        episode = draw_episode(self.seed, self.index)
        self.layout, self.target, self.prompt = episode.layout, episode.target, episode.prompt
        self.scene.reset(self.layout)
        self.questions = scene_questions(self.layout, self.scene.tip(), episode.rng)
        self._tick, self._touched_other, self._done = 0, False, False

    def get_observation(self) -> dict:
        return {"observation/image": self.scene.render("base"), "observation/state": self.scene.joints(),
                "prompt": self.prompt}

    def apply_action(self, action: dict) -> None:
        self.scene.step(np.asarray(action["actions"]))
        self._tick += 1
        touched = self.scene.touching()
        success = touched == self.target
        self._touched_other |= touched is not None and not success
        if success or self._tick >= self.steps:
            self._done = True
            self.outcomes.append({"episode": self.index, "prompt": self.prompt, "success": success,
                                  "steps": self._tick, "touched_other_first": self._touched_other,
                                  "final_distance_cm": round(100 * self.scene.distance_to(self.target), 1)})

    def is_episode_complete(self) -> bool:
        return self._done


class SceneQuestions(_subscriber.Subscriber):
    """At each episode's start: the scene questions, on the policy's socket, about the first frame."""

    def __init__(self, policy: WebsocketClientPolicy, env: ReachEpisodes, log):
        self.policy, self.env, self.log = policy, env, log
        self.answers: list[tuple] = []        # (question, reply text or None: no reply)
        self.unanswered: list[dict] = []      # the questions without a reply, with the server's error

    def on_episode_start(self) -> None:
        observation = self.env.get_observation()
        for q in self.env.questions:
            try:
                reply = self.policy.infer({**observation, "question": q.text, "max_tokens": QUESTION_TOKENS})
            except RuntimeError as e:          # openpi-client's form of the server's error text
                self.answers.append((q, None))
                self.unanswered.append({"question": q.text, "error": str(e).strip()})
                continue
            self.answers.append((q, reply["text"].strip()))

    def on_step(self, observation: dict, action: dict) -> None:
        pass

    def on_episode_end(self) -> None:
        o = self.env.outcomes[-1]
        last = self.answers[-len(self.env.questions):] if self.env.questions else []
        missing = sum(r is None for _, r in last)
        self.log(f"[eval --openpi] episode {o['episode'] + 1}/{self.env.episodes}: {o['prompt']!r} "
                 f"{'ok' if o['success'] else 'FAIL'} answers {sum(q.answer == r for q, r in last)}/{len(last)}"
                 + (f" ({missing} unanswered)" if missing else ""))


class TimedPolicy:
    """The client policy with each infer's wall time recorded (what a robot waits for a chunk)."""

    def __init__(self, policy: WebsocketClientPolicy):
        self.policy, self.infer_s = policy, []

    def infer(self, obs: dict) -> dict:
        t = time.perf_counter()
        out = self.policy.infer(obs)
        self.infer_s.append(time.perf_counter() - t)
        return out

    def reset(self) -> None:
        self.policy.reset()


def start_server(extra: list[str], timeout_s: float = 120.0) -> tuple[subprocess.Popen, int, list[str]]:
    """`oxygen_serve --robot demo` on a free port: (process, port, its output lines so far)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "oxygen_ros.serve", "--robot", "demo", "--port", "0"] + extra,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("oxygen_serve exited:\n" + "\n".join(lines[-30:]))
        lines.append(line.rstrip("\n"))
        if "listening on ws://" in line:
            port = int(line.rsplit(":", 1)[1])
            break
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("oxygen_serve did not start:\n" + "\n".join(lines[-30:]))
    threading.Thread(target=lambda: lines.extend(x.rstrip("\n") for x in proc.stdout), daemon=True).start()
    return proc, port, lines


def evaluate_openpi(episodes: int, seed: int = 1000, steps: int = 210, replan: int = 10,
                    checkpoint: Path | None = None, log=print) -> dict:
    extra, params = [], None
    if checkpoint is not None:
        checkpoint = Path(checkpoint).resolve()
        fd, params = tempfile.mkstemp(prefix="oxygen_eval_openpi_", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(f"oxygen_engine:\n  ros__parameters:\n    checkpoint: '{checkpoint}'\n"
                    f"    norm_stats: '{checkpoint / 'norm_stats.json'}'\n")
        extra = ["--params-file", params]
    start, load = time.monotonic(), os.getloadavg()[0]
    proc, port, lines = start_server(extra)
    env = ReachEpisodes(episodes, seed, steps)
    try:
        client = WebsocketClientPolicy("127.0.0.1", port)
        timed = TimedPolicy(client)
        asker = SceneQuestions(client, env, log)
        runtime = _runtime.Runtime(env, PolicyAgent(ActionChunkBroker(timed, action_horizon=replan)), [asker],
                                   max_hz=0, num_episodes=episodes)
        runtime.run()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        env.scene.close()
        if params:
            Path(params).unlink(missing_ok=True)
    outcomes = env.outcomes
    ok = [o["steps"] for o in outcomes if o["success"]]
    infer_ms = 1e3 * np.array(timed.infer_s)
    return {
        "path": "openpi", "episodes": episodes, "seed": seed, "steps": steps, "replan": replan, "control_hz": 70,
        "success_rate": float(np.mean([o["success"] for o in outcomes])),
        "mean_steps_to_touch": float(np.mean(ok)) if ok else None,
        "touched_other_first": float(np.mean([o["touched_other_first"] for o in outcomes])),
        "failures_final_distance_cm": sorted(o["final_distance_cm"] for o in outcomes if not o["success"]),
        **answer_summary(asker.answers, asker.unanswered),
        "chunks": len(infer_ms),
        "client_infer_ms": {"p50": float(np.percentile(infer_ms, 50)), "p99": float(np.percentile(infer_ms, 99))}
        if len(infer_ms) else None,
        "outcomes": outcomes,
        "wall_s": round(time.monotonic() - start, 1),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, engine 1 torch thread",
        "load_avg_1min": {"start": load, "end": os.getloadavg()[0]},
    }


def answer_summary(answers: list[tuple], unanswered: list[dict]) -> dict:
    """Accuracy over the questions replied to ((question, reply text) pairs; None: no reply); the questions
    without a reply are counted apart (a timeout or a refusal is not a wrong answer)."""
    replied = [(q, r) for q, r in answers if r is not None]
    kinds = sorted({q.kind for q, _ in replied})
    return {
        "answer_accuracy": float(np.mean([q.answer == r for q, r in replied])) if replied else None,
        "answer_accuracy_by_kind": {k: float(np.mean([q.answer == r for q, r in replied if q.kind == k]))
                                    for k in kinds},
        "questions_asked": len(answers),
        "questions_unanswered": len(unanswered),
        "unanswered": unanswered[:20],
        "wrong_answers": [{"question": q.text, "answer": q.answer, "reply": r} for q, r in replied
                          if q.answer != r][:20],
    }
