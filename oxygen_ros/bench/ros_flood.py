"""`python -m oxygen_ros.bench.ros_flood`: the actions-first figures through ROS, as a robot sees them.

`oxygen_bringup --demo` runs in a child process (its own DDS domain); this process is the robot's side and
a hostile but legal DDS client. Phases, each in a fresh bringup:
  baseline:      the demo as it is (its demo client asks a question every 4 s, captions every 3 s);
  flood:         this process keeps --flood calls of /oxygen/converse in flight, each the longest question a
                 client may send (max_question_chars characters) with max_tokens 32;
  flood_busy:    the flood, plus --busy-threads pure-Python threads spinning inside the bringup's process
                 (what a robot's own Python code, a logger or a plugin does): they compete with the 70 Hz
                 timer for the interpreter lock.
Measured here, on the messages' arrival: publish_hz and publish_period_p99_ms on /oxygen/action (the
commands), chunks_per_s and max_chunk_gap_ms on /oxygen/action_chunk (a chunk the publisher took), and the
flood's replies (answered, refused, other; tokens per second). The first --warmup seconds of each phase
after the first command are not counted. --switch-interval-ms sets the bringup process's
sys.setswitchinterval (an experiment on the interpreter lock; Python's default is 5 ms).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

PHASES = ("baseline", "flood", "flood_busy")


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x = (x * 31 + 7) % 1_000_003          # pure Python: holds the interpreter lock between switches


def child(argv: list[str]) -> int:
    """Inside the bringup's process: start the busy threads, then run the bringup."""
    busy = int(os.environ.get("OXYGEN_BENCH_BUSY_THREADS", "0"))
    if os.environ.get("OXYGEN_BENCH_SWITCH_INTERVAL_MS"):
        sys.setswitchinterval(float(os.environ["OXYGEN_BENCH_SWITCH_INTERVAL_MS"]) / 1e3)
    stop = threading.Event()
    for _ in range(busy):
        threading.Thread(target=_busy, args=(stop,), daemon=True).start()
    from oxygen_ros.bringup import main

    try:
        return main(argv)
    finally:
        stop.set()


def run_phase(phase: str, a, domain: int, log) -> dict:
    import rclpy
    from rclpy.context import Context
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.node import Node
    from rclpy.qos import QoSProfile
    from std_msgs.msg import Float64MultiArray

    from oxygen_interfaces.msg import ActionChunk
    from oxygen_interfaces.srv import Converse

    params = Path(tempfile.mkstemp(suffix=".yaml")[1])
    params.write_text("oxygen_engine:\n  ros__parameters:\n"
                      f"    max_queued_requests: {max(64, a.flood)}\n    max_queued_per_owner: {max(64, a.flood)}\n")
    env = dict(os.environ, ROS_DOMAIN_ID=str(domain), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               OXYGEN_BENCH_BUSY_THREADS=str(a.busy_threads if phase == "flood_busy" else 0),
               OXYGEN_BENCH_SWITCH_INTERVAL_MS=str(a.switch_interval_ms or ""))
    proc = subprocess.Popen([sys.executable, "-m", "oxygen_ros.bench.ros_flood", "--child", "--demo",
                             "--params-file", str(params), "--status-period", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    os.environ["ROS_DOMAIN_ID"] = str(domain)
    ctx = Context()
    rclpy.init(context=ctx)
    node = Node("oxygen_bench_robot", context=ctx)
    commands, chunks, replies = [], [], []
    node.create_subscription(Float64MultiArray, "/oxygen/action", lambda m: commands.append(time.monotonic()),
                             QoSProfile(depth=100))
    node.create_subscription(ActionChunk, "/oxygen/action_chunk", lambda m: chunks.append(time.monotonic()),
                             QoSProfile(depth=100))
    client = node.create_client(Converse, "/oxygen/converse")
    executor = SingleThreadedExecutor(context=ctx)       # no busy-waiting thread of ours (docs/safety.md)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        start = time.monotonic()
        while not commands:
            if proc.poll() is not None or time.monotonic() - start > a.startup_timeout:
                raise RuntimeError(f"the bringup did not start ({proc.returncode}):\n" + "".join(lines[-30:]))
            time.sleep(0.1)
        question = ("What colour is the cube on the left of the table and how far is it from the gripper? "
                    * 100)[:a.max_question_chars]
        in_flight = [0]
        lock = threading.Lock()

        def done(future):
            with lock:
                in_flight[0] -= 1
            replies.append((time.monotonic(), future.result()))

        t0 = time.monotonic() + a.warmup
        t1 = t0 + a.seconds
        while time.monotonic() < t1:
            if phase != "baseline":
                while in_flight[0] < a.flood:
                    with lock:
                        in_flight[0] += 1
                    client.call_async(Converse.Request(text=question, max_tokens=32, timeout_s=60.0)) \
                        .add_done_callback(done)
            time.sleep(0.01)
    finally:
        executor.shutdown(timeout_sec=2.0)
        node.destroy_node()
        rclpy.shutdown(context=ctx)
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        params.unlink(missing_ok=True)
    cmd = np.array([t for t in commands if t0 <= t <= t1])
    chk = [t for t in chunks if t0 <= t <= t1]
    period = np.diff(cmd) if len(cmd) > 1 else np.zeros(1)
    gaps = np.diff([t0] + chk + [t1])
    answered = [r for t, r in replies if t0 <= t <= t1]
    out = {
        "publish_hz": (len(cmd) - 1) / (cmd[-1] - cmd[0]) if len(cmd) > 1 else 0.0,
        "publish_period_p99_ms": 1e3 * float(np.percentile(period, 99)),
        "publish_period_max_ms": 1e3 * float(period.max()),
        "chunks_per_s": len(chk) / a.seconds,
        "max_chunk_gap_ms": 1e3 * float(gaps.max()),
        "tokens_per_s": sum(r.tokens for r in answered if r.success) / a.seconds,
        "questions_answered": sum(r.success for r in answered),
        "questions_refused": sum(r.finish_reason == "refused" for r in answered),
        "questions_other": sum(not r.success and r.finish_reason != "refused" for r in answered),
        "busy_threads": a.busy_threads if phase == "flood_busy" else 0,
    }
    log(f"{phase:>10}: commands {out['publish_hz']:5.1f} Hz (period p99 {out['publish_period_p99_ms']:5.1f} ms, "
        f"max {out['publish_period_max_ms']:5.1f}), chunks {out['chunks_per_s']:5.1f}/s (largest gap "
        f"{out['max_chunk_gap_ms']:5.0f} ms), flood replies {out['questions_answered']} answered / "
        f"{out['questions_refused']} refused / {out['questions_other']} other, {out['tokens_per_s']:.1f} tok/s")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    p = argparse.ArgumentParser(prog="python -m oxygen_ros.bench.ros_flood", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="counted seconds per phase")
    p.add_argument("--warmup", type=float, default=5.0, help="uncounted seconds after the first command")
    p.add_argument("--flood", type=int, default=64, help="converse calls kept in flight")
    p.add_argument("--busy-threads", type=int, default=2)
    p.add_argument("--max-question-chars", type=int, default=2000)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="the bringup process's interpreter switch interval (default: Python's, 5 ms)")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    phases = [x for x in a.phases.split(",") if x]
    if not phases or any(x not in PHASES for x in phases) or a.seconds <= 0 or a.flood < 1:
        p.error(f"--phases from {PHASES}, --seconds > 0, --flood >= 1")
    domain = 1 + (os.getpid() * 13) % 100
    load = os.getloadavg()[0]
    result = {phase: run_phase(phase, a, domain, print) for phase in phases}
    result["meta"] = {"command": "python -m oxygen_ros.bench.ros_flood " + " ".join(argv), "cores": os.cpu_count(),
                      "load_avg_start": load, "load_avg_end": os.getloadavg()[0],
                      "date": time.strftime("%Y-%m-%d"), "note": __doc__.split("\n\n")[1].strip()}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
