"""Peak resident memory while loading a full-size π0.5 checkpoint (docs/robots.md, "Getting a checkpoint").

    python scripts/measure_checkpoint_load.py write <folder> --dtype bfloat16    # ~7 GB (float32: ~14.5 GB)
    python scripts/measure_checkpoint_load.py load <folder> --dtype bfloat16     # prints one JSON line (served in --dtype)

`write` lays out random weights as LeRobot publishes pi05 (model.safetensors with `model.` keys, embed_tokens and
lm_head both stored), one tensor at a time straight to the file, so the writer never holds the model. `load` runs
the engine's loader (load_pi05) into the serving dtype in this process and reports the peak resident set
(getrusage) after the load and after every weight was read once (what the first chunk does), the file size and
their ratio. Write the folder outside the repository and delete it afterwards.
"""
from __future__ import annotations

import argparse
import json
import resource
import struct
import sys
import time
from pathlib import Path

import torch

DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float32": (torch.float32, "F32")}


def write(folder: Path, dtype: str) -> None:
    from oxygen_ros.model.checkpoint import EMBED_TOKENS, openpi_name
    from oxygen_ros.model.config import preset
    from oxygen_ros.model.pi05 import Pi05

    torch_dtype, tag = DTYPES[dtype]
    with torch.device("meta"):
        model = Pi05(preset("pi05"))
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
    print(f"wrote {folder / 'model.safetensors'}: {offset / 1e9:.2f} GB of {dtype}")


def load(folder: Path, dtype: str) -> None:
    """Load into `dtype` (the serving dtype; the file's own dtype is whatever `write` wrote)."""
    from oxygen_ros.model.checkpoint import load_pi05
    from oxygen_ros.model.config import preset

    start = time.monotonic()
    model = load_pi05(folder, preset("pi05"), dtype=DTYPES[dtype][0])
    seconds = time.monotonic() - start
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024          # kB on Linux
    with torch.no_grad():           # every weight read once, as the first chunk does: all of it resident
        for p in [*model.parameters(), *([model.lm_head] if model.lm_head is not None else [])]:
            flat = p.reshape(-1)
            for i in range(0, flat.numel(), 1 << 22):          # a block at a time: no float copy of a whole tensor
                flat[i:i + (1 << 22)].float().sum()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    on_disk = (folder / "model.safetensors").stat().st_size
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"dtype": dtype, "file_bytes": on_disk, "model_bytes": held, "peak_rss_after_load_bytes": loaded, "peak_rss_bytes": peak,
                      "peak_over_file": round(peak / on_disk, 3), "load_s": round(seconds, 1),
                      "torch": torch.__version__, "python": sys.version.split()[0]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["write", "load"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="write: the file's dtype; load: the serving dtype")
    args = parser.parse_args()
    (write if args.action == "write" else load)(args.folder, args.dtype)


if __name__ == "__main__":
    main()
