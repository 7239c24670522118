"""Closed-loop evaluation of the demo model in the MuJoCo reach scene, through the engine (in-process).

    python -m oxygen_ros.eval --episodes 50 --json eval.json

For each seeded episode (a random layout of 2-3 cubes and a random named cube): the scripted expert, then
the model under each engine policy (isolated, shared_kv, oxygen: the same episodes, the same noise), then
the *swap test* (same scene and start, another cube named), and the scene questions asked about the first
frame. Control: the engine's chunk is computed from the current camera image and joint state every
`--replan` control ticks (70 Hz) and its next `--replan` rows are executed (receding horizon, as openpi
evaluates). Success: the tip touches the named cube (scene.TOUCH_RADIUS) within `--steps` ticks.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.engine.engine import POLICIES, EngineConfig
from oxygen_ros.engine.factory import build_engine, build_model, model_config
from oxygen_ros.engine.requests import TextRequest
from oxygen_ros.robot.policy_io import RobotIOConfig
from oxygen_ros.robot.sync import Observation
from oxygen_ros.sim.expert import expert_chunk, inverse_kinematics
from oxygen_ros.sim.questions import scene_questions
from oxygen_ros.sim.scene import Layout, ReachScene, task_prompt, touch_point

CAMERA_SLOT = "base_0_rgb"


def demo_checkpoint() -> Path:
    """The shipped demo weights (model.safetensors, norm_stats.json, config.json)."""
    return Path(str(resources.files("oxygen_ros.model") / "assets" / "demo"))


class EnginePolicy:
    """The engine's public API in one place: an observation in, the chunk's robot actions out; questions
    in, replies out. Synchronous (run_cycle), so every policy sees exactly the same inputs."""

    def __init__(self, policy: str, model, checkpoint: Path):
        self.engine = build_engine(built_model=model, norm_stats=str(checkpoint / "norm_stats.json"),
                                   robot_io=RobotIOConfig(robot_action_dim=model.cfg.action_dim,
                                                          delta_action_mask=(True,) * model.cfg.action_dim),
                                   engine=EngineConfig(policy=policy), kv_budget_mb=8.0)

    def act(self, image: np.ndarray, state: np.ndarray, prompt: str, noise: np.ndarray, stamp: float) -> np.ndarray:
        obs = Observation(stamp, {CAMERA_SLOT: image}, {CAMERA_SLOT: True}, state, prompt)
        report = self.engine.run_cycle(obs, noise)
        if report.fault:
            raise RuntimeError(f"engine fault: {report.fault}")
        return self.engine.latest_chunk().plan.actions

    def ask(self, image: np.ndarray, state: np.ndarray, prompt: str, questions: list[str],
            max_tokens: int = 16) -> list[str]:
        handles = [self.engine.submit(TextRequest(q, max_tokens=max_tokens)) for q in questions]
        self.engine.run_cycle(Observation(0.0, {CAMERA_SLOT: image}, {CAMERA_SLOT: True}, state, prompt))
        while not all(h.done() for h in handles):
            self.engine.run_cycle(None)
        return [h.result().text.strip() for h in handles]


@dataclass
class EpisodeResult:
    success: bool
    steps: int              # ticks until the touch (or the limit)
    touched_other: bool     # touched another cube before the named one
    final_distance: float


def run_episode(scene: ReachScene, layout: Layout, target: int, act, steps: int, replan: int,
                frames: list | None = None) -> EpisodeResult:
    """`act(scene) -> [H, 3]` joint targets; the first `replan` rows are executed before asking again.
    `frames`: collects a large base-camera render at each replan (the README's strip)."""
    scene.reset(layout)
    other = False
    chunk = None
    for k in range(steps):
        if k % replan == 0:
            chunk = act(scene)
            if frames is not None:
                frames.append(scene.render("base", 192))
        scene.step(chunk[k % replan])
        touched = scene.touching()
        if touched == target:
            return EpisodeResult(True, k + 1, other, scene.distance_to(target))
        other |= touched is not None
    return EpisodeResult(False, steps, other, scene.distance_to(target))


def expert_actor(goal: np.ndarray, horizon: int):
    return lambda scene: expert_chunk(scene.joints(), goal, horizon)


def model_actor(policy: EnginePolicy, prompt: str, rng: np.random.Generator, horizon: int, action_dim: int,
                chunks: list):
    def act(scene):
        noise = rng.standard_normal((horizon, action_dim)).astype(np.float32)
        actions = policy.act(scene.render("base"), scene.joints(), prompt, noise, scene.time)
        chunks.append(actions)
        return actions
    return act


def save_strip(frames: list, path: Path, count: int = 5) -> None:
    """Evenly spaced frames of an episode side by side (PNG)."""
    import cv2

    picks = [frames[round(i * (len(frames) - 1) / (count - 1))] for i in range(count)]
    cv2.imwrite(str(path), cv2.cvtColor(np.concatenate(picks, axis=1), cv2.COLOR_RGB2BGR))


def evaluate(episodes: int, seed: int = 0, steps: int = 210, replan: int = 10, policies=POLICIES,
             checkpoint: Path | None = None, questions: bool = True, strip: Path | None = None,
             log=print) -> dict:
    torch.set_num_threads(1)
    checkpoint = Path(checkpoint or demo_checkpoint())
    cfg = model_config("demo")
    model = build_model(cfg, str(checkpoint))
    engines = {p: EnginePolicy(p, model, checkpoint) for p in policies}
    main = "oxygen" if "oxygen" in engines else next(iter(engines))
    scene = ReachScene(cfg.vision.image_size)
    h, dim = cfg.action_horizon, cfg.action_dim
    results = {p: [] for p in engines}
    expert, swap, answers = [], [], []
    max_chunk_diff = 0.0
    start = time.monotonic()
    for ep in range(episodes):
        rng = np.random.default_rng([seed, ep])
        layout = Layout.random(rng)
        target = int(rng.integers(len(layout.colours)))
        prompt = task_prompt(layout.colours[target])
        goal = inverse_kinematics(touch_point(layout.positions[target]))
        expert.append(run_episode(scene, layout, target, expert_actor(goal, h), steps, replan))
        noise_seed = int(rng.integers(2**31))
        chunks = {}
        for p, engine in engines.items():
            chunks[p] = []
            act = model_actor(engine, prompt, np.random.default_rng(noise_seed), h, dim, chunks[p])
            frames = [] if strip is not None and ep == 0 and p == main else None
            results[p].append(run_episode(scene, layout, target, act, steps, replan, frames))
            if frames:
                save_strip(frames, strip)
        for p in engines:
            if len(chunks[p]) == len(chunks[main]):
                max_chunk_diff = max([max_chunk_diff] + [float(np.abs(a - b).max())
                                                         for a, b in zip(chunks[p], chunks[main])])
            else:
                max_chunk_diff = float("inf")
        swapped = (target + 1) % len(layout.colours)
        act = model_actor(engines[main], task_prompt(layout.colours[swapped]), np.random.default_rng(noise_seed),
                          h, dim, [])
        swap.append(run_episode(scene, layout, swapped, act, steps, replan))
        if questions:
            scene.reset(layout)
            asked = scene_questions(layout, scene.tip(), rng)
            replies = engines[main].ask(scene.render("base"), scene.joints(), prompt, [q.text for q in asked])
            answers += [(q, r) for q, r in zip(asked, replies)]
        log(f"[eval] episode {ep + 1}/{episodes}: {prompt!r} ({len(layout.colours)} cubes) "
            + " ".join(f"{p}={'ok' if results[p][-1].success else 'FAIL'}" for p in engines)
            + f" swap={'ok' if swap[-1].success else 'FAIL'}"
            + (f" answers {sum(q.answer == r for q, r in answers[-7:])}/7" if questions else ""))

    def rate(rs):
        return float(np.mean([r.success for r in rs])) if rs else 0.0

    def mean_steps(rs):
        ok = [r.steps for r in rs if r.success]
        return float(np.mean(ok)) if ok else None

    kinds = sorted({q.kind for q, _ in answers})
    out = {
        "episodes": episodes, "seed": seed, "steps": steps, "replan": replan, "control_hz": 70,
        "success_rate": rate(results[main]),
        "expert_success_rate": rate(expert),
        "swap_success_rate": rate(swap),
        "answer_accuracy": float(np.mean([q.answer == r for q, r in answers])) if answers else None,
        "chance_accuracy": float(np.mean([q.chance for q, _ in answers])) if answers else None,
        "answer_accuracy_by_kind": {k: float(np.mean([q.answer == r for q, r in answers if q.kind == k]))
                                    for k in kinds},
        "policies": {p: {"success_rate": rate(rs), "mean_steps_to_touch": mean_steps(rs),
                         "touched_other_first": float(np.mean([r.touched_other for r in rs])),
                         "failures_final_distance_cm": sorted(round(r.final_distance * 100, 1)
                                                              for r in rs if not r.success)}
                     for p, rs in results.items()},
        "max_action_difference_across_policies": max_chunk_diff,
        "expert_mean_steps_to_touch": mean_steps(expert),
        "wrong_answers": [{"question": q.text, "answer": q.answer, "reply": r} for q, r in answers
                          if q.answer != r][:20],
        "wall_s": round(time.monotonic() - start, 1),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread",
    }
    scene.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Evaluate the demo model closed-loop in MuJoCo through the engine.")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--seed", type=int, default=1000, help="episode seeds (training data uses 0)")
    p.add_argument("--steps", type=int, default=210, help="control ticks per episode (70 Hz)")
    p.add_argument("--replan", type=int, default=10, help="ticks executed from each chunk")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--checkpoint", type=Path, default=None, help="default: the shipped demo weights")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--strip", type=Path, default=None, help="PNG: frames of the first episode (README picture)")
    a = p.parse_args(argv)
    out = evaluate(a.episodes, a.seed, a.steps, a.replan, tuple(a.policies.split(",")), a.checkpoint,
                   strip=a.strip)
    text = json.dumps(out, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
