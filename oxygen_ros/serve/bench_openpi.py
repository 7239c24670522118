"""`python -m oxygen_ros.bench --openpi-clients 1,2,4 --json OUT`: openpi clients on one engine.

For each client count N, N openpi-client `WebsocketClientPolicy`s (one thread each, as N robot programs)
call `infer` in a closed loop (a new observation as soon as the previous chunk arrives), or with --rate-hz at
a fixed cadence with a random phase each (a robot asking every open-loop horizon), with random images and
state of the robot config's shapes (like openpi's simple_client), against an `oxygen_serve` server in this
process on random weights of --preset with the robot config's policy I/O, in two modes on the same engine:

  batched        every client is a robot of the engine: whatever observations wait when a cycle starts are
                 prefilled in one forward and denoised in one batch (this package);
  one_at_a_time  the server computes one client's observation at a time, as openpi's server does (its
                 handler runs policy.infer inline, so its event loop serves one request at a time).

Per client: infer latency p50/p99 measured by the client (send to reply, what a robot waits); overall:
chunks/s (all clients' replies per second of wall time) and the mean number of frames per engine cycle.
Each client first makes --warmup untimed calls; the settings are repeated --repeat times, interleaved (a
change of load on a shared machine then hits every setting), and summarised over the repetitions.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

from .layouts import LAYOUTS


def observation(layout, rng: np.random.Generator, size: int) -> dict:
    """Random images and state in the layout's keys (ALOHA: CHW images, as its clients send them)."""
    msg: dict = {"prompt": "pick up the cup"}
    for camera in layout.cameras:
        shape = (3, size, size) if layout.name == "aloha" else (size, size, 3)
        image = rng.integers(0, 256, shape, dtype=np.uint8)
        if len(camera.path) == 2:
            msg.setdefault(camera.path[0], {})[camera.path[1]] = image
        else:
            msg[camera.key] = image
    for part in layout.state:
        msg[part.key] = rng.uniform(0.1, 0.9, part.size)
    return msg


def run_clients(port: int, layout, n: int, requests: int, warmup: int, image_size: int, seed: int,
                rate_hz: float = 0.0) -> dict:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    policies = [WebsocketClientPolicy("127.0.0.1", port) for _ in range(n)]
    latencies: list[list[float]] = [[] for _ in range(n)]
    cycle_frames: list[int] = []
    errors: list[str] = []
    barrier = threading.Barrier(n + 1)

    def client(i: int) -> None:
        rng = np.random.default_rng([seed, i])
        try:
            for _ in range(warmup):
                policies[i].infer(observation(layout, rng, image_size))
            barrier.wait()
            t0 = time.perf_counter() + (rng.uniform(0, 1 / rate_hz) if rate_hz else 0.0)   # a random phase
            for k in range(requests):
                obs = observation(layout, rng, image_size)
                if rate_hz:             # a robot asks at its own cadence (or at once when it is late)
                    time.sleep(max(0.0, t0 + k / rate_hz - time.perf_counter()))
                t = time.perf_counter()
                reply = policies[i].infer(obs)
                latencies[i].append(time.perf_counter() - t)
                cycle_frames.append(reply["policy_timing"]["cycle_frames"])
        except Exception as e:  # noqa: BLE001 - reported in the result, the other clients go on
            errors.append(f"client {i}: {type(e).__name__}: {e}")
            barrier.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    for p in policies:
        p._ws.close()
    if errors:
        raise RuntimeError("; ".join(errors))
    ms = [1e3 * np.array(x) for x in latencies]
    every = np.concatenate(ms)
    return {
        "clients": n, "requests_per_client": requests, "wall_s": round(wall, 3),
        "chunks_per_s": n * requests / wall,
        "infer_ms_p50": float(np.percentile(every, 50)), "infer_ms_p99": float(np.percentile(every, 99)),
        "per_client": [{"infer_ms_p50": float(np.percentile(x, 50)), "infer_ms_p99": float(np.percentile(x, 99))}
                       for x in ms],
        "mean_cycle_frames": float(np.mean(cycle_frames)),
        "infer_ms": [float(v) for v in every],
    }


def summarise(runs: list[dict]) -> dict:
    """One setting over its repetitions: latency percentiles over every infer, chunks/s the median run's."""
    every = np.concatenate([r["infer_ms"] for r in runs])
    return {"clients": runs[0]["clients"], "mode": runs[0]["mode"], "repetitions": len(runs),
            "infer_ms_p50": float(np.percentile(every, 50)), "infer_ms_p99": float(np.percentile(every, 99)),
            "chunks_per_s": float(np.median([r["chunks_per_s"] for r in runs])),
            "chunks_per_s_runs": [round(r["chunks_per_s"], 2) for r in runs],
            "mean_cycle_frames": float(np.mean([r["mean_cycle_frames"] for r in runs]))}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oxygen_ros.bench --openpi-clients",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--openpi-clients", required=True, help="comma-separated client counts, e.g. 1,2,4")
    p.add_argument("--robot", choices=sorted(set(LAYOUTS) - {"demo"}), default="droid",
                   help="robot config: policy I/O and openpi keys")
    p.add_argument("--preset", choices=("tiny", "bench", "pi05"), default="tiny", help="model size (random weights)")
    p.add_argument("--requests", type=int, default=20, help="timed infers per client")
    p.add_argument("--warmup", type=int, default=2, help="untimed infers per client first")
    p.add_argument("--repeat", type=int, default=3, help="repetitions, interleaved over the settings")
    p.add_argument("--image-size", type=int, default=224, help="camera images sent (square, pixels)")
    p.add_argument("--rate-hz", type=float, default=0.0,
                   help="each client asks at this rate with a random phase, as a robot at its control cadence "
                        "(e.g. 1.875: DROID's 8 rows at 15 Hz); 0: closed loop, as fast as replies come")
    p.add_argument("--modes", default="batched,one_at_a_time")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        counts = [int(x) for x in a.openpi_clients.split(",")]
    except ValueError:
        parser.error(f"--openpi-clients {a.openpi_clients!r}: comma-separated integers, e.g. 1,2,4")
    modes = a.modes.split(",")
    if any(n < 1 for n in counts) or a.requests < 1 or a.warmup < 0 or a.repeat < 1 or not a.rate_hz >= 0 or \
            not set(modes) <= {"batched", "one_at_a_time"}:
        parser.error("client counts and --requests must be positive, --warmup >= 0, --modes batched,one_at_a_time")
    import torch

    from oxygen_ros.engine.engine import EngineConfig
    from oxygen_ros.engine.factory import build_engine, model_config
    from oxygen_ros.robot.configs import find_config, node_params
    from oxygen_ros.robot.policy_io import RobotIOConfig

    from .server import ServeOptions, openpi_server

    if a.threads:
        torch.set_num_threads(a.threads)
    load = os.getloadavg()[0]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    params = node_params(find_config(a.robot), "oxygen_engine")
    cfg = model_config(a.preset, action_horizon=params["action_horizon"], max_token_len=params["max_token_len"])
    max_clients = max(counts)
    engine = build_engine(cfg, robot_io=RobotIOConfig.from_params(params), state_in_prompt=params["state_in_prompt"],
                          device=a.device, kv_budget_mb=256.0, seed=a.seed,
                          engine=EngineConfig(max_robots_per_cycle=max(8, max_clients)))
    template = engine.preparer
    engine.remove_robot("")
    engine.start()
    layout = LAYOUTS[a.robot]
    runs = []
    try:
        for rep in range(a.repeat):            # interleaved: a load change on the machine hits every setting
            for n in counts:
                for mode in modes:
                    server = openpi_server(engine, layout, ServeOptions(port=0, max_clients=n,
                                                                        serial=mode == "one_at_a_time"), template)
                    server.start()
                    try:
                        point = run_clients(server.port, layout, n, a.requests, a.warmup, a.image_size,
                                            a.seed + rep, a.rate_hz)
                    finally:
                        server.stop()
                    runs.append({"repetition": rep, "mode": mode, **point})
                    print(f"[bench openpi] rep {rep + 1}/{a.repeat} {n} client(s) {mode:13s}: infer p50 "
                          f"{point['infer_ms_p50']:7.1f} ms, p99 {point['infer_ms_p99']:7.1f} ms, "
                          f"{point['chunks_per_s']:6.2f} chunks/s, {point['mean_cycle_frames']:.2f} frames/cycle",
                          flush=True)
    finally:
        engine.stop()
    summary = [summarise([r for r in runs if r["clients"] == n and r["mode"] == mode])
               for n in counts for mode in modes]
    for row in summary:
        print(f"[bench openpi] {row['clients']} client(s) {row['mode']:13s}: infer p50 {row['infer_ms_p50']:7.1f} ms, "
              f"p99 {row['infer_ms_p99']:7.1f} ms, {row['chunks_per_s']:6.2f} chunks/s (median of {a.repeat}), "
              f"{row['mean_cycle_frames']:.2f} frames/cycle", flush=True)
    result = {
        "summary": summary,
        "runs": runs,
        "meta": {"command": "python -m oxygen_ros.bench " + " ".join(sys.argv[1:] if argv is None else argv),
                 "started": started, "preset": a.preset, "robot": a.robot, "action_horizon": cfg.action_horizon,
                 "image_size": a.image_size, "requests_per_client": a.requests, "warmup": a.warmup,
                 "repetitions": a.repeat, "rate_hz_per_client": a.rate_hz or "closed loop",
                 "device": a.device, "torch_threads": torch.get_num_threads(),
                 "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                 "load_avg_1min_start": load, "load_avg_1min_end": os.getloadavg()[0],
                 "note": __doc__.split("\n\n", 1)[1].strip()},
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.json}", flush=True)
    return 0
