"""LeRobot's async-inference protocol (gRPC `transport.AsyncInference`): `oxygen_serve --protocol lerobot`
and `oxygen_bringup --lerobot-port` (docs/lerobot.md). wire.py reads LeRobot's pickles without
`pickle.loads`; server.py serves its robot_client on the engine.

This module stays light (no grpc, no torch) for the command lines' argument parsing.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

LEROBOT_PORT = 8080            # LeRobot's policy_server default
PROTOCOLS = ("openpi", "lerobot")

log = logging.getLogger("oxygen_ros.serve.lerobot")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """oxygen_serve's --protocol, and the LeRobot options."""
    parser.add_argument("--protocol", choices=PROTOCOLS, default="openpi",
                        help="openpi: openpi's websocket clients (port 8000); lerobot: LeRobot's async-inference "
                             "robot_client (gRPC, port 8080, docs/lerobot.md)")
    parser.add_argument("--fps", type=float,
                        help="LeRobot clients: the control rate their TimedAction timestamps are spaced at, as "
                             "LeRobot's policy_server --fps (default: the robot config's control_period_s, else 30)")


def problems(args) -> list[str]:
    """What oxygen_serve's options cannot do with --protocol lerobot (or --fps without it)."""
    from oxygen_ros.serve.layouts import LAYOUTS, LEROBOT_LAYOUTS

    if args.protocol != "lerobot":
        out = ["--fps is for --protocol lerobot"] if args.fps is not None else []
        if args.layout is not None and args.layout not in LAYOUTS:
            out.append(f"no openpi keys for {args.layout}: --layout {'|'.join(sorted(LAYOUTS))} (or --protocol "
                       "lerobot)")
        return out
    out = []
    if args.layout is not None and args.layout not in LEROBOT_LAYOUTS:
        out.append(f"LeRobot clients of robot {args.layout} are not mapped: --layout "
                   f"{'|'.join(sorted(LEROBOT_LAYOUTS))} (oxygen_ros/serve/layouts.py)")
    if args.api_key_file is not None:
        out.append("--api-key-file: LeRobot's robot_client sends no key (an insecure gRPC channel); keep the port "
                   "on a trusted network instead (docs/lerobot.md)")
    if args.fps is not None and not args.fps > 0:
        out.append(f"--fps {args.fps} must be positive")
    return out


def serve(node, args, interrupted) -> int:
    """oxygen_serve --protocol lerobot on the engine node's engine, until SIGINT/SIGTERM (`interrupted`: the
    command line's StopRequest, marked running once the port listens)."""
    from oxygen_ros.serve.layouts import LEROBOT_LAYOUTS

    from .server import LeRobotOptions, LeRobotServer

    base = node.engine
    template = base.preparer            # the robot config's policy I/O: every client's
    base.remove_robot("", "oxygen_serve serves clients only")
    base.capacity()
    served_by = (f"random {args.random} weights" if args.random else
                 f"the engine's checkpoint {node.get_parameter('checkpoint').value}")
    options = LeRobotOptions(host=args.host, port=args.port, max_clients=args.max_clients,
                             max_message_bytes=int(args.max_message_mb * 2**20), default_prompt=args.default_prompt,
                             fps=args.fps)
    try:
        server = LeRobotServer(base, LEROBOT_LAYOUTS[args.layout], options, template, served_by)
    except ValueError as e:
        print(f"oxygen_serve: {e}", file=sys.stderr)
        return 2
    if options.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: LeRobot's protocol has no authentication; anyone who reaches this port can "
                    "move the robot", options.host)
    base.start()
    try:
        try:
            server.start()
        except (OSError, RuntimeError) as e:
            print(f"oxygen_serve: cannot listen on {options.host}:{options.port}: {e}", file=sys.stderr)
            return 2
        print(f"oxygen_serve: listening for LeRobot robot_client on {options.host}:{server.port}", flush=True)
        interrupted.running = True     # from now on a signal stops at once (and says so)
        interrupted.wait()
        server.stop()
    finally:
        base.stop()
    print(f"oxygen_serve: LeRobot chunks served: {json.dumps(server.served_summary())}", flush=True)
    print("oxygen_serve: stopped", flush=True)
    return 0
