"""LeRobot's own, unchanged robot_client driving the demo arm through `oxygen_serve --protocol lerobot`.

Runs from the oxygen_ros environment; the robot_client runs in a LeRobot 0.6.1 environment (Python 3.12)
given by --lerobot-python (or LEROBOT_PYTHON) with the plugin tools/lerobot_robot_oxygen_demo installed:

    python3.12 -m venv ../lerobot061
    ../lerobot061/bin/pip install 'lerobot[pi,async]==0.6.1' mujoco -e tools/lerobot_robot_oxygen_demo
    python scripts/lerobot_client_eval.py --lerobot-python ../lerobot061/bin/python --episodes 20 \\
        --clients 1,2,4 --json docs/lerobot_client_eval.json

For each number of clients K: one `oxygen_serve --protocol lerobot --robot demo` (the shipped demo weights),
then the episodes in waves of K robot_client processes at once, each its own episode (episode k of --seed,
drawn as `python -m oxygen_ros.eval` draws it: the same scenes and named cubes), each with the episode's
prompt as --task. An episode ends when the tip touches the named cube (success) or after --steps actions;
the plugin writes the outcome and the client is stopped (SIGINT). The server's summary at its stop gives
the chunks served, the rate at which each client got them while it ran (chunks/s per client; x K: the
engine's rate for K clients at once) and their latency (an observation's arrival to its chunk's reply).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start_server(log: list[str], timeout_s: float) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "oxygen_ros.serve", "--protocol", "lerobot", "--robot", "demo",
                             "--port", "0"], cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        log.append(line.rstrip("\n"))
        found = re.search(r"listening for LeRobot robot_client on \S+:(\d+)", line)
        if found:
            threading.Thread(target=lambda: log.extend(x.rstrip("\n") for x in proc.stdout), daemon=True).start()
            return proc, int(found.group(1))
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("oxygen_serve did not start:\n" + "\n".join(log[-30:]))


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def client_command(args, port: int, episode: int, prompt: str, result: Path) -> list[str]:
    return [args.lerobot_python, "-m", "lerobot.async_inference.robot_client", f"--server_address=127.0.0.1:{port}",
            "--robot.type=oxygen_demo", f"--robot.seed={args.seed}", f"--robot.episode={episode}",
            f"--robot.steps={args.steps}", f"--robot.result_file={result}", f"--task={prompt}",
            "--policy_type=pi05", "--pretrained_name_or_path=oxygen_ros/demo", "--policy_device=cpu",
            f"--actions_per_chunk={args.actions_per_chunk}", f"--chunk_size_threshold={args.chunk_size_threshold}",
            f"--fps={args.fps}"]


def run_wave(args, port: int, episodes: list[int], folder: Path) -> list[dict]:
    """K robot_client processes at once, one episode each; their outcomes (a timeout counts as a failure)."""
    from oxygen_ros.sim.scene import draw_episode

    env = dict(os.environ, PYTHONPATH=str(REPO), MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    procs = {}
    for k in episodes:
        result = folder / f"episode_{k}.json"
        with open(folder / f"client_{k}.log", "w") as out:
            procs[k] = (subprocess.Popen(client_command(args, port, k, draw_episode(args.seed, k).prompt, result),
                                         cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT), result)
    deadline = time.monotonic() + args.episode_timeout
    while time.monotonic() < deadline and not all(r.exists() or p.poll() is not None for p, r in procs.values()):
        time.sleep(0.2)
    outcomes = []
    for k, (proc, result) in procs.items():
        code = stop(proc)
        if result.exists():
            outcomes.append(json.loads(result.read_text()))
        else:
            tail = (folder / f"client_{k}.log").read_text()[-1500:]
            outcomes.append({"seed": args.seed, "episode": k, "success": False, "error":
                             f"no outcome (client exit {code}, timeout {args.episode_timeout} s): {tail}"})
    return outcomes


def run_setting(args, clients: int, episodes: int) -> dict:
    log: list[str] = []
    start, load = time.monotonic(), os.getloadavg()[0]
    proc, port = start_server(log, args.server_timeout)
    outcomes = []
    try:
        with tempfile.TemporaryDirectory(prefix="lerobot_client_eval_") as tmp:
            for first in range(0, episodes, clients):
                wave = list(range(first, min(first + clients, episodes)))
                outcomes += run_wave(args, port, wave, Path(tmp))
                print(f"[{clients} client(s)] episodes {wave}: "
                      f"{[('ok' if o['success'] else 'FAIL') for o in outcomes[-len(wave):]]}", flush=True)
    finally:
        code = stop(proc)
    served = [line for line in log if "LeRobot chunks served:" in line]
    summary = json.loads(served[-1].split("LeRobot chunks served: ", 1)[1]) if served else None
    return {"clients": clients, "episodes": len(outcomes),
            "success_rate": sum(o["success"] for o in outcomes) / len(outcomes),
            "server": summary, "server_exit": code,
            "chunks_per_s_all_clients": summary["chunks_per_s_per_client"] * clients
            if summary and summary.get("chunks_per_s_per_client") else None,
            "outcomes": outcomes, "wall_s": round(time.monotonic() - start, 1),
            "load_avg_1min": {"start": load, "end": os.getloadavg()[0]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lerobot-python", default=os.environ.get("LEROBOT_PYTHON"),
                        help="the LeRobot 0.6.1 environment's python (default: $LEROBOT_PYTHON)")
    parser.add_argument("--episodes", type=int, default=20, help="episodes with one client (the success rate)")
    parser.add_argument("--clients", default="1,2,4", help="comma-separated numbers of clients at once")
    parser.add_argument("--episodes-per-client", type=int, default=2,
                        help="with K > 1 clients: K x this many episodes (the rates and latency)")
    parser.add_argument("--seed", type=int, default=1000, help="episode seed (python -m oxygen_ros.eval's default)")
    parser.add_argument("--steps", type=int, default=210, help="actions per episode before it fails (70 Hz ticks)")
    parser.add_argument("--actions-per-chunk", type=int, default=20, help="robot_client --actions_per_chunk")
    parser.add_argument("--chunk-size-threshold", type=float, default=0.5, help="robot_client --chunk_size_threshold")
    parser.add_argument("--fps", type=int, default=70, help="robot_client --fps (the demo arm's control rate)")
    parser.add_argument("--episode-timeout", type=float, default=300.0, help="seconds a wave of clients may take")
    parser.add_argument("--server-timeout", type=float, default=300.0, help="seconds oxygen_serve may take to start")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    if not args.lerobot_python:
        parser.error("give --lerobot-python (or set LEROBOT_PYTHON): a LeRobot 0.6.1 environment's python")
    # Absolute (the clients run in a scratch folder), not resolved: a venv's python is a link to its base.
    args.lerobot_python = os.path.abspath(args.lerobot_python)
    results = []
    for clients in (int(c) for c in args.clients.split(",")):
        episodes = args.episodes if clients == 1 else clients * args.episodes_per_client
        results.append(run_setting(args, clients, episodes))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "outcomes"}), flush=True)
    out = {"command": "python scripts/lerobot_client_eval.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "lerobot": "0.6.1 robot_client (python -m lerobot.async_inference.robot_client), plugin "
                      "tools/lerobot_robot_oxygen_demo",
           "server": "oxygen_serve --protocol lerobot --robot demo (the shipped demo weights)",
           "seed": args.seed, "steps": args.steps, "actions_per_chunk": args.actions_per_chunk,
           "chunk_size_threshold": args.chunk_size_threshold, "fps": args.fps,
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "results": results}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
