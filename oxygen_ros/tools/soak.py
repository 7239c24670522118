"""Soak run: the threaded engine fed by a simulated camera and a continuous stream of language requests
for a long time; checks for leaks (KV pool back to empty, process memory flat) and deadline drift.

    python -m oxygen_ros.tools.soak --minutes 30 --json soak.json      # the documented long run
    python -m oxygen_ros.tools.soak --seconds 40                        # the CI-sized run

Prints what it ran and a JSON summary: requests submitted/answered/refused/failed (nothing may be
unanswered), pool blocks in use at the end, RSS at the start of the second quarter and at the end
(the first quarter is warm-up: allocator pools fill), frame time (recent window) after the first quarter and at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time

import numpy as np
import torch


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(seconds: float, preset: str = "tiny", camera_hz: float = 15.0, request_hz: float = 4.0,
        max_tokens: int = 12, policy: str = "oxygen", seed: int = 0) -> dict:
    from oxygen_ros.engine.config import EngineConfig
    from oxygen_ros.engine.factory import build_engine
    from oxygen_ros.engine.requests import TextRequest
    from oxygen_ros.robot.policy_io import RobotIOConfig
    from oxygen_ros.robot.sync import Observation

    engine = build_engine(preset, engine=EngineConfig(policy=policy, memory_period_s=2.0, memory_max_tokens=8),
                          kv_budget_mb=64.0, robot_io=RobotIOConfig(robot_action_dim=7), seed=seed)
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(8)]
    stop = threading.Event()
    # Replies are tallied by done callbacks and the handles dropped: holding every handle would itself grow
    # the process (7,000 requests in 30 minutes); only requests in flight are kept, to check none is left.
    lock = threading.Lock()
    in_flight: set = set()
    tally = {"requests": 0, "answered": 0, "refused": 0, "failed": 0}
    reasons: set = set()

    def on_reply(handle, reply):
        with lock:
            in_flight.discard(handle)
            key = "answered" if reply.success else "refused" if reply.finish_reason == "refused" else "failed"
            tally[key] += 1
            if not reply.success and len(reasons) < 5:
                reasons.add(f"{reply.finish_reason}: {reply.error}")
    samples = []   # (t, rss_mb, pool_used, frame_ms_mean of the window)

    def camera():
        i = 0
        while not stop.is_set():
            engine.submit_observation(Observation(
                stamp_s=time.time(), images={"base_0_rgb": images[i % 8], "left_wrist_0_rgb": images[(i + 3) % 8],
                                             "right_wrist_0_rgb": None},
                image_masks={"base_0_rgb": True, "left_wrist_0_rgb": True, "right_wrist_0_rgb": False},
                state=np.sin(np.arange(8) + i * 0.1), prompt="pick up the red cup"))
            i += 1
            stop.wait(1.0 / camera_hz)

    def requester():
        r = np.random.default_rng(seed + 1)
        while not stop.wait(r.exponential(1.0 / request_hz)):
            h = engine.submit(TextRequest("what is on the table?", max_tokens=int(r.integers(4, max_tokens + 1)),
                                          timeout_s=20.0))
            with lock:
                tally["requests"] += 1
                in_flight.add(h)
            h.add_done_callback(lambda reply, h=h: on_reply(h, reply))

    threads = [threading.Thread(target=camera), threading.Thread(target=requester)]
    engine.start()
    start = time.monotonic()
    for t in threads:
        t.start()
    frames_seen = 0
    while time.monotonic() - start < seconds:
        time.sleep(min(1.0, seconds / 20))
        s = engine.stats.snapshot()
        samples.append((time.monotonic() - start, rss_mb(), s["pool_blocks_used"], s["frame_ms_mean"]))
        frames_seen = s["frames"]
    stop.set()
    for t in threads:
        t.join()
    # Drain: every request still in flight finishes (or times out) before the engine stops.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (engine.active_requests or engine.queued_requests):
        time.sleep(0.1)
    engine.stop()      # answers anything still unfinished with an error: nothing is left without a reply
    q = max(1, len(samples) // 4)
    out = {
        "what": f"threaded engine, {preset} preset, policy {policy}, camera {camera_hz} Hz, "
                f"Poisson requests {request_hz}/s, {seconds:.0f} s",
        "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "torch": torch.__version__, "seconds": seconds, "frames": frames_seen,
        **tally,
        "unanswered": len(in_flight),
        "failure_reasons": sorted(reasons),
        "pool_blocks_used_at_end": engine.stats.snapshot()["pool_blocks_used"],
        "pool_peak_blocks": engine.stats.snapshot()["pool_peak_blocks"],
        "rss_mb_after_warmup": samples[q][1] if len(samples) > q else samples[-1][1],
        "rss_mb_end": samples[-1][1],
        # frame time over the stats window at the end of the first and of the last quarter: drift shows here
        "frame_ms_early": samples[q - 1][3], "frame_ms_late": samples[-1][3],
        "deadline_misses": engine.stats.counter("deadline_misses"),
        "captions": len(engine.captions()),
        "samples": [[round(t, 1), round(m, 1), u, f] for t, m, u, f in samples],
    }
    out["rss_growth_mb"] = out["rss_mb_end"] - out["rss_mb_after_warmup"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--minutes", type=float, default=0.0)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--request-hz", type=float, default=4.0)
    p.add_argument("--json", help="write the summary here")
    a = p.parse_args(argv)
    seconds = a.seconds or a.minutes * 60 or 60.0
    print(f"soak: {seconds:.0f} s, preset {a.preset}, requests {a.request_hz}/s", flush=True)
    out = run(seconds, a.preset, request_hz=a.request_hz)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
