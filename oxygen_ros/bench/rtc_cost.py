"""The cost of real-time chunking (issue #22): the engine's action step (`CycleReport.action_s`: denoising a
frame's chunk and converting it) with and without RTC guidance, on the benchmark's model.

Four engines on that model see the same observations (one control period apart, so each chunk continues
the last): plain (RTC off: the engine's usual path, on a GPU Triton and the CUDA-graph denoise loop),
rtc_vjp (the paper's correction: a backward pass through the action expert per flow step, eager torch
path), rtc_error (LeRobot 0.6.1's and the engine's default: no backward pass) and rtc_prefix (the pinned
rows given to a model trained with prefix conditioning: no guidance, the runner's kernels, eager), all with a
delay of `delay` rows. Median over `repeats` cycles after `warmup`, the engines taking turns (a change of load
hits all of them). The first cycle has no chunk to continue, so `warmup` >= 1.

The cost does not depend on the weights: for rtc_prefix the benchmark's model is declared trained with
prefix conditioning while it is measured.
"""
from __future__ import annotations

import statistics

import numpy as np

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.factory import build_engine
from oxygen_ros.robot.sync import Observation

VARIANTS = {"plain": dict(), "rtc_vjp": dict(rtc=True, rtc_correction="vjp"),
            "rtc_error": dict(rtc=True, rtc_correction="error"), "rtc_prefix": dict(rtc=True, rtc_correction="prefix")}


def measure(model, cfg, *, repeats: int = 5, warmup: int = 2, delay: int = 3, kv_budget_mb: float = 64.0,
            denoise_steps: int | None = None, cuda_graphs: bool | None = None, prompt: str = "pick up the cup") -> dict:
    if warmup < 1 or repeats < 1:
        raise ValueError("the RTC cost needs warmup >= 1 (the first cycle has no chunk to continue) and repeats >= 1")
    declared = model.cfg
    model.cfg = declared.replace(prefix_conditioning=True)
    try:
        return _measure(model, cfg, repeats, warmup, delay, kv_budget_mb, denoise_steps, cuda_graphs, prompt)
    finally:
        model.cfg = declared


def _measure(model, cfg, repeats, warmup, delay, kv_budget_mb, denoise_steps, cuda_graphs, prompt) -> dict:
    # No language here: one decode bucket keeps the CUDA-graph captures of the engines short.
    engines = {name: build_engine(built_model=model, engine=EngineConfig(rtc_delay_rows=delay, denoise_steps=denoise_steps,
                                                              cuda_graphs=cuda_graphs, max_active_requests=1, **extra),
                                  kv_budget_mb=kv_budget_mb) for name, extra in VARIANTS.items()}
    size, rate = cfg.vision.image_size, EngineConfig().action_rate_hz
    rng = np.random.default_rng(0)
    images = {s: rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for s in cfg.camera_slots}
    noise = rng.standard_normal((cfg.action_horizon, cfg.action_dim)).astype(np.float32)
    times = {name: [] for name in engines}
    for i in range(warmup + repeats):
        obs = Observation(i / rate, images, dict.fromkeys(cfg.camera_slots, True), np.zeros(8), prompt)
        for name, engine in engines.items():
            report = engine.run_cycle(obs, noise)
            guided = engine.latest_chunk().rtc_delay_rows is not None
            if guided != (name != "plain" and i > 0):       # the figure would not be what it says
                raise RuntimeError(f"RTC cost, {name}: cycle {i} {'was' if guided else 'was not'} guided")
            if i >= warmup:
                times[name].append(report.action_s)
    out = {f"{name}_ms": round(1e3 * statistics.median(t), 3) for name, t in times.items()}
    out["ratio_vjp"] = round(out["rtc_vjp_ms"] / out["plain_ms"], 2)
    out["ratio_error"] = round(out["rtc_error_ms"] / out["plain_ms"], 2)
    out["ratio_prefix"] = round(out["rtc_prefix_ms"] / out["plain_ms"], 2)
    plain = engines["plain"].runner
    out.update(delay_rows=delay, repeats=repeats, warmup=warmup, steps=denoise_steps or cfg.num_denoise_steps,
               horizon=cfg.action_horizon, attention=plain.backend,
               plain_path="CUDA graph" if plain.graphs is not None and model.device.type == "cuda" else "eager",
               rtc_path="eager, torch attention and norms", prefix_path=f"eager, {plain.backend} attention",
               definition=__doc__.split("\n\n")[1].replace("\n", " "))
    return out
