"""Rendered training data for the demo model: closed-loop rollouts of the scripted expert in the reach
scene, executed the way the policy is served (a chunk's rows in turn, a new chunk every few ticks), with
noise injected into the executed commands (so the data also shows how to come back to the path), sampled
at random steps. Each sample: the base camera image, the joint state, the expert's next
action chunk from that state, and the scene's ground truth (for the questions, drawn at training time).

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
        colours = np.full(MAX_CUBES, -1)
        colours[:len(layout.colours)] = [COLOUR_NAMES.index(c) for c in layout.colours]
        positions = np.zeros((MAX_CUBES, 3))
        positions[:len(layout.colours)] = layout.positions
        for step in range(EPISODE_STEPS):
            q = scene.joints()
            chunk = expert_chunk(q, goal, horizon)
            if step % replan == 0:
                executed, offset = chunk, rng.normal(0.0, CHUNK_OFFSET_NOISE, size=3)
            if step in picks and len(out["image"]) < size:
                out["image"].append(scene.render("base"))
                out["state"].append(q)
                out["chunk"].append(chunk)
                out["target"].append(target)
                out["colours"].append(colours)
                out["positions"].append(positions)
                out["tip"].append(scene.tip())
            scene.step(executed[step % replan] + offset + rng.normal(0.0, COMMAND_NOISE, size=3))
    scene.close()
    return {k: np.stack(v).astype(np.uint8 if k == "image" else np.float32 if k != "target" and k != "colours"
                                  else np.int64) for k, v in out.items()}


def generate(out_dir: Path, samples: int, seed: int = 0, image_size: int = 64, horizon: int = 20,
             shard_size: int = SHARD_SIZE, log=print) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = -(-samples // shard_size)
    paths, start, made = [], time.monotonic(), 0
    for k in range(shards):
        path = out_dir / f"shard_{k:05d}.npz"
        if not path.exists():                 # resumable: finished shards are kept
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
    a = p.parse_args(argv)
    generate(a.out, a.samples, a.seed, a.image_size, a.horizon)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
