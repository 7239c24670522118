"""oxygen_bringup: one process, one engine, the three nodes around it (plus the simulated robot with
--demo). Works with the ROS 2 wheels from PyPI (no ros2 CLI, no launch) and on a robot's ROS 2 install.

    oxygen_bringup --robot libero --params-file my_overrides.yaml
    oxygen_bringup --demo                       # trained demo model + MuJoCo robot, closes the loop

Threads: the engine thread owns the device; the action publisher (70 Hz timer), the inputs and the
services each have an executor thread of their own (see main), so image decoding or a service call never
delays the timer and rclpy's own Python overhead does not starve the engine. Python's GIL is shared with
the engine's Python code, so the interpreter's switch interval is lowered (5 ms -> 1 ms): measured on 2
cores, the timer otherwise fell to 46-66 Hz next to a busy Python thread.
Shutdown (SIGINT/SIGTERM): actions stop first, then the engine releases the device, then ROS.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

CONFIG_DIRS = [Path(__file__).resolve().parents[1] / "config", Path(sys.prefix) / "share" / "oxygen_ros" / "config"]
ROBOTS = ("libero", "droid", "aloha", "demo")


def find_config(name: str) -> Path:
    """config/<name>.yaml from the source checkout or the installed share directory."""
    for d in CONFIG_DIRS:
        f = d / f"{name}.yaml"
        if f.is_file():
            return f
    raise FileNotFoundError(f"no {name}.yaml in {', '.join(map(str, CONFIG_DIRS))}")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="oxygen_bringup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--robot", choices=ROBOTS, help="robot config: config/<robot>.yaml")
    parser.add_argument("--params-file", action="append", default=[],
                        help="ROS parameters YAML (repeatable; later files override earlier ones)")
    parser.add_argument("--demo", action="store_true",
                        help="the trained demo model + the MuJoCo robot and cameras + a demo conversation client")
    parser.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: run)")
    parser.add_argument("--status-period", type=float, default=2.0, help="seconds between status lines")
    parser.add_argument("--threads", type=int, default=10,
                        help="threads of the services executor (streaming goals hold one each)")
    args, ros_args = parser.parse_known_args(argv)
    if args.demo and args.robot is None:
        args.robot = "demo"
    return args, ros_args


def demo_weights_params() -> Path:
    """A parameters file pointing the engine at the shipped demo weights (their path depends on where the
    package is installed, so config/demo.yaml cannot name it)."""
    import hashlib
    import tempfile

    from .eval import demo_checkpoint

    weights = demo_checkpoint()
    digest = hashlib.sha1(str(weights).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"oxygen_demo_weights_{digest}.yaml"
    path.write_text(f"oxygen_engine:\n  ros__parameters:\n    checkpoint: '{weights}'\n"
                    f"    norm_stats: '{weights / 'norm_stats.json'}'\n")
    return path


def status_line(engine, action, conversation) -> str:
    s = engine.stats.snapshot()
    r = action.rate.summary()
    return (f"[status] actions {r['rate_hz']:5.1f} Hz (jitter {r['period_ms_std']:.1f} ms, {action.last_status}) | "
            f"frame {s['frame_ms_mean']:6.1f} ms (prefill {s['prefill_ms_mean']:.0f}, actions {s['action_ms_mean']:.0f}, "
            f"text {s['decode_ms_mean']:.0f}) -> {s['action_hz']:5.1f} Hz chunk rate | "
            f"{s['tokens_per_s']:6.1f} tok/s | requests {s['active_requests']} active {s['queued_requests']} queued | "
            f"KV {s['pool_blocks_used']}/{s['pool_blocks_total']} | dropped {s['dropped_frames']} | "
            f"faults {s['faults']}")


def main(argv: list[str] | None = None) -> int:
    args, ros_args = parse_args(sys.argv[1:] if argv is None else argv)
    import rclpy
    from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    from .nodes.action_publisher import ActionPublisher
    from .nodes.conversation_service import ConversationService
    from .nodes.engine_node import EngineNode
    from .nodes.observation_node import ObservationNode
    from .nodes.params import ParameterError

    files = ([str(find_config(args.robot))] if args.robot else []) + args.params_file
    if args.robot == "demo":
        files.insert(1, str(demo_weights_params()))
    rcl_args = ["oxygen_bringup", "--ros-args"] + [a for f in files for a in ("--params-file", f)]
    rcl_args += [a for a in ros_args if a != "--ros-args"]
    sys.setswitchinterval(0.001)
    rclpy.init(args=rcl_args, signal_handler_options=SignalHandlerOptions.NO)
    nodes = []
    engine = None
    problems: list[str] = []

    def build(make):
        """A node, or None with its parameter problems collected (every node is checked before refusing)."""
        try:
            node = make()
        except ParameterError as e:
            problems.extend(str(e).splitlines())
            return None
        nodes.append(node)
        return node

    try:
        engine_node = build(EngineNode)
        if engine_node is not None:  # the other nodes' parameters are checked against the engine's model
            engine = engine_node.engine
            observation = build(lambda: ObservationNode(engine))
            action = build(lambda: ActionPublisher(engine, inputs_fresh=observation and observation.inputs_fresh))
            conversation = build(lambda: ConversationService(engine))
        if problems:
            print("oxygen_bringup: refusing to start, bad parameters:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 2
        for node in (observation, action, conversation):
            engine_node.add_diagnostics(node.diagnostics)
        demo_nodes = []
        if args.demo:
            from .nodes.demo_client import DemoClient
            from .nodes.sim_robot import SimRobotNode

            sim = SimRobotNode()

            def question():
                q = sim.world.next_question()
                return q.text, q.answer

            demo_nodes = [sim, DemoClient(questions=question)]
            nodes += demo_nodes

        # One executor (and thread) per traffic class. rclpy executors rebuild their wait set in Python for
        # every callback they run, holding the GIL: measured with everything on one MultiThreadedExecutor,
        # its spin loop held the GIL 61% of the time and the engine got 10% (frames 4x slower). Alone, the
        # 70 Hz timer's wait set is one timer and one service; camera and state messages run inline on a
        # single thread; only the conversation node, whose streaming goals each hold a thread while they
        # stream, needs a thread pool.
        executors = [(SingleThreadedExecutor(), [action], "ros-actions"),
                     (SingleThreadedExecutor(), [observation], "ros-inputs"),
                     (MultiThreadedExecutor(num_threads=args.threads), [engine_node, conversation], "ros-services")]
        if demo_nodes:
            executors.append((SingleThreadedExecutor(), demo_nodes, "ros-demo"))
        for executor, members, _ in executors:
            for node in members:
                executor.add_node(node)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        engine.start()
        spinners = [threading.Thread(target=e.spin, name=name, daemon=True) for e, _, name in executors]
        for spinner in spinners:
            spinner.start()
        print(f"oxygen_bringup: running ({', '.join(n.get_name() for n in nodes)}); Ctrl-C stops", flush=True)
        start = time.monotonic()
        next_status = start + args.status_period
        while not stop.wait(0.1):
            now = time.monotonic()
            if args.duration and now - start >= args.duration:
                break
            if args.status_period and now >= next_status:
                print(status_line(engine, action, conversation)
                      + (f" | {demo_nodes[0].status()}" if demo_nodes else ""), flush=True)
                next_status += args.status_period
        # Safe shutdown order: no more commands, then the engine lets go of the device, then ROS.
        action.set_enabled(False)
        engine.stop()
        for executor, _, _ in executors:
            executor.shutdown(timeout_sec=2.0)
        for spinner in spinners:
            spinner.join(timeout=2.0)
        print("oxygen_bringup: stopped", flush=True)
        return 0
    finally:
        if engine is not None:
            engine.stop()
        for node in nodes:
            node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
