"""The cost of real-time chunking: one frame's action step (the flow-matching loop) with and without RTC
guidance, on random weights of a model preset, through ModelRunner.actions.

    python scripts/rtc_cost.py --preset tiny --preset bench --json docs/rtc_cost_cpu.json

Plain is the engine's path (on a GPU: Triton and the CUDA-graph loop); guided runs the torch path with
autograd (correction "vjp", the paper's) or without (correction "error", LeRobot 0.6.1's), eagerly.
Median of --repeats timed calls after --warmup, the variants taking turns.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.factory import build_engine, model_config
from oxygen_ros.model import rtc
from oxygen_ros.robot.sync import Observation


def measure(preset: str, device: str, repeats: int, warmup: int, delay: int) -> dict:
    cfg = model_config(preset)
    engine = build_engine(cfg, device=device, engine=EngineConfig(), kv_budget_mb=64.0)
    size = cfg.vision.image_size
    images = {s: torch.randint(0, 256, (size, size, 3), dtype=torch.uint8).numpy() for s in cfg.camera_slots}
    obs = Observation(0.0, images, dict.fromkeys(cfg.camera_slots, True), [0.0] * 8, "pick up the cup")
    runner, h, a = engine.runner, cfg.action_horizon, cfg.action_dim
    frame = runner.prefill_one(engine.preparer.prepare(obs).row, 0, 0.0)
    noise = torch.randn(1, h, a, generator=torch.Generator().manual_seed(0))
    guide = rtc.row_guide(torch.randn(h - delay, a), delay, h, h, a)
    variants = {"plain": dict(guides=None), "rtc_vjp": dict(guides=[guide], correction="vjp"),
                "rtc_error": dict(guides=[guide], correction="error")}
    times = {name: [] for name in variants}
    for i in range(warmup + repeats):      # the variants in turn: a change of load hits all of them
        for name, kwargs in variants.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            runner.actions([frame], noise, **kwargs)        # returns numpy: synchronised
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    out = {f"{name}_ms": round(1e3 * statistics.median(t), 3) for name, t in times.items()}
    out["ratio_vjp"] = round(out["rtc_vjp_ms"] / out["plain_ms"], 2)
    out["ratio_error"] = round(out["rtc_error_ms"] / out["plain_ms"], 2)
    out.update(steps=cfg.num_denoise_steps, horizon=h, attention=runner.backend,
               plain_path="CUDA graph" if runner.graphs is not None and device == "cuda" else "eager")
    frame.release()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", action="append", default=None, help="tiny, bench, ... (repeatable; default tiny)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--delay", type=int, default=3, help="rows with weight 1")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    result = {"presets": {name: measure(name, a.device, a.repeats, a.warmup, a.delay) for name in a.preset or ["tiny"]},
              "device": a.device, "torch_threads": a.threads,
              "machine": torch.cuda.get_device_name() if a.device == "cuda" else
              f"{platform.processor() or platform.machine()}, torch {torch.__version__}"}
    text = json.dumps(result, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
