"""Rendered training data for the demo model: closed-loop rollouts of the scripted expert in the reach
scene, executed the way the policy is served (a chunk's rows in turn, a new chunk every few ticks), with
noise injected into the executed commands (so the data also shows how to come back to the path), sampled
at random steps. Each sample: the base camera image, the joint state, the expert's next
action chunk from that state, and the scene's ground truth (for the questions, drawn at training time).

`--policy CHECKPOINT` (DAgger, Ross et al. 2011): the rollouts are that checkpoint's own, through the
engine and the ChunkFollower as served (execution naive or rtc, a delay of 0..6 ticks), still labelled by
the expert's chunk from each visited state: the states a trained model reaches near the cubes are not the
expert's, and its misses came from there (docs/demo_model.md).

Cached to disk in shards of `SHARD_SIZE` samples (`shard_00000.npz`, ...): shard k is generated from seed
(seed, k) alone, so the cache is reproducible, and an interrupted run resumes at the first missing shard.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from oxygen_ros.sim.expert import expert_chunk, inverse_kinematics
from oxygen_ros.sim.scene import COLOUR_NAMES, MAX_CUBES, Layout, ReachScene, touch_point
from oxygen_ros.sim.tasks import ORDERS, StepJudge, draw_task

SHARD_SIZE = 500
SAMPLES_PER_EPISODE = 6
EPISODE_STEPS = 120            # expert reaches in ~40-90 steps at 70 Hz, then holds
COMMAND_NOISE = 0.03           # rad, std of the noise added to each executed command
CHUNK_OFFSET_NOISE = 0.04      # rad, std of an offset held for a whole executed chunk: off-path states
# Rows executed per chunk, drawn per episode: the evaluation executes 10, the ROS action publisher a few
# (a new chunk every frame, rows skipped for latency). An expert re-planning every tick and executing
# only row 0 (the first data) crawls behind the arm's soft servos, and states near the cubes were rare.
REPLAN_RANGE = (1, 10)


def generate_shard(seed: int, shard: int, image_size: int, horizon: int,
                   size: int = SHARD_SIZE) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, shard])
    scene = ReachScene(image_size)
    out = {k: [] for k in ("image", "state", "chunk", "target", "colours", "positions", "tip")}
    while len(out["image"]) < size:
        layout = Layout.random(rng)
        scene.reset(layout)
        target = int(rng.integers(len(layout.colours)))
        goal = inverse_kinematics(touch_point(layout.positions[target]))
        picks = set(rng.choice(EPISODE_STEPS, size=SAMPLES_PER_EPISODE, replace=False).tolist())
        replan = int(rng.integers(REPLAN_RANGE[0], REPLAN_RANGE[1] + 1))
        truth = _scene_truth(layout, target)
        for step in range(EPISODE_STEPS):
            q = scene.joints()
            chunk = expert_chunk(q, goal, horizon)
            if step % replan == 0:
                executed, offset = chunk, rng.normal(0.0, CHUNK_OFFSET_NOISE, size=3)
            if step in picks and len(out["image"]) < size:
                _add_sample(out, scene, q, chunk, truth)
            scene.step(executed[step % replan] + offset + rng.normal(0.0, COMMAND_NOISE, size=3))
    scene.close()
    return _arrays(out)


# Policy rollouts (DAgger): longer episodes (a model reaches more slowly than the expert, and its misses
# hover near a cube), more samples each; the execution and delay drawn per episode.
POLICY_EPISODE_STEPS = 160
POLICY_SAMPLES_PER_EPISODE = 8
POLICY_EXECUTIONS = ("naive", "rtc")
POLICY_DELAY_MAX = 6


def generate_policy_shard(seed: int, shard: int, checkpoint: Path, size: int = SHARD_SIZE) -> dict[str, np.ndarray]:
    """A shard of `checkpoint`'s own closed-loop episodes (through the engine in process, as the evaluation
    runs them, with the expert's command noise), each sample labelled with the expert's chunk."""
    import torch

    from oxygen_ros.eval import DelayedEngine, RtcSettings, demo_model_config, run_delayed_episode
    from oxygen_ros.engine.factory import build_model
    from oxygen_ros.sim.scene import task_prompt

    rng = np.random.default_rng([seed, shard])
    cfg = demo_model_config(checkpoint)
    torch.set_num_threads(1)
    model = build_model(cfg, str(checkpoint))
    # execution rtc as the checkpoint is meant to run it: prefix conditioning if trained for it
    rtc = RtcSettings(correction="prefix") if cfg.prefix_conditioning else RtcSettings()
    planners = {(e, d): DelayedEngine(model, checkpoint, e, d, rtc)
                for e in POLICY_EXECUTIONS for d in range(POLICY_DELAY_MAX + 1)}
    scene = ReachScene(cfg.vision.image_size)
    out = {k: [] for k in ("image", "state", "chunk", "target", "colours", "positions", "tip")}
    while len(out["image"]) < size:
        layout = Layout.random(rng)
        target = int(rng.integers(len(layout.colours)))
        goal = inverse_kinematics(touch_point(layout.positions[target]))
        picks = set(rng.choice(POLICY_EPISODE_STEPS, size=POLICY_SAMPLES_PER_EPISODE, replace=False).tolist())
        execution = POLICY_EXECUTIONS[int(rng.integers(len(POLICY_EXECUTIONS)))]
        delay = int(rng.integers(POLICY_DELAY_MAX + 1))
        replan = int(rng.integers(max(delay, REPLAN_RANGE[0]), REPLAN_RANGE[1] + 1))   # the evaluation's rule
        truth = _scene_truth(layout, target)
        offset = np.zeros(3)

        def disturb(step: int, command: np.ndarray) -> np.ndarray:
            """Sample the state the policy reached (labelled by the expert), then the expert data's noise."""
            nonlocal offset
            if step % replan == 0:
                offset = rng.normal(0.0, CHUNK_OFFSET_NOISE, size=3)
            if step in picks and len(out["image"]) < size:
                q = scene.joints()
                _add_sample(out, scene, q, expert_chunk(q, goal, cfg.action_horizon), truth)
            return command + offset + rng.normal(0.0, COMMAND_NOISE, size=3)

        run_delayed_episode(scene, layout, target, planners[(execution, delay)], task_prompt(layout.colours[target]),
                            rng, POLICY_EPISODE_STEPS, replan, delay, execution, 0, disturb, stop_at_touch=False)
    scene.close()
    return _arrays(out)


# Multi-step tasks (sim/tasks.py): the expert touches the task's cubes in order, each touched cube darkens;
# every sample is labelled with the step it was taken in (its subtask and progress memory are derived from
# the task's order and that step at training time). Episodes end when the last cube is touched.
MULTISTEP_STEPS_PER_TASK_STEP = 110     # the expert reaches a cube in ~40-90 ticks
# Samples per tick (~6 per step before the first is done, ~12 after): at one rate, 57% of the samples came
# before the first step was done, and only the others carry a progress memory to learn or show a dark cube.
MULTISTEP_SAMPLE_RATES = (1 / 14, 1 / 7)    # before the first step is done, after


def generate_multistep_shard(seed: int, shard: int, image_size: int, horizon: int,
                             size: int = SHARD_SIZE) -> dict[str, np.ndarray]:
    """Closed-loop episodes of the scripted expert on multi-step tasks (1 to 3 steps, named or spatial),
    executed as generate_shard executes them (a chunk every 1-10 ticks, its offset and per-tick noise)."""
    rng = np.random.default_rng([seed, shard, 2])
    scene = ReachScene(image_size)
    out = {k: [] for k in ("image", "state", "chunk", "target", "colours", "positions", "tip", "order", "done",
                           "kind")}
    while len(out["image"]) < size:
        layout = Layout.random(rng)
        scene.reset(layout)
        task = draw_task(layout, rng, min_steps=1)
        judge = StepJudge(task)
        replan = int(rng.integers(REPLAN_RANGE[0], REPLAN_RANGE[1] + 1))
        order = np.full(MAX_CUBES, -1)
        order[:task.steps] = task.order
        for step in range(MULTISTEP_STEPS_PER_TASK_STEP * task.steps):
            if judge.update(scene.touching(), step):
                scene.mark_touched(task.order[judge.done - 1])
            if judge.finished:
                break
            q = scene.joints()
            chunk = expert_chunk(q, inverse_kinematics(touch_point(layout.positions[judge.target])), horizon)
            if step % replan == 0:
                executed, offset = chunk, rng.normal(0.0, CHUNK_OFFSET_NOISE, size=3)
            if rng.random() < MULTISTEP_SAMPLE_RATES[min(judge.done, 1)] and len(out["image"]) < size:
                _add_sample(out, scene, q, chunk, _scene_truth(layout, judge.target))
                out["order"].append(order)
                out["done"].append(judge.done)
                out["kind"].append(ORDERS.index(task.kind))
            scene.step(executed[step % replan] + offset + rng.normal(0.0, COMMAND_NOISE, size=3))
    scene.close()
    return _arrays(out)


def _scene_truth(layout: Layout, target: int) -> dict[str, np.ndarray | int]:
    """A sample's ground truth of its scene: the named cube, colour indices and positions padded to MAX_CUBES."""
    colours = np.full(MAX_CUBES, -1)
    colours[:len(layout.colours)] = [COLOUR_NAMES.index(c) for c in layout.colours]
    positions = np.zeros((MAX_CUBES, 3))
    positions[:len(layout.colours)] = layout.positions
    return {"target": target, "colours": colours, "positions": positions}


def _add_sample(out: dict[str, list], scene: ReachScene, state: np.ndarray, chunk: np.ndarray, truth: dict) -> None:
    out["image"].append(scene.render("base"))
    out["state"].append(state)
    out["chunk"].append(chunk)
    for k, v in truth.items():
        out[k].append(v)
    out["tip"].append(scene.tip())


def _arrays(out: dict[str, list]) -> dict[str, np.ndarray]:
    ints = ("target", "colours", "order", "done", "kind")
    return {k: np.stack(v).astype(np.uint8 if k == "image" else np.int64 if k in ints else np.float32)
            for k, v in out.items()}


def generate(out_dir: Path, samples: int, seed: int = 0, image_size: int = 64, horizon: int = 20,
             shard_size: int = SHARD_SIZE, policy: Path | None = None, multistep: bool = False,
             log=print) -> list[Path]:
    """`policy`: that checkpoint's rollouts (generate_policy_shard) instead of the expert's; `multistep`: the
    expert on multi-step tasks (generate_multistep_shard)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = -(-samples // shard_size)
    paths, start, made = [], time.monotonic(), 0
    for k in range(shards):
        path = out_dir / f"shard_{k:05d}.npz"
        if not path.exists():                 # resumable: finished shards are kept
            if policy is not None:
                data = generate_policy_shard(seed, k, Path(policy), shard_size)
            elif multistep:
                data = generate_multistep_shard(seed, k, image_size, horizon, shard_size)
            else:
                data = generate_shard(seed, k, image_size, horizon, shard_size)
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, **data)
            tmp.rename(path)
            made += 1
            log(f"[data] shard {k + 1}/{shards} ({made * shard_size / (time.monotonic() - start):.0f} samples/s)")
        paths.append(path)
    return paths


def load(paths: list[Path]) -> dict[str, np.ndarray]:
    parts = [dict(np.load(p)) for p in paths]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Render the demo model's training data (resumable shards).")
    p.add_argument("--out", type=Path, default=Path("data/demo"))
    p.add_argument("--samples", type=int, default=16000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--horizon", type=int, default=20)
    p.add_argument("--policy", type=Path, default=None,
                   help="a checkpoint directory: its own rollouts (execution naive or rtc, delay 0..6 ticks; rtc "
                        "by prefix conditioning if the checkpoint was trained for it), labelled by the expert (DAgger)")
    p.add_argument("--multistep", action="store_true",
                   help="multi-step tasks (1-3 steps, named or every cube left to right / right to left), each sample "
                        "labelled with its step (the hierarchical demo model's data)")
    a = p.parse_args(argv)
    if a.policy is not None and a.multistep:
        p.error("--policy and --multistep: one kind of data per directory")
    if a.policy is not None and not (a.policy / "model.safetensors").is_file():
        p.error(f"--policy {a.policy}: no model.safetensors there")
    generate(a.out, a.samples, a.seed, a.image_size, a.horizon, policy=a.policy, multistep=a.multistep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
