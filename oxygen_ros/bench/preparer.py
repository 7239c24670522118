"""`python -m oxygen_ros.bench.preparer`: what full-resolution camera images cost the frame cycle, with the
conversion on the engine thread (`prepare_ahead` off) and on the preparer thread (on).

The engine runs its own thread; a camera thread submits a fresh image of the given size at --camera-hz.
The two modes alternate in --segments slices of --seconds each (a fresh engine per slice, the same model),
so that load from other jobs falls on both alike. Figures per mode, over its slices: frame cycle time (what
the conversion adds to the cycle when it runs inline), chunks per second, and the age of each chunk's
observation when the chunk was ready (submitted -> chunk, engine clock).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np
import torch

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.model_runner import ModelRunner
from oxygen_ros.model.config import CAMERA_SLOTS
from oxygen_ros.robot.sync import Observation


class DeviceBoundRunner(ModelRunner):
    """A device-bound cycle: each action step also keeps the engine thread waiting `device_s` while the CPU
    is free (what a GPU does), so the preparer thread's gain can be measured on a CPU-only host."""

    def __init__(self, model, pool, backend: str, device_s: float):
        super().__init__(model, pool, backend)
        self.device_s = device_s

    def actions(self, *args, **kwargs):
        time.sleep(self.device_s)
        return super().actions(*args, **kwargs)


def measure(model, size: tuple[int, int], prepare_ahead: bool, camera_hz: float, seconds: float,
            device_ms: float = 0.0) -> tuple:
    """One slice: (frame cycle durations, chunk ages, inline preparation seconds per frame)."""
    from oxygen_ros.engine.factory import build_engine

    engine = build_engine(built_model=model, engine=EngineConfig(prepare_ahead=prepare_ahead), kv_budget_mb=64.0,
                          make_runner=lambda net, pool, backend: DeviceBoundRunner(net, pool, backend, device_ms / 1e3))
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (*size, 3), dtype=np.uint8) for _ in range(4)]
    sent: dict[float, float] = {}
    ages: list[float] = []
    engine.add_chunk_listener(lambda c: ages.append(time.monotonic() - sent[c.plan.stamp_s]))
    stop = threading.Event()

    def camera():
        i = 0
        while not stop.is_set():
            stamp = float(i)
            sent[stamp] = time.monotonic()
            engine.submit_observation(Observation(
                stamp_s=stamp, images={s: images[(i + k) % 4] if k < 2 else None for k, s in enumerate(CAMERA_SLOTS)},
                image_masks={s: k < 2 for k, s in enumerate(CAMERA_SLOTS)}, state=np.zeros(8), prompt="pick up the cup"))
            i += 1
            stop.wait(1.0 / camera_hz)

    engine.start()
    cam = threading.Thread(target=camera, daemon=True)
    cam.start()
    time.sleep(seconds)
    stop.set()
    cam.join()
    engine.stop()
    cycles = [c for c in engine.stats._cycles if c.chunks]
    return [c.duration_s for c in cycles], ages, [c.prepare_s for c in cycles]


def summarize(size, prepare_ahead: bool, slices: list, seconds: float) -> dict:
    frame_s = np.array([x for f, _, _ in slices for x in f])
    ages = np.array([x for _, a, _ in slices for x in a])
    prep = np.array([x for _, _, p in slices for x in p])
    return {"image_hw": list(size), "prepare_ahead": prepare_ahead, "frames": len(frame_s),
            "frame_ms_mean": 1e3 * float(frame_s.mean()), "frame_ms_p99": 1e3 * float(np.percentile(frame_s, 99)),
            "prepare_ms_mean_on_engine_thread": 1e3 * float(prep.mean()),
            "chunks_per_s": len(frame_s) / (seconds * len(slices)),
            "chunk_age_ms_mean": 1e3 * float(ages.mean()), "chunk_age_ms_p99": 1e3 * float(np.percentile(ages, 99))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m oxygen_ros.bench.preparer", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--sizes", default="224x224,1080x1920,2160x3840", help="camera images HxW, comma-separated")
    p.add_argument("--camera-hz", type=float, default=30.0)
    p.add_argument("--seconds", type=float, default=3.0, help="per slice")
    p.add_argument("--segments", type=int, default=4, help="slices per mode, alternating")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device-ms", type=float, default=0.0,
                   help="simulate a device-bound cycle: the engine thread sleeps this long per frame")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from oxygen_ros.engine.factory import build_model, model_config

    model = build_model(model_config(a.preset))
    sizes = [tuple(int(x) for x in s.split("x")) for s in a.sizes.split(",")]
    load = os.getloadavg()[0]
    rows = []
    for size in sizes:
        slices = {False: [], True: []}
        for k in range(a.segments):
            for ahead in ((False, True) if k % 2 == 0 else (True, False)):
                slices[ahead].append(measure(model, size, ahead, a.camera_hz, a.seconds, a.device_ms))
        rows += [summarize(size, ahead, slices[ahead], a.seconds) for ahead in (False, True)]
    print(f"{'image':>10} {'ahead':>6} {'frame ms':>9} {'p99':>8} {'inline prep ms':>15} {'chunks/s':>9} "
          f"{'age ms':>8} {'age p99':>8}")
    for r in rows:
        print(f"{'x'.join(map(str, r['image_hw'])):>10} {str(r['prepare_ahead']):>6} {r['frame_ms_mean']:>9.1f} "
              f"{r['frame_ms_p99']:>8.1f} {r['prepare_ms_mean_on_engine_thread']:>15.1f} {r['chunks_per_s']:>9.2f} "
              f"{r['chunk_age_ms_mean'] or 0:>8.1f} {r['chunk_age_ms_p99'] or 0:>8.1f}")
    if a.json:
        meta = {"preset": a.preset, "camera_hz": a.camera_hz, "seconds_per_slice": a.seconds,
                "simulated_device_ms": a.device_ms,
                "slices_per_mode": a.segments, "torch_threads": a.threads,
                "cores": os.cpu_count(), "load_avg_start": load, "load_avg_end": os.getloadavg()[0],
                "command": "python -m oxygen_ros.bench.preparer " + " ".join(sys.argv[1:] if argv is None else argv)}
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "meta": meta}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
