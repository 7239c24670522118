"""oxygen_serve: the engine over openpi's websocket policy protocol (docs/openpi.md).

    oxygen_serve --robot droid --params-file my_droid.yaml        # a real checkpoint, as oxygen_bringup takes it
    oxygen_serve --robot demo                                      # the shipped demo weights
    oxygen_serve --robot so101 --checkpoint lerobot/pi05_so101     # a checkpoint by name (or gs://..., a folder)
    oxygen_serve --robot libero --random tiny                      # random weights: try the protocol
    oxygen_serve --robot aloha --api-key-file key.txt --host 0.0.0.0 --max-clients 4

The model options are oxygen_bringup's: the robot config (config/<robot>.yaml), then --params-file files,
then `--ros-args -p name:=value`, read and checked by the same engine node (oxygen_engine's parameters: model,
checkpoint, tokenizer, norm_stats, device, kv_budget_mb, ...; every problem listed before refusing to start).
No ROS graph is joined: the engine node is configured in a private context with discovery off.
Clients send the robot config's openpi keys (--layout, by default the robot's name).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from . import lerobot
from .layouts import LAYOUTS, LEROBOT_LAYOUTS

# The server (and with it torch: seconds to import) is imported where it is used, after `stop_on_signals`:
# a Ctrl-C while it imports then ends the start cleanly instead of with a KeyboardInterrupt traceback.
INTERRUPTED = 130       # exit status of a start stopped by SIGINT/SIGTERM before it ran (128 + SIGINT)

log = logging.getLogger("oxygen_ros.serve")


class StopRequest(threading.Event):
    """Set by SIGINT or SIGTERM (stop_on_signals). `running`: set by the caller once it runs; until then a
    signal stops the start in progress (the model load at its next tensor) and, should that take longer than
    START_GRACE_S (a step that cannot be interrupted: an import, one huge tensor), ends the process then."""
    START_GRACE_S = 1.0

    def __init__(self, prog: str = ""):
        super().__init__()
        self.prog = prog
        self._running = False
        self._deadline: threading.Timer | None = None

    @property
    def running(self) -> bool:
        return self._running

    @running.setter
    def running(self, value: bool) -> None:
        self._running = value
        if value and self._deadline is not None:      # a stop from now on is the orderly one, however long
            self._deadline.cancel()

    def stop_start(self) -> None:
        self._deadline = threading.Timer(self.START_GRACE_S, self._exit_now,
                                         args=(f"the start did not stop within {self.START_GRACE_S:g} s",))
        self._deadline.daemon = True
        self._deadline.start()

    def _exit_now(self, why: str) -> None:
        os.write(2, f"{self.prog}: {why}: exiting now\n".encode())
        os._exit(INTERRUPTED)


def stop_on_signals(prog: str) -> StopRequest:
    """SIGINT and SIGTERM set the returned event instead of raising KeyboardInterrupt. Installed first thing
    (before torch is imported and the model loaded: seconds, minutes for pi0.5), so that a Ctrl-C at any time
    of the start ends it within 2 s: the model load stops at its next tensor (EngineNode's stop_loading), and
    a start that has not stopped START_GRACE_S after the signal, or a second signal before the process runs,
    ends the process at once (nothing moved yet: no command was ever sent). Once it runs, the first signal
    stops it in order (actions off, every pending request answered) and more are ignored."""
    stop = StopRequest(prog)

    def stop_requested(signum, frame) -> None:
        # Set first: a second signal may run this handler again inside the first one (Python runs a pending
        # handler at the next bytecode), and must find the first one's stop.
        again = stop.is_set()
        stop.set()
        name = signal.Signals(signum).name     # os.write: a print here could re-enter a print in progress
        if again and not stop.running:
            stop._exit_now(f"{name} again")
        if not again:
            os.write(2, f"{prog}: {name}: stopping{'' if stop.running else ' the start'}\n".encode())
            if not stop.running:
                stop.stop_start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_requested)
    return stop


def exit_interrupted(code: int) -> int:
    """`code`, except that a start stopped by a signal (INTERRUPTED) ends the process here: nothing ran, and
    the interpreter's own teardown of torch, DDS and MuJoCo (0.7-8 s measured, the longer on a busy machine)
    would keep a Ctrl-C from ending the start within 2 s."""
    if code == INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--robot", choices=sorted(set(LAYOUTS) | set(LEROBOT_LAYOUTS)),
                        help="robot config (config/<robot>.yaml) and its openpi keys")
    parser.add_argument("--params-file", action="append", default=[],
                        help="ROS parameters YAML, as oxygen_bringup takes it (repeatable; later files win)")
    parser.add_argument("--checkpoint", metavar="NAME",
                        help="the checkpoint to serve and its statistics (oxygen_engine's checkpoint and norm_stats, "
                             "over the robot config's): a folder, a hub id org/name[@revision] or a gs:// URL, "
                             "fetched once into the hub's or openpi's cache")
    parser.add_argument("--random", metavar="PRESET",
                        help="random weights at this model preset (tiny, bench, pi05) with the robot config's "
                             "dimensions and identity norm stats: to try the protocol, not to move a robot")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults left None here and filled by fill_server_defaults after parsing: ServeOptions lives with the
    # server (websockets, torch: seconds to import), and a mistyped option is answered before that import.
    parser.add_argument("--layout", choices=sorted(set(LAYOUTS) | set(LEROBOT_LAYOUTS)),
                        help="openpi observation keys, or LeRobot's (--protocol lerobot) (default: --robot)")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, help=f"TCP port (default {OPENPI_PORT}, {lerobot.LEROBOT_PORT} with "
                                                 "--protocol lerobot; 0: any free port, printed)")
    parser.add_argument("--api-key-file", type=Path,
                        help="file holding the API key clients must send (Authorization: Api-Key <key>); "
                             "readable by its owner only (chmod 600), at least 16 characters")
    parser.add_argument("--max-clients", type=int, help="connections served at once (default 8)")
    parser.add_argument("--max-message-mb", type=float,
                        help="largest message accepted (MiB, default 32); a larger one closes its connection")
    parser.add_argument("--default-prompt", help="prompt for observations that carry none")
    parser.add_argument("--reply-timeout", type=float,
                        help="seconds an observation may wait for its chunk before the client gets an error "
                             "(default 60)")
    parser.add_argument("--serial", action="store_true",
                        help="one client's frame at a time, as openpi's own server runs (the benchmark's "
                             "'one at a time'), instead of batching the clients' frames in one engine cycle")


# The help texts' defaults; fill_server_defaults takes the values themselves from ServeOptions and
# LeRobotOptions (test_operator_messages checks that the two agree).
OPENPI_PORT = 8000


def fill_server_defaults(args) -> None:
    """Every server option not given on the command line: its ServeOptions/LeRobotOptions default."""
    from .lerobot.server import LeRobotOptions
    from .server import ServeOptions

    openpi, lerobot_options = ServeOptions(), LeRobotOptions()
    defaults = dict(host=openpi.host, max_clients=openpi.max_clients,
                    max_message_mb=openpi.max_message_bytes / 2**20, reply_timeout=openpi.reply_timeout_s,
                    openpi_host=openpi.host, openpi_max_clients=openpi.max_clients,
                    lerobot_host=lerobot_options.host, lerobot_max_clients=lerobot_options.max_clients)
    for name, value in defaults.items():
        if getattr(args, name, value) is None:
            setattr(args, name, value)
    if getattr(args, "port", 0) is None:
        args.port = lerobot.LEROBOT_PORT if args.protocol == "lerobot" else openpi.port


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="oxygen_serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    add_server_arguments(parser)
    lerobot.add_arguments(parser)
    args, rest = parser.parse_known_args(argv)
    from oxygen_ros.param_files import split_ros_args

    ros_args, stray = split_ros_args(rest)
    if stray:                   # else rclpy.init raised UnknownROSArgsError (a traceback) after the imports
        parser.error(f"unrecognized arguments: {' '.join(stray)} (ROS arguments follow --ros-args)")
    if args.layout is None and args.protocol == "lerobot" and args.robot not in (None, *LEROBOT_LAYOUTS):
        parser.error(f"--protocol lerobot --robot {args.robot}: LeRobot's robot_client is served for "
                     f"--robot {'|'.join(sorted(LEROBOT_LAYOUTS))} (a LeRobot checkpoint's joints and cameras); "
                     f"--robot {args.robot} serves openpi clients (--protocol openpi)")
    if args.layout is None:
        args.layout = args.robot
    if args.layout is None:
        parser.error("say which openpi keys clients send: --robot droid|aloha|libero|demo, or --layout with "
                     "--params-file")
    if not args.robot and not args.params_file:
        parser.error("give --robot (a robot config) and/or --params-file")
    if lerobot.problems(args):
        parser.error("; ".join(lerobot.problems(args)))
    fill_server_defaults(args)
    return args, ros_args


def server_options(args, key_flag: str = "--api-key-file") -> ServeOptions:
    from oxygen_ros.console.guard import read_token

    from .server import ServeOptions

    # Checked as the console's token file: readable by its owner only, at least 16 characters.
    api_key = None if args.api_key_file is None else read_token(str(args.api_key_file), key_flag)
    return ServeOptions(host=args.host, port=args.port, api_key=api_key, max_clients=args.max_clients,
                        max_message_bytes=int(args.max_message_mb * 2**20), default_prompt=args.default_prompt,
                        reply_timeout_s=args.reply_timeout, serial=args.serial)


def engine_parameters(robot: str | None, params_files: list[str], random: str | None,
                      checkpoint: str | None = None) -> tuple[list[str], dict]:
    """(parameter files, overrides) for the engine node: oxygen_bringup's order (robot config, the demo
    weights for the demo, the given files), then --checkpoint's or --random's choices, which win over every
    file (--checkpoint: the checkpoint and its statistics, as the robot configs name both by the checkpoint's
    folder; --random: a model preset, no weights, identity norm stats, a small KV pool)."""
    if random and checkpoint:
        raise ValueError("--checkpoint and --random exclude each other: serve a checkpoint or random weights")
    from oxygen_ros.robot.configs import demo_weights_params, find_config

    files = ([str(find_config(robot))] if robot else []) + list(params_files)
    if robot == "demo" and not (random or checkpoint):
        files.insert(1, str(demo_weights_params()))
    overrides = {}          # (a client's frames get no captions: ClientSlots adds it with captions=False)
    if checkpoint:
        overrides.update(checkpoint=checkpoint, norm_stats=checkpoint)
    if random:
        overrides.update(model=random, checkpoint="", tokenizer="", norm_stats="", asset_id="", kv_budget_mb=64.0)
    return files, overrides


def startup_refusal(files: list[str], ros_args: list[str], options: ServeOptions) -> str:
    """oxygen_bringup's checks before the model loads (empty: none failed): every problem with the parameters
    (param_files.py), then the server's port, bound and released (a port in use said as such)."""
    from oxygen_ros.param_files import PortUse, check, port_problems

    report = check(files, ros_args)
    for line in report.others:                  # another package's section of a shared file: said once, not refused
        print(f"oxygen_serve: {line}", flush=True)
    problems = report.problems
    lines = ["oxygen_serve: refusing to start, bad parameters:\n  " + "\n  ".join(problems)] if problems else []
    lines += [f"oxygen_serve: refusing to start: {line}"
              for line in port_problems([PortUse("--port", options.host, options.port)])]
    return "\n".join(lines)


def build_engine_node(files: list[str], overrides: dict, ros_args: list[str], stop: StopRequest | None = None):
    """oxygen_engine configured from these parameters in a private ROS context (nothing spins it; discovery
    off): the same checks and loading as oxygen_bringup's; `stop` set ends the load (EngineNode's
    stop_loading). Returns (node, context); SystemExit(2) with every problem when the parameters are bad."""
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "OFF")
    import rclpy
    from rclpy.parameter import Parameter

    from oxygen_ros.nodes.engine_node import EngineNode
    from oxygen_ros.nodes.fleet import ParamsFiles

    fleet = ParamsFiles(files).engine().get("robots")
    if fleet:
        raise SystemExit(f"oxygen_serve: the parameters declare a fleet (robots: {fleet}); oxygen_serve serves one "
                         "robot config to its clients (a fleet with socket robots: oxygen_bringup --openpi-port)")
    args = ["oxygen_serve", "--ros-args"] + [a for f in files for a in ("--params-file", f)]
    args += [a for a in ros_args if a != "--ros-args"]
    context = rclpy.Context()
    rclpy.init(args=args, context=context)
    node = EngineNode(params_files=ParamsFiles(files), context=context, check_capacity=False, stop_loading=stop,
                      parameter_overrides=[Parameter(k, value=v) for k, v in overrides.items()])
    node.trigger_configure()
    if node.failure and not (stop is not None and stop.is_set()):
        node.destroy_node()
        context.try_shutdown()
        # Its problems: logged by oxygen_engine just above, each once.
        raise SystemExit("oxygen_serve: refusing to start, bad parameters (oxygen_engine's configure failed: above)")
    return node, context


def main(argv: list[str] | None = None) -> int:
    stop = stop_on_signals("oxygen_serve")
    return exit_interrupted(run(sys.argv[1:] if argv is None else argv, stop))


def run(argv: list[str], stop: StopRequest) -> int:
    args, ros_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    for chatty in ("httpx", "httpx2"):      # huggingface_hub's HTTP client: a line per request (download.py says more)
        logging.getLogger(chatty).setLevel(logging.WARNING)
    from oxygen_ros.robot.configs import find_config

    try:
        options = server_options(args)
        problems = options.problems()
        if problems:
            raise ValueError("; ".join(problems))
        files, overrides = engine_parameters(args.robot, args.params_file, args.random, args.checkpoint)
    except (ValueError, FileNotFoundError) as e:
        print(f"oxygen_serve: {e}", file=sys.stderr)
        return 2
    refusal = startup_refusal(files, ros_args, options)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if args.robot:
        print(f"oxygen_serve: robot config {find_config(args.robot)}", flush=True)
    if stop.is_set():                      # Ctrl-C during the imports and checks
        print("oxygen_serve: interrupted while starting: stopped before serving", flush=True)
        return INTERRUPTED
    if args.random:
        log.warning("RANDOM WEIGHTS: model preset %r with random weights and identity norm stats: the actions "
                    "are meaningless (protocol testing only)", args.random)
    try:
        node, context = build_engine_node(files, overrides, ros_args, stop)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    try:
        if stop.is_set():
            print("oxygen_serve: interrupted while starting: stopped before serving", flush=True)
            return INTERRUPTED
        if args.protocol == "lerobot":
            return lerobot.serve(node, args, stop)
        return _serve(node.engine, LAYOUTS[args.layout], options, stop)
    finally:
        # A start stopped by a signal ends the process at once (exit_interrupted): nothing ran, and the node's
        # teardown (0.5-1 s measured) would hold a Ctrl-C past 2 s.
        if not (stop.is_set() and not stop.running):
            node.trigger_shutdown()
            node.destroy_node()
            context.try_shutdown()


def _serve(base, layout, options: ServeOptions, interrupted: StopRequest) -> int:
    from .server import openpi_server

    # The engine node built the engine for the robot config as its robot "": that robot's frame preparation
    # is the template of every client's; the robot itself would only sit idle.
    template = base.preparer
    base.remove_robot("", "oxygen_serve serves clients only")
    # The cycle cost, measured now (before the engine thread runs): with strict_capacity a client that would
    # not fit is refused when it connects. The template robot itself was never checked (check_capacity).
    base.capacity()
    try:
        server = openpi_server(base, layout, options, template)
    except ValueError as e:
        print(f"oxygen_serve: {e}", file=sys.stderr)
        return 2
    if options.host not in ("127.0.0.1", "localhost", "::1") and options.api_key is None:
        log.warning("listening on %s without an API key: anyone who reaches this port can move the robot",
                    options.host)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        interrupted.running = True
        if interrupted.is_set():       # a signal since the model loaded, before this loop took them over
            stop.set()
        await server.serve_until(stop, lambda port: print(f"oxygen_serve: listening on ws://{options.host}:{port}",
                                                          flush=True))

    server.engine.start()
    try:
        asyncio.run(serve())
    except OSError as e:
        print(f"oxygen_serve: cannot listen on {options.host}:{options.port}: {e}", file=sys.stderr)
        return 2
    finally:
        # asyncio.run put back the default handlers: a further Ctrl-C would raise through the teardown.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        server.engine.stop()
    print("oxygen_serve: stopped", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- oxygen_bringup
def add_bringup_arguments(parser: argparse.ArgumentParser) -> None:
    """oxygen_bringup's --openpi-* and --lerobot-* options: socket robots next to the ROS robot, on its engine."""
    group = parser.add_argument_group("openpi clients (docs/openpi.md)")
    group.add_argument("--openpi-port", type=int, metavar="PORT",
                       help="also serve openpi-client robots on this port, batched on the same engine (their "
                            "observation keys and policy I/O: the --robot config)")
    group.add_argument("--openpi-host", help="address the openpi server listens on (default 127.0.0.1)")
    group.add_argument("--openpi-api-key-file", type=Path, help="API key file the openpi clients must match")
    group.add_argument("--openpi-max-clients", type=int, help="openpi connections at once (default 8)")
    group = parser.add_argument_group("LeRobot clients (docs/lerobot.md)")
    group.add_argument("--lerobot-port", type=int, metavar="PORT",
                       help="also serve LeRobot's robot_client (async inference, gRPC) on this port, batched on the "
                            "same engine (their joints and cameras: the --robot config's LeRobot mapping)")
    group.add_argument("--lerobot-host", help="address the LeRobot server listens on (default 127.0.0.1)")
    group.add_argument("--lerobot-max-clients", type=int, help="LeRobot clients at once (default 8)")


def bringup_problems(args) -> list[str]:
    """What oxygen_bringup's --openpi-* and --lerobot-* options cannot do, one line each (checked before
    anything starts)."""
    out = []
    if args.lerobot_port is not None:
        if args.robot not in LEROBOT_LAYOUTS:
            out.append(f"--lerobot-port needs --robot with a LeRobot mapping ({', '.join(sorted(LEROBOT_LAYOUTS))}): "
                       "the LeRobot clients take its robot config's joints, cameras and policy I/O")
        if args.managed:
            out.append("--lerobot-port needs the engine the bringup configures: not with --managed")
    if args.openpi_port is None:
        return out
    if args.robot not in LAYOUTS:
        out.append("--openpi-port needs --robot (droid, aloha, libero, demo): the openpi clients take its robot "
                   "config's keys and policy I/O (a fleet's socket robots are not supported yet)")
    if args.managed:
        out.append("--openpi-port needs the engine the bringup configures: not with --managed")
    if args.openpi_api_key_file is not None:
        from oxygen_ros.console.guard import read_token

        try:
            read_token(str(args.openpi_api_key_file), "--openpi-api-key-file")
        except ValueError as e:
            out.append(str(e))
    return out


def start_for_bringup(engine, args) -> list:
    """The openpi and LeRobot servers on a configured, running engine (none without --openpi-port and
    --lerobot-port): clients become robots of that engine beside the ROS robot, with its policy I/O and norm
    stats. ValueError naming the option: a server that cannot start (those started are stopped again)."""
    servers, flag = [], None
    try:
        if args.openpi_port is not None:
            from .server import ServeOptions, openpi_server

            flag, d = "--openpi-port", ServeOptions()
            ns = argparse.Namespace(host=args.openpi_host, port=args.openpi_port, api_key_file=args.openpi_api_key_file,
                                    max_clients=args.openpi_max_clients, max_message_mb=d.max_message_bytes / 2**20,
                                    default_prompt=None, reply_timeout=d.reply_timeout_s, serial=False)
            options = server_options(ns, "--openpi-api-key-file")
            servers.append(openpi_server(engine, LAYOUTS[args.robot], options).start())
            print(f"oxygen_bringup: openpi clients on ws://{args.openpi_host}:{servers[-1].port} ({args.robot} keys)",
                  flush=True)
        if args.lerobot_port is not None:
            from .lerobot.server import LeRobotOptions, LeRobotServer

            flag = "--lerobot-port"
            options = LeRobotOptions(host=args.lerobot_host, port=args.lerobot_port,
                                     max_clients=args.lerobot_max_clients)
            servers.append(LeRobotServer(engine, LEROBOT_LAYOUTS[args.robot], options,
                                         served_by=f"oxygen_bringup's engine (--robot {args.robot})").start())
            print(f"oxygen_bringup: LeRobot clients on {args.lerobot_host}:{servers[-1].port} ({args.robot} joints "
                  "and cameras)", flush=True)
    except (ValueError, OSError, RuntimeError) as e:
        for server in servers:
            server.stop()
        raise ValueError(f"{flag}: {e}") from e
    return servers
