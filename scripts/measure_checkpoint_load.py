"""Load time, time to the first chunk and peak resident memory of a π0.5 checkpoint (docs/robots.md, "Getting
a checkpoint").

    python scripts/measure_checkpoint_load.py write <folder> --dtype bfloat16    # ~7 GB (float32: ~14.5 GB)
    python scripts/measure_checkpoint_load.py load <folder> --dtype bfloat16     # prints one JSON line (served in --dtype)
    python scripts/measure_checkpoint_load.py write <folder> --preset bench      # a smaller model, the same steps

`write` lays out random weights of `--preset` (default pi05, the full size) as LeRobot publishes pi05
(model.safetensors with `model.` keys, embed_tokens and lm_head both stored, config.json with chunk_size 50), one
tensor at a time straight to the file, so the writer never holds the model. `load` runs what the engine node's
configure runs, in this process: the loader (load_pi05) into the serving dtype with the settings config.json
records, then the engine around the model (KV pool, policy I/O), then its first cycle on one LIBERO-like frame
(two 256 px cameras, an 8-dim state, the shipped small tokenizer: the weights are random). It reports the load
time, the first cycle's time and the time from the start to the first chunk, the next cycle's time (warm), the
peak resident set (getrusage) after the load, after the first chunk and after every weight was read once (the
first chunk leaves lm_head unread), the file size and their ratio. Write the folder outside the repository and
delete it afterwards.
"""
from __future__ import annotations

import argparse
import json
import resource
import struct
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float32": (torch.float32, "F32")}
PRESETS = ("tiny", "bench", "pi05")


def write(folder: Path, dtype: str, preset_name: str) -> None:
    from oxygen_ros.model.checkpoint import EMBED_TOKENS, openpi_name
    from oxygen_ros.model.config import preset
    from oxygen_ros.model.pi05 import Pi05

    torch_dtype, tag = DTYPES[dtype]
    with torch.device("meta"):
        model = Pi05(preset(preset_name))
    shapes = {"model." + openpi_name(n): tuple(p.shape) for n, p in model.named_parameters()}
    shapes["model." + EMBED_TOKENS] = shapes["model." + openpi_name("embed_tokens.weight")]
    size = torch.tensor([], dtype=torch_dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key in sorted(shapes):
        n = 1
        for d in shapes[key]:
            n *= d
        header[key] = {"dtype": tag, "shape": list(shapes[key]), "data_offsets": [offset, offset + n * size]}
        offset += n * size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key in sorted(shapes):
            tensor = torch.randn(shapes[key], generator=g, dtype=torch.float32).mul_(0.02).to(torch_dtype)
            f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    (folder / "config.json").write_text(json.dumps({"type": "pi05", "chunk_size": 50, "max_action_dim": 32}))
    print(f"wrote {folder / 'model.safetensors'}: {offset / 1e9:.2f} GB of {dtype} ({preset_name})")


def first_frame():
    """One LIBERO-like frame (base and wrist cameras at 256 px, the right wrist masked, an 8-dim state)."""
    from oxygen_ros.robot.sync import Observation

    rng = np.random.default_rng(0)
    images = {"base_0_rgb": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
              "left_wrist_0_rgb": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8), "right_wrist_0_rgb": None}
    return Observation(stamp_s=0.0, images=images, image_masks={k: v is not None for k, v in images.items()},
                       state=rng.uniform(-1, 1, 8), prompt="put the bowl on the plate")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024          # kB on Linux


def load(folder: Path, dtype: str, preset_name: str) -> None:
    """Load into `dtype` (the serving dtype; the file's own dtype is whatever `write` wrote), then the first
    chunk, as configure and the engine's first cycle do."""
    from oxygen_ros.engine.factory import build_engine, model_config
    from oxygen_ros.model.checkpoint import checkpoint_settings, load_pi05

    cfg = model_config(preset_name, **checkpoint_settings(folder))
    start = time.monotonic()
    model = load_pi05(folder, cfg, dtype=DTYPES[dtype][0])
    seconds = time.monotonic() - start
    loaded = peak_rss()
    # The KV pool: room for a few frames of this model (the engine refuses one that cannot hold two cycles);
    # pi05's prefix of ~1,000 tokens is 18 layers x 2 x 256 values a token: 36 MB in float32.
    engine = build_engine(built_model=model, kv_budget_mb=64.0 if preset_name != "pi05" else 256.0)
    frame = first_frame()
    noise = np.random.default_rng(1).standard_normal((cfg.action_horizon, cfg.action_dim)).astype(np.float32)
    cycle_start = time.monotonic()
    report = engine.run_cycle(frame, noise)
    first_chunk = time.monotonic()
    if report.chunks != 1 or report.fault:
        raise SystemExit(f"the first cycle gave no chunk: {report.fault or report}")
    after_chunk = peak_rss()
    engine.run_cycle(replace(frame, stamp_s=0.1), noise)
    warm_s = time.monotonic() - first_chunk
    with torch.no_grad():           # every weight read once (lm_head too): all of it resident
        for p in [*model.parameters(), *([model.lm_head] if model.lm_head is not None else [])]:
            flat = p.reshape(-1)
            for i in range(0, flat.numel(), 1 << 22):          # a block at a time: no float copy of a whole tensor
                flat[i:i + (1 << 22)].float().sum()
    peak = peak_rss()
    on_disk = (folder / "model.safetensors").stat().st_size
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"preset": preset_name, "dtype": dtype, "file_bytes": on_disk, "model_bytes": held,
                      "action_horizon": cfg.action_horizon, "denoise_steps": cfg.num_denoise_steps,
                      "load_s": round(seconds, 2), "first_cycle_s": round(first_chunk - cycle_start, 3),
                      "first_chunk_s": round(first_chunk - start, 2), "warm_cycle_s": round(warm_s, 3),
                      "peak_rss_after_load_bytes": loaded, "peak_rss_after_first_chunk_bytes": after_chunk,
                      "peak_rss_bytes": peak, "peak_over_file": round(peak / on_disk, 3),
                      "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                      "python": sys.version.split()[0]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["write", "load"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="write: the file's dtype; load: the serving dtype")
    parser.add_argument("--preset", choices=PRESETS, default="pi05", help="the model's size (pi05: the full size)")
    args = parser.parse_args()
    (write if args.action == "write" else load)(args.folder, args.dtype, args.preset)


if __name__ == "__main__":
    main()
