"""Run this package's robot-side pipeline (around the network) on a policy-I/O case.

    python -m oxygen_ros.tools.policy_io CASE_DIR --out OUT.npz

The pipeline is built from the robot config the case names (config/<robot>.yaml, the engine's
parameters) and the case's norm_stats.json, exactly as `oxygen_bringup --robot <robot>` builds it; the
case only supplies raw inputs (inputs.npz: image_<slot> uint8 at the camera's resolution, state in robot
units, model_actions [H, 32] in model space). Written arrays (../shared/oracle/case_e/README.md):
  image_<slot> float32 [224, 224, 3] in [-1, 1] (what the network receives, HWC),
  state_normalized float32 [state_dim], robot_actions float32 [H, robot_action_dim].
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from oxygen_ros.model.normalize import Normalizer
from oxygen_ros.robot.configs import find_config, node_params
from oxygen_ros.robot.policy_io import PolicyIO, RobotIOConfig


def robot_pipeline(robot: str, norm_stats: str | Path, model_action_dim: int = 32) -> PolicyIO:
    params = node_params(find_config(robot), "oxygen_engine")
    return PolicyIO(RobotIOConfig.from_params(params), Normalizer.load(norm_stats), model_action_dim)


def run_case(case_dir: str | Path) -> dict[str, np.ndarray]:
    case_dir = Path(case_dir)
    case = json.loads((case_dir / "config.json").read_text())
    inp = dict(np.load(case_dir / "inputs.npz"))
    io = robot_pipeline(case["robot"], case_dir / "norm_stats.json", inp["model_actions"].shape[-1])
    mask = case.get("delta_action_mask")
    if mask is not None and list(map(bool, mask)) != list(io.config.delta_action_mask):
        raise ValueError(f"the case's delta_action_mask {mask} is not the {case['robot']} config's "
                         f"{list(io.config.delta_action_mask)}")
    images = {k.removeprefix("image_"): v for k, v in inp.items() if k.startswith("image_")}
    model_in = io.model_inputs(images, inp["state"])
    out = {f"image_{slot}": px.permute(1, 2, 0).numpy() for slot, px in model_in.images.items()}
    out["state_normalized"] = model_in.state_normalized.astype(np.float32)
    out["robot_actions"] = io.robot_actions(inp["model_actions"], inp["state"]).astype(np.float32)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case_dir", help="policy-I/O case folder (config.json, norm_stats.json, inputs.npz)")
    parser.add_argument("--out", required=True, help="output .npz")
    args = parser.parse_args(argv)
    out = run_case(args.case_dir)
    np.savez(args.out, **out)
    print(f"wrote {len(out)} arrays to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
