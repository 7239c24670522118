"""The cost of real-time chunking: the engine's action step (CycleReport.action_s: denoising a frame's
chunk and converting it) with and without RTC guidance, on random weights of a model preset.

    python scripts/rtc_cost.py --preset tiny --preset bench --json docs/rtc_cost_cpu.json

Three engines on one model see the same observations (one row apart, so each chunk continues the last):
plain (RTC off: the engine's usual path, on a GPU Triton and the CUDA-graph loop), rtc_vjp (the paper's
correction: a backward pass per step, eager torch path) and rtc_error (LeRobot 0.6.1's: no backward pass),
both guided with a delay of --delay rows. Median over --repeats cycles after --warmup, the engines taking
turns (a change of load hits all of them).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.factory import build_engine, build_model, model_config
from oxygen_ros.robot.sync import Observation

VARIANTS = {"plain": dict(), "rtc_vjp": dict(rtc=True, rtc_correction="vjp"),
            "rtc_error": dict(rtc=True, rtc_correction="error")}


def measure(preset: str, device: str, repeats: int, warmup: int, delay: int) -> dict:
    cfg = model_config(preset)
    model = build_model(cfg, device=device)
    engines = {name: build_engine(built_model=model, engine=EngineConfig(rtc_delay_rows=delay, **extra),
                                  kv_budget_mb=64.0) for name, extra in VARIANTS.items()}
    size, rate = cfg.vision.image_size, EngineConfig().action_rate_hz
    rng = np.random.default_rng(0)
    images = {s: rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for s in cfg.camera_slots}
    noise = rng.standard_normal((cfg.action_horizon, cfg.action_dim)).astype(np.float32)
    times = {name: [] for name in engines}
    for i in range(warmup + repeats):
        obs = Observation(i / rate, images, dict.fromkeys(cfg.camera_slots, True), np.zeros(8), "pick up the cup")
        for name, engine in engines.items():
            report = engine.run_cycle(obs, noise)
            guided = engine.latest_chunk().rtc_delay_rows is not None
            if guided != (name != "plain" and i > 0):
                raise RuntimeError(f"{name}: cycle {i} {'was' if guided else 'was not'} guided")
            if i >= warmup:
                times[name].append(report.action_s)
    out = {f"{name}_ms": round(1e3 * statistics.median(t), 3) for name, t in times.items()}
    out["ratio_vjp"] = round(out["rtc_vjp_ms"] / out["plain_ms"], 2)
    out["ratio_error"] = round(out["rtc_error_ms"] / out["plain_ms"], 2)
    plain = engines["plain"].runner
    out.update(steps=cfg.num_denoise_steps, horizon=cfg.action_horizon, attention=plain.backend,
               plain_path="CUDA graph" if plain.graphs is not None and device == "cuda" else "eager",
               rtc_path="eager, torch attention and norms")
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
    if a.warmup < 1 or a.repeats < 1:
        p.error("--warmup and --repeats must be >= 1 (the first cycle has no chunk to continue)")
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
