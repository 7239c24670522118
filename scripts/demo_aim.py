"""Where the demo model aims near the cube: the end of its plain chunk (the point it plans to reach) against
the named cube's touch point, by how far the tip is from it, on frames of closed-loop episodes (naive,
re-plan every 10 ticks, as `python -m oxygen_ros.eval`) and on training frames (docs/rtc.md: why no
execution moves the demo's success).

    python scripts/demo_aim.py --episodes 60 --seed 1000 [--data data/demo] [--json OUT]

Per band of tip distance: the median distance from the chunk's last row (forward kinematics) to the touch
point, split into along the tip-to-cube direction (negative: short of the cube) and across it. The
closed-loop frames near the cube come mostly from the episodes that hover there (each re-plan is a frame).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.eval import DelayedEngine, RtcSettings, demo_model_config, print_json, run_episode
from oxygen_ros.engine.factory import build_model
from oxygen_ros.robot.configs import demo_checkpoint
from oxygen_ros.sim.expert import forward_kinematics
from oxygen_ros.sim.scene import CONTROL_PERIOD_S, ReachScene, draw_episode, task_prompt, touch_point

BANDS_M = ((0.0, 0.05), (0.05, 0.08), (0.08, 0.12), (0.12, 0.2))
REPLAN = 10


def aim(chunk: np.ndarray, tip: np.ndarray, touch: np.ndarray) -> tuple[float, float, float]:
    """(tip distance, along, across) in m: where the chunk's last row puts the tip relative to the touch point."""
    towards = touch - tip
    distance = float(np.linalg.norm(towards))
    unit = towards / max(distance, 1e-9)
    error = forward_kinematics(chunk[-1]) - touch
    along = float(error @ unit)
    return distance, along, float(np.linalg.norm(error - along * unit))


def summary(rows: list[tuple[float, float, float]]) -> dict:
    a = np.array(rows).reshape(-1, 3)
    out = {}
    for lo, hi in BANDS_M:
        m = (a[:, 0] >= lo) & (a[:, 0] < hi)
        if m.any():
            out[f"{lo * 100:.0f}-{hi * 100:.0f} cm"] = {
                "frames": int(m.sum()), "along_cm": round(float(np.median(a[m, 1])) * 100, 1),
                "across_cm": round(float(np.median(a[m, 2])) * 100, 1)}
    return out


def closed_loop(planner: DelayedEngine, image_size: int, episodes: int, seed: int, steps: int = 210) -> list:
    """The evaluation's episodes (run_episode: re-plan every 10 ticks, until the touch), each plan's aim."""
    scene, rows = ReachScene(image_size), []
    for ep in range(episodes):
        episode = draw_episode(seed, ep)
        touch, noise = touch_point(episode.layout.positions[episode.target]), np.random.default_rng(episode.noise_seed)
        planner.reset()

        def act(scene: ReachScene) -> np.ndarray:
            z = noise.standard_normal((planner.horizon, planner.dim)).astype(np.float32)
            chunk = planner.plan(scene.render("base"), scene.joints(), episode.prompt, z,
                                 round(scene.time / CONTROL_PERIOD_S)).plan.actions
            rows.append(aim(chunk, scene.tip(), touch))
            return chunk

        run_episode(scene, episode.layout, episode.target, act, steps, REPLAN)
    scene.close()
    return rows


def training_frames(planner: DelayedEngine, data_dir: Path, count: int, seed: int) -> list:
    from oxygen_ros.training.batches import layout_of
    from oxygen_ros.training.data import load

    data, rng, rows = load(sorted(data_dir.glob("shard_*.npz"))[-4:]), np.random.default_rng(seed), []
    for i in range(min(count, len(data["state"]))):
        layout = layout_of(data, i)
        target = int(data["target"][i])
        planner.reset()
        z = rng.standard_normal((planner.horizon, planner.dim)).astype(np.float32)
        chunk = planner.plan(data["image"][i], data["state"][i].astype(np.float64),
                             task_prompt(layout.colours[target]), z, 0).plan.actions
        rows.append(aim(chunk, data["tip"][i].astype(np.float64), touch_point(layout.positions[target])))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=None, help="default: the shipped demo weights")
    p.add_argument("--episodes", type=int, default=60)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--data", type=Path, default=None, help="also training frames (the last 4 shards' 2,000)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    checkpoint = Path(a.checkpoint or demo_checkpoint())
    cfg = demo_model_config(checkpoint)
    torch.set_num_threads(1)
    planner = DelayedEngine(build_model(cfg, str(checkpoint)), checkpoint, "naive", 0, RtcSettings())
    out = {"checkpoint": checkpoint.name, "episodes": a.episodes, "seed": a.seed,
           "closed_loop": summary(closed_loop(planner, cfg.vision.image_size, a.episodes, a.seed))}
    if a.data:
        out["training_frames"] = summary(training_frames(planner, a.data, 2000, a.seed))
    print_json(out, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
