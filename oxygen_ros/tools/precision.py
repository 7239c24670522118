"""bfloat16 serving precision: the action deviation from float32, all-bfloat16 vs openpi's float32 islands.

    python -m oxygen_ros.tools.precision [CASE_DIR ...] [--json OUT.json]

For each model oracle case (default: ../shared/oracle/case_a and case_c), the case's weights, inputs and
noise are run three ways through the standalone inference path on the CPU (bfloat16 runs there too):
float32; every parameter bfloat16 (`islands=False`); bfloat16 with the float32 islands of
model/pi05.py (FLOAT32_ISLANDS). x_t is integrated in float32 in both bfloat16 runs. Printed and written:
max and mean |actions - float32 actions| per case and mode. `--preset bench` adds a larger model (random
weights and inputs, same three ways).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.model import inference
from oxygen_ros.model.checkpoint import load_pi05
from oxygen_ros.model.config import from_oracle_json
from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.model.preprocess import to_pixels

MODES = {"float32": (torch.float32, True), "bf16_all": (torch.bfloat16, False), "bf16_islands": (torch.bfloat16, True)}
DEFAULT_CASES = [Path(__file__).resolve().parents[2] / ".." / "shared" / "oracle" / c for c in ("case_a", "case_c")]


def case_actions(case_dir: Path, dtype: torch.dtype, islands: bool) -> np.ndarray:
    """The case's action chunk [B, H, action_dim] with the model served in `dtype` (islands or not)."""
    cfg = from_oracle_json(case_dir / "config.json")
    model = load_pi05(case_dir, cfg, "cpu", dtype, islands)
    inp = dict(np.load(case_dir / "inputs.npz"))
    rows = []
    for b in range(inp["tokenized_prompt"].shape[0]):
        slots = [s for s in cfg.camera_slots if bool(inp[f"image_mask_{s}"][b])]
        images = torch.stack([to_pixels(inp[f"image_{s}"][b], cfg.vision.image_size) for s in slots])
        tokens = inp["tokenized_prompt"][b][inp["tokenized_prompt_mask"][b].astype(bool)]
        rows.append(PrefixRow(images, torch.tensor(tokens, dtype=torch.long)))
    cache = inference.ContiguousCache(model, sum(model.prefix_length(r) for r in rows) + 64)
    pre = inference.prefill(model, cache, rows, "torch")
    noise = torch.from_numpy(inp["noise"]).float()
    return inference.sample_actions(model, cache, pre.segments, noise, cfg.num_denoise_steps, "torch").numpy()


def preset_actions(preset: str, dtype: torch.dtype, islands: bool, seed: int = 0) -> np.ndarray:
    """The same measure on a preset with deterministic random weights and inputs (two cameras, 20 tokens)."""
    from oxygen_ros.engine.factory import model_config
    from oxygen_ros.model.checkpoint import init_random_weights
    from oxygen_ros.model.pi05 import Pi05

    cfg = model_config(preset)
    model = init_random_weights(Pi05(cfg), seed).to_serving_dtype(dtype, islands).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(2, 3, cfg.vision.image_size, cfg.vision.image_size, generator=g) * 2 - 1
    tokens = torch.randint(0, cfg.vocab_size, (20,), generator=g)
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g)
    with torch.inference_mode():
        cache = inference.ContiguousCache(model, model.prefix_length(PrefixRow(images, tokens)) + 64)
        pre = inference.prefill(model, cache, [PrefixRow(images, tokens)], "torch")
        return inference.sample_actions(model, cache, pre.segments, noise, cfg.num_denoise_steps, "torch").numpy()


def measure(case_dirs: list[Path]) -> dict:
    out = {}
    for case in case_dirs:
        ref = case_actions(case, torch.float32, True).astype(np.float64)
        out[case.name] = {}
        for mode, (dtype, islands) in MODES.items():
            if mode == "float32":
                continue
            d = np.abs(case_actions(case, dtype, islands) - ref)
            out[case.name][mode] = {"max_abs": float(d.max()), "mean_abs": float(d.mean())}
    return out


def measure_preset(preset: str) -> dict:
    ref = preset_actions(preset, torch.float32, True).astype(np.float64)
    out = {}
    for mode, (dtype, islands) in MODES.items():
        if mode != "float32":
            d = np.abs(preset_actions(preset, dtype, islands) - ref)
            out[mode] = {"max_abs": float(d.max()), "mean_abs": float(d.mean())}
    return {f"preset_{preset}": out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", type=Path, default=DEFAULT_CASES)
    parser.add_argument("--preset", help="also measure this preset with random weights and inputs (e.g. bench)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    torch.set_float32_matmul_precision("highest")
    result = measure(args.cases)
    if args.preset:
        result |= measure_preset(args.preset)
    for case, modes in result.items():
        for mode, r in modes.items():
            print(f"{case} {mode:13s} max |d actions| {r['max_abs']:.4f}  mean {r['mean_abs']:.5f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
