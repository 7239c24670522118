"""oxygen_bringup: one process, one engine, the nodes around it (observation, actions, conversation,
recorder, view, console; plus the simulated robot with --demo). Works with the ROS 2 wheels from PyPI (no ros2 CLI, no launch) and on a robot's ROS 2 install.

    oxygen_bringup --robot libero --params-file my_overrides.yaml
    oxygen_bringup --demo                       # trained demo model + MuJoCo robot, closes the loop
    oxygen_bringup --demo --console 8080 --record /tmp/bag     # + operator console, + MCAP recording
    oxygen_bringup --params-file config/fleet_example.yaml   # one engine, several robots (docs/fleet.md)

Threads: the engine thread owns the device; the action publisher (70 Hz timer), the inputs and the
services each have an executor thread of their own (see Executors), so image decoding or a service call never
delays the timer and rclpy's own Python overhead does not starve the engine. Python's GIL is shared with
the engine's Python code, so the interpreter's switch interval is lowered (5 ms -> 1 ms): measured on 2
cores, the timer otherwise fell to 46-66 Hz next to a busy Python thread.
The engine node is a lifecycle node: the bringup configures and activates it, or with --managed leaves
that to a lifecycle manager (ros2 lifecycle set /oxygen_engine configure, nav2's lifecycle_manager...).
Shutdown (SIGINT/SIGTERM): the lifecycle shutdown transition, i.e. actions stop first, then the engine
releases the device; then ROS.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

ROBOTS = ("libero", "droid", "aloha", "so101", "demo")
NAMESPACE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(/[A-Za-z_][A-Za-z0-9_]*)*")
ANSWER_LINGER_S = 1.0   # the nodes stay after answering at a stop, for DDS to deliver (ProcessNodes.destroy)
DISCOVERY_S = 1.0       # how long the start looks for another engine before the load (DDS discovery: < 1 s locally;
                        # one found later, during the load, is found again before activating)


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
    parser.add_argument("--record", metavar="DIR", help="record the run as ROS 2 MCAP into DIR "
                        "(oxygen_recorder's path parameter; replay: python -m oxygen_ros.record.replay DIR)")
    parser.add_argument("--console", type=int, metavar="PORT",
                        help="serve the operator console on http://127.0.0.1:PORT/ (oxygen_console's port)")
    parser.add_argument("--managed", action="store_true",
                        help="leave oxygen_engine unconfigured: a lifecycle manager drives its transitions")
    parser.add_argument("--threads", type=int, default=10,
                        help="threads of the services executor (streaming goals hold one each)")
    parser.add_argument("--namespace", metavar="NAME",
                        help="run every node in this ROS namespace (/NAME/oxygen_engine, /NAME/oxygen/action, "
                             "...; the params files' node sections apply there): two robots on one ROS domain")
    from .param_files import split_ros_args
    from .serve.cli import add_bringup_arguments, bringup_problems, fill_server_defaults
    add_bringup_arguments(parser)
    args, rest = parser.parse_known_args(argv)
    ros_args, stray = split_ros_args(rest)
    if stray:                   # else rclpy.init raised UnknownROSArgsError (a traceback) after the imports
        parser.error(f"unrecognized arguments: {' '.join(stray)} (ROS arguments follow --ros-args)")
    if args.demo and args.robot is None:
        args.robot = "demo"
    if args.namespace is not None:
        args.namespace = args.namespace.strip("/")
        if not NAMESPACE.fullmatch(args.namespace):
            parser.error(f"--namespace {args.namespace!r}: a ROS namespace is names of letters, digits and _ "
                         "(not starting with a digit) joined by /, e.g. robot2 or lab/robot2")
    for problem in bringup_problems(args):
        parser.error(problem)
    fill_server_defaults(args)
    return args, ros_args


def status_line(engine, robots: list) -> str:
    """One line for the process: the single robot's actions, or each fleet robot's (rate, state, chunks,
    deadline misses), then the engine."""
    s = engine.stats.snapshot()
    if len(robots) == 1 and not robots[0].robot:
        r, mine = robots[0].action.rate.summary(), s["robots"][""]
        actions = (f"actions {r['rate_hz']:5.1f} Hz (jitter {r['period_ms_std']:.1f} ms, "
                   f"{robots[0].action.last_status}) | chunks {mine['chunks_per_s']:5.1f}/s, "
                   f"{mine['deadline_misses']} late")
    else:
        actions = "robots " + ", ".join(
            f"{robot.robot} {robot.action.rate.summary()['rate_hz']:5.1f} Hz {robot.action.last_status} "
            f"({s['robots'][robot.robot]['chunks_per_s']:.1f} chunks/s, {s['robots'][robot.robot]['deadline_misses']} "
            f"late)" for robot in robots)
    return (f"[status] {actions} | "
            f"frame {s['frame_ms_mean']:6.1f} ms (prefill {s['prefill_ms_mean']:.0f}, actions {s['action_ms_mean']:.0f}, "
            f"text {s['decode_ms_mean']:.0f}) -> {s['action_hz']:5.1f} Hz chunk rate | "
            f"{s['tokens_per_s']:6.1f} tok/s | requests {s['active_requests']} active {s['queued_requests']} queued | "
            f"KV {s['pool_blocks_used']}/{s['pool_blocks_total']} | dropped {s['dropped_frames']} | "
            f"faults {s['faults']}")


def late_warning(engine, late_before: int) -> tuple[str, int]:
    """(the status line's warning, the late-chunk count now): chunks that came after their deadline (their
    frame older than the chunk period) since the previous line, with the machine's load average, which says
    whether the engine is too slow or waits for a CPU that other processes hold. Empty when none came late."""
    late = sum(robot["deadline_misses"] for robot in engine.stats.snapshot()["robots"].values())   # the "late"s
    if late <= late_before:
        return "", late
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    why = (f"the machine is busy (load average {load:.1f} on {cpus} CPUs): the engine waits for a CPU"
           if load > cpus else f"load average {load:.1f} on {cpus} CPUs")
    return (f" | WARNING {late - late_before} chunks late: their frames were older than the chunk period "
            f"({1e3 * engine.info.chunk_period_s:.0f} ms); {why}"), late


class Executors:
    """One executor (and thread) per traffic class. rclpy executors rebuild their wait set in Python for
    every callback they run, holding the GIL: measured with everything on one MultiThreadedExecutor, its
    spin loop held the GIL 61% of the time and the engine got 10% (frames 4x slower). Alone, the 70 Hz
    timer's wait set is one timer and one service; camera and state messages run inline on a single
    thread; only the services (streaming goals each hold a thread while they stream, lifecycle
    transitions hold one while the model loads) need a pool. Nodes join and leave while they spin (the
    engine node's configure and cleanup)."""

    def __init__(self, service_threads: int, context=None):
        from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor

        self.actions = SingleThreadedExecutor(context=context)
        self.inputs = SingleThreadedExecutor(context=context)
        self.services = MultiThreadedExecutor(num_threads=service_threads, context=context)
        self.other = SingleThreadedExecutor(context=context)   # simulated robot, demo client, recorder, console
        self._named = [(self.actions, "ros-actions"), (self.inputs, "ros-inputs"),
                       (self.services, "ros-services"), (self.other, "ros-other")]
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._spin, args=(e,), name=name, daemon=True)
                         for e, name in self._named]
        for t in self._threads:
            t.start()

    def _spin(self, executor) -> None:
        """executor.spin(), except that nodes leaving while it waits are not fatal: the engine node's cleanup
        and shutdown destroy the nodes around it while their executors spin, and rclpy then raises from that
        one wait: 'wait set is empty' (RCLError; seen at shutdown: a traceback per executor thread), or
        InvalidHandle when an entity is destroyed between the executor's snapshot of a node and its wait
        (rclpy 9.1 skips a waitable it cannot enter but still adds it to the wait set: seen in 1 of ~20 CI
        runs of the lifecycle test, at shutdown). The next wait has the nodes that remain."""
        from rclpy._rclpy_pybind11 import InvalidHandle, RCLError
        from rclpy.executors import ExternalShutdownException, ShutdownException

        while executor.context.ok() and not self._stopping.is_set():
            try:
                executor.spin_once(timeout_sec=0.2)
            except (ExternalShutdownException, ShutdownException):
                return
            except (RCLError, InvalidHandle):
                if self._stopping.is_set() or not executor.context.ok():
                    return
                time.sleep(0.05)                 # no node to wait on yet (or any more): wait for one
            except Exception:  # noqa: BLE001 - a callback's exception must not end the thread (and its traffic)
                if self._stopping.is_set() or not executor.context.ok():
                    return
                import traceback

                print(f"oxygen_bringup: a callback on {threading.current_thread().name} raised (the executor "
                      f"keeps spinning):\n{traceback.format_exc()}", file=sys.stderr, flush=True)

    def shutdown(self) -> None:
        """The spinning threads leave first (each wait lasts at most 0.2 s), then the executors shut down:
        an executor shut down under a thread still in spin_once made the handler it was building call
        `trigger()` on the executor's destroyed guard condition (None: a traceback at Ctrl-C)."""
        self._stopping.set()
        for t in self._threads:
            t.join(timeout=2.0)
        for executor, _ in self._named:
            executor.shutdown(timeout_sec=2.0)


class RobotNodes:
    """One robot's nodes around the engine: observation, actions, conversation (then the view, once they
    are all well configured), in the robot's namespace (a fleet robot: /<namespace>/oxygen/...; the single
    robot "": /oxygen/...). A fleet robot's parameters are given to its nodes (fleet.FleetRobot.parameters);
    the single robot's come from the params files."""

    def __init__(self, engine, build, robot: str = "", namespace: str | None = None, parameters=None):
        from .nodes.action_publisher import ActionPublisher
        from .nodes.conversation_service import ConversationService
        from .nodes.observation_node import ObservationNode

        self.robot, self._namespace, self._parameters = robot, namespace, parameters
        self.observation = build(lambda: ObservationNode(engine, robot=robot, **self._kwargs("oxygen_observation")),
                                 robot)
        self.action = build(lambda: ActionPublisher(
            engine, inputs_fresh=self.observation and self.observation.inputs_fresh, robot=robot,
            **self._kwargs("oxygen_action")), robot)
        self.conversation = build(lambda: ConversationService(engine, robot=robot,
                                                              **self._kwargs("oxygen_conversation")), robot)
        self.view = None

    def _kwargs(self, node: str) -> dict:
        from rclpy.parameter import Parameter

        if self._parameters is None:
            return {}
        return dict(namespace=self._namespace,
                    parameter_overrides=[Parameter(k, value=v) for k, v in self._parameters(node).items()])

    def build_view(self, engine, build) -> None:
        from .view.view_node import ViewNode

        self.view = build(lambda: ViewNode(engine, self.observation, self.action, self.conversation,
                                           robot=self.robot, **self._kwargs("oxygen_view")), self.robot)

    def place(self, executors: Executors) -> list:
        # Questions and replies as service events (<ns>/oxygen/converse/_service_event, as ros2 service echo
        # shows them; the streaming action's under <ns>/oxygen/converse_stream/_action/): the debug picture
        # shows the latest reply, the recorder stores them.
        from rclpy.qos import QoSProfile
        try:
            from rclpy.service_introspection import ServiceIntrospectionState
        except ImportError:     # ROS 2 Humble has no service introspection: replies are then not recorded
            ServiceIntrospectionState = None
        if ServiceIntrospectionState is not None:
            self.conversation.configure_introspection(QoSProfile(depth=100), ServiceIntrospectionState.CONTENTS)
        self.action.enabled = self.action.active = False         # until the engine node is activated
        self.conversation.active = False
        return [(executors.inputs, self.observation), (executors.actions, self.action),
                (executors.services, self.conversation), (executors.other, self.view)]

    def activate(self) -> None:
        self.conversation.active = self.action.active = True
        self.action.set_enabled(self.action.p["start_enabled"])

    def deactivate(self, reason: str) -> None:
        # Inactive first, so that no oxygen/enable call can turn output back on after the final stop.
        self.action.active = False
        self.conversation.refusal = reason
        self.action.set_enabled(False)


class ProcessNodes:
    """The nodes around a configured engine (EngineNode's `attach`): each robot's (RobotNodes; one, "", or
    a fleet's), and with the single robot the recorder and console; built at configure (their
    parameters are checked against the engine's model; every problem is listed), destroyed at cleanup."""

    def __init__(self, engine, executors: Executors, engine_node, record: str | None = None,
                 console_port: int | None = None):
        from rclpy.parameter import Parameter

        from .console.console_node import ConsoleNode
        from .nodes.fleet import shared_outputs
        from .nodes.params import ParameterError
        from .record.recorder import Recorder, raw_topics

        self.executors = executors
        self.nodes = []
        problems: list[str] = []

        def build(make, robot: str = ""):
            """The node `make` builds, or None with its problems listed (named with a fleet robot's name)."""
            try:
                node = make()
            except ParameterError as e:
                problems.extend(f"{robot}: {line}" if robot else line for line in str(e).splitlines())
                return None
            self.nodes.append(node)
            return node

        fleet, files = engine_node.fleet, engine_node.files
        if not fleet:
            self.robots = [RobotNodes(engine, build)]
        else:
            # The recorder and the console follow one robot's frames: a fleet runs without them for now.
            problems += [f"--{flag}: not available with a fleet (robots: {', '.join(r.name for r in fleet)}) yet"
                         for flag, given in (("record", record), ("console", console_port)) if given]
            self.robots = [RobotNodes(engine, build, r.name, r.namespace, lambda node, r=r: r.parameters(node, files))
                           for r in fleet]
            problems += _shared_inputs(self.robots) + shared_outputs(fleet, files, _node_defaults())
        single = self.robots[0]
        self.recorder = self.console = None
        if not problems:
            for robot in self.robots:
                robot.build_view(engine, build)
        if not problems and not fleet:
            self.recorder = build(lambda: Recorder(
                engine, {"engine_params": engine_node.p, "conversation_params": single.conversation.p,
                         "camera_slots": single.observation.slots},
                raw_topics(single.action, single.conversation, single.observation), single.action.names,
                parameter_overrides=[Parameter("path", value=record)] if record else []))
            self.console = build(lambda: ConsoleNode(
                engine, single.action, single.conversation, single.observation, single.view,
                lambda: engine_node.state_label, safe_stop_service=engine_node.clear_safe_stop_service,
                parameter_overrides=[Parameter("port", value=console_port)] if console_port else []))
        if problems:
            self.destroy()
            raise ParameterError("\n".join(problems))
        self._placed = [placed for robot in self.robots for placed in robot.place(executors)]
        self._placed += [(executors.other, node) for node in (self.recorder, self.console) if node]
        for executor, node in self._placed:
            executor.add_node(node)

    @property
    def action(self):
        """The single robot's action publisher (the status line and the demo)."""
        return self.robots[0].action

    def activate(self) -> None:
        for robot in self.robots:
            robot.activate()

    def disable_output(self) -> None:
        for robot in self.robots:
            robot.action.set_enabled(False)

    def deactivate(self, reason: str) -> None:
        self._answers_at_stop = self._answers()
        for robot in self.robots:
            robot.deactivate(reason)

    def _answers(self) -> int:
        """Conversation answers sent so far (replies, refusals, streams), every robot's."""
        return sum(sum(robot.conversation.counts.values()) for robot in getattr(self, "robots", [])
                   if robot.conversation is not None)

    def destroy(self, reason: str = "") -> None:
        """Every pending question answered (refused with `reason`) while the executors still spin, then the
        nodes leave their executors and are destroyed. Answers sent since the stop began keep the nodes for
        ANSWER_LINGER_S more: a response handed to DDS is delivered by the service's writer after the call
        returns, and a writer destroyed first (the process exiting) lost it (1 run in 3 of a question in
        flight at Ctrl-C)."""
        closing = [robot.conversation.close for robot in getattr(self, "robots", [])
                   if robot.conversation is not None and getattr(self, "_placed", None)]
        for close in closing:
            self._safely(close, reason or "engine stopped")
        if closing and self._answers() != getattr(self, "_answers_at_stop", self._answers()):
            time.sleep(ANSWER_LINGER_S)
        for node in (self.console, self.recorder):
            if node is not None:
                self._safely(node.close)
        for executor, node in getattr(self, "_placed", []):
            executor.remove_node(node)
        for node in self.nodes:
            node.destroy_node()
        self.nodes = []

    @staticmethod
    def _safely(close, *args) -> None:
        """A close that raises must not keep the other nodes from being closed and destroyed (it runs in
        the engine node's cleanup and shutdown, where rclpy would swallow the exception)."""
        try:
            close(*args)
        except Exception as e:  # noqa: BLE001
            import traceback

            print(f"oxygen_bringup: closing {getattr(close, '__self__', close)} failed: {type(e).__name__}: {e}\n"
                  f"{traceback.format_exc()}", file=sys.stderr, flush=True)

    def diagnostics(self) -> list:
        """Every node's statuses; one that fails reports the failure instead of ending the executor thread
        that publishes /diagnostics (the same thread serves the conversation)."""
        from diagnostic_msgs.msg import DiagnosticStatus

        from .nodes.engine_node import status

        statuses = []
        for node in self.nodes:
            try:
                statuses += node.diagnostics()
            except Exception as e:  # noqa: BLE001
                statuses.append(status(f"oxygen_ros: {node.get_fully_qualified_name()}", DiagnosticStatus.ERROR,
                                       f"diagnostics failed: {type(e).__name__}: {e}", {}))
        return statuses


def _node_defaults() -> dict[str, dict]:
    """The defaults a robot's nodes declare (fleet.shared_outputs resolves their output names)."""
    from .nodes.action_publisher import PARAMS as ACTION
    from .nodes.conversation_service import PARAMS as CONVERSATION
    from .view.view_node import PARAMS as VIEW

    return {node: {p.name: p.default for p in params}
            for node, params in (("oxygen_action", ACTION), ("oxygen_conversation", CONVERSATION),
                                 ("oxygen_view", VIEW))}


def _shared_inputs(robots: list[RobotNodes]) -> list[str]:
    """Two robots reading one state topic would each act on the other's joints: refused. (A camera may be
    shared: an overhead view of two arms.)"""
    readers: dict[str, str] = {}
    problems = []
    for robot in robots:
        if robot.observation is None:
            continue
        topic = robot.observation.resolve_topic_name(robot.observation.p["state_topic"])
        if topic in readers:
            problems.append(f"{readers[topic]} and {robot.robot} both read their state from {topic}: give each "
                            "robot its own state_topic (/<namespace>/oxygen_observation)")
        readers.setdefault(topic, robot.robot)
    return problems


def startup_refusal(args, files: list[str], ros_args: list[str]) -> str:
    """Why the process must not start, found before rclpy reads the files and before the model loads (empty:
    nothing): every problem with the parameters (param_files.py), then every server port that cannot be
    bound, each one line."""
    from .console.console_node import PARAMS as CONSOLE
    from .param_files import Given, PortUse, check, port_problems

    given = [Given("--console", "oxygen_console", "port", args.console)] if args.console is not None else []
    if args.record:
        given.append(Given("--record", "oxygen_recorder", "path", args.record))
    report = check(files, ros_args, given)
    for line in report.others:                  # another package's section of a shared file: said once, not refused
        print(f"oxygen_bringup: {line}", flush=True)
    console = dict({p.name: p.default for p in CONSOLE}, **report.values("oxygen_console"))
    # The files are checked once the parameters naming them are right: with a misspelled `checkpont`, the
    # config's default checkpoint path would be reported missing beside the real mistake.
    problems = report.problems or _file_problems(report.values("oxygen_engine"), console,
                                                 report.values("oxygen_recorder").get("path"))
    lines = ["oxygen_bringup: refusing to start, bad parameters:\n  " + "\n  ".join(problems)] if problems else []
    ports = [PortUse("--openpi-port", args.openpi_host, args.openpi_port or 0),
             PortUse("--lerobot-port", args.lerobot_host, args.lerobot_port or 0)]
    if type(console["port"]) is int and isinstance(console["host"], str):     # else a problem listed above
        ports.append(PortUse("--console" if args.console else "oxygen_console.port", console["host"], console["port"]))
    lines += [f"oxygen_bringup: refusing to start: {line}" for line in port_problems(ports)]
    return "\n".join(lines)


def in_namespace(params_file: Path, namespace: str) -> Path:
    """A copy of `params_file` whose node sections apply in /`namespace` (rcl matches a section such as
    `oxygen_engine:` against the node's full name, /oxygen_engine): each top-level section without a leading
    / becomes /`namespace`/<section>; wildcards and full names stay. Line for line, so that rcl's messages
    keep their line numbers."""
    import hashlib
    import tempfile

    text = re.sub(r"^(?=[A-Za-z_])", f"/{namespace}/", params_file.read_text(), flags=re.MULTILINE)
    digest = hashlib.sha1(f"{params_file.resolve()}\0{text}".encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"oxygen_{params_file.stem}_{namespace.replace('/', '_')}_{digest}.yaml"
    out.write_text(text)
    return out


def startup_topics(files: list[str], ros_args: list[str]) -> dict[str, str]:
    """{what: topic name as the nodes will have it (relative: in the process's namespace)}: where this
    process will command its robot, and where it reads the robot's state."""
    from .nodes.action_publisher import PARAMS as ACTION
    from .nodes.observation_node import params_for
    from .param_files import check

    report = check(files, ros_args)
    action = dict({p.name: p.default for p in ACTION}, **report.values("oxygen_action"))
    observation = report.values("oxygen_observation")
    state_default = next(p.default for p in params_for(()) if p.name == "state_topic")
    return {"commands": str(action["action_topic"]), "state": str(observation.get("state_topic", state_default))}


def inactive_status(engine_node) -> str:
    """The status line of an engine node that is not active: its state, and what its configure is fetching
    (a managed start's configure may download a checkpoint for minutes)."""
    fetching = [message for _, _, message, values in engine_node.downloads.reports()
                if values["phase"] in ("downloading", "verifying")]
    return f"[status] oxygen_engine {engine_node.state_label}" + "".join(f" | {m}" for m in fetching)


_CLAIMS: list = []      # this process's claims on engine names (open, locked files: the OS releases them at exit)


def _domain() -> str:
    return os.environ.get("ROS_DOMAIN_ID", "0") or "0"


def _ways_out(domain: str) -> str:
    return (f"give this one another ROS_DOMAIN_ID (now {domain}) or a namespace (oxygen_bringup --namespace "
            "robot2; ros2 launch ... namespace:=robot2)")


def claim_engine_name(name: str) -> str:
    """This machine's claim on engine `name` on this process's ROS domain, kept while the process lives (a
    locked file: the OS lets go of it when the process ends, however it ends). A second bringup on the same
    machine, domain and name is refused at once, whatever DDS discovery has seen by then (crosswiring looks
    for engines on other machines). Empty: claimed, or no claim possible (discovery off: processes here do not
    see each other; a temporary folder another user owns); else the refusal."""
    import fcntl
    import hashlib
    import tempfile

    if os.environ.get("ROS_AUTOMATIC_DISCOVERY_RANGE", "").upper() == "OFF":
        return ""
    domain = _domain()
    key = hashlib.sha1(f"{domain}\0{name}".encode()).hexdigest()[:16]
    try:
        handle = open(Path(tempfile.gettempdir()) / f"oxygen_engine_{key}.lock", "a+")
    except OSError:
        return ""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        other = handle.read().strip()
        handle.close()
        which = f" (on this machine, pid {other})" if other.isdigit() else " (on this machine)"
        return (f"oxygen_bringup: refusing to start: another {name} runs on ROS domain {domain}{which}: its robot "
                f"would get both engines' commands; {_ways_out(domain)}")
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    _CLAIMS.append(handle)
    return ""


def crosswiring(node, topics: dict[str, str], own: int = 0, wait_s: float = 0.0) -> str:
    """Why this process must not start next to what already runs on its ROS domain (empty: nothing): another
    oxygen_engine under the same name, another node publishing on its command topic, another oxygen_observation
    reading its state topic: each robot would get both engines' commands, each engine both robots' inputs.
    `own`: how many of those this process has built itself (0 before the load, 1 after). Looks for `wait_s`
    (DDS discovery takes a moment) before deciding there is none."""
    domain = _domain()
    name = node.get_fully_qualified_name()
    commands = node.resolve_topic_name(topics["commands"])
    state = node.resolve_topic_name(topics["state"])
    ways_out = _ways_out(domain)
    deadline = time.monotonic() + wait_s
    while True:
        engines = [n for n, ns in node.get_node_names_and_namespaces()
                   if f"{ns.rstrip('/')}/{n}" == name]
        publishers = node.get_publishers_info_by_topic(commands)
        readers = [i for i in node.get_subscriptions_info_by_topic(state) if i.node_name == "oxygen_observation"]
        if len(engines) > 1:
            return (f"oxygen_bringup: refusing to start: another {name} runs on ROS domain {domain}: its robot "
                    f"would get both engines' commands; {ways_out}")
        # DDS announces endpoints before node names: while the clash's name is still unknown, look on (the engine
        # check above then names it) until the deadline.
        unnamed = any(i.node_name.startswith("_NODE_NAME_UNKNOWN") for i in publishers + readers)
        if unnamed and time.monotonic() < deadline:
            time.sleep(0.1)
            continue
        if len(publishers) > own:
            other = next(f"{i.node_namespace.rstrip('/')}/{i.node_name}" for i in publishers)
            return (f"oxygen_bringup: refusing to start: {other} already publishes on {commands} (ROS domain "
                    f"{domain}): the robot would get two streams of commands; {ways_out}")
        if len(readers) > own:
            other = next(f"{i.node_namespace.rstrip('/')}/{i.node_name}" for i in readers)
            return (f"oxygen_bringup: refusing to start: {other} already reads {state} (ROS domain {domain}): "
                    f"two engines would act on one robot's state; {ways_out}")
        if time.monotonic() >= deadline:
            return ""
        time.sleep(0.1)


def _file_problems(engine: dict, console: dict, record_path) -> list[str]:
    """The files the start needs that can be checked without the model, one line each: the engine's
    checkpoint, tokenizer and norm stats (there at all; their contents are the engine node's), the console's
    token file (the console reads it only once the model is loaded), the recording's directory."""
    from .console.guard import read_token
    from .model.download import is_remote       # a hub id or gs:// URL: the engine node fetches it

    keys = ("checkpoint", "checkpoint_base", "tokenizer", "norm_stats")
    problems = [f"{key} not found: {engine[key]}" for key in keys
                if isinstance(engine.get(key), str) and engine[key] and not is_remote(engine[key])
                and not Path(engine[key]).exists()]
    if console.get("port") and isinstance(console.get("token_file"), str) and console["token_file"]:
        try:
            read_token(console["token_file"])
        except ValueError as e:
            problems.append(f"oxygen_console.{e}")
    if isinstance(record_path, str) and record_path:
        why = _unwritable(Path(record_path))
        if why:
            problems.append(f"oxygen_recorder.path {record_path!r}: cannot record there: {why}")
    return problems


def _unwritable(directory: Path) -> str:
    """Why a recording cannot go into `directory` (created if missing), empty if it can: the directory,
    or the nearest folder above it that exists, must be a writable folder."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return ""


def main(argv: list[str] | None = None) -> int:
    from .serve.cli import exit_interrupted, stop_on_signals

    # SIGINT/SIGTERM from here on: the orderly stop below. Installed before the imports (torch: seconds) and
    # the model load, so that a signal during either ends the start cleanly (the load stops at its next
    # tensor), instead of raising KeyboardInterrupt through an import or the lifecycle transition.
    stop = stop_on_signals("oxygen_bringup")
    return exit_interrupted(run(sys.argv[1:] if argv is None else argv, stop))


def run(argv: list[str], stop) -> int:
    from .serve.cli import INTERRUPTED

    args, ros_args = parse_args(argv)
    import rclpy
    from rclpy.signals import SignalHandlerOptions

    from .nodes.engine_node import EngineNode
    from .nodes.fleet import ParamsFiles
    from .robot.configs import demo_weights_params, find_config

    try:
        files = ([str(find_config(args.robot))] if args.robot else []) + args.params_file
    except FileNotFoundError as e:
        print(f"oxygen_bringup: {e}", file=sys.stderr)
        return 2
    fleet = ParamsFiles(args.params_file).engine().get("robots")
    if args.robot and fleet:
        print(f"oxygen_bringup: --robot {args.robot} and a fleet (robots: {fleet}) both given: a fleet names "
              "each robot's config in <robot>.robot_config (docs/fleet.md)", file=sys.stderr)
        return 2
    if args.robot:
        print(f"oxygen_bringup: robot config {files[0]}", flush=True)
    if args.robot == "demo":
        files.insert(1, str(demo_weights_params()))
    if args.namespace and fleet:
        print(f"oxygen_bringup: --namespace with a fleet (robots: {fleet}): each fleet robot has its own "
              "namespace (<robot>.namespace, docs/fleet.md)", file=sys.stderr)
        return 2
    refusal = startup_refusal(args, files, ros_args)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if stop.is_set():                      # Ctrl-C during the imports and checks
        print("oxygen_bringup: interrupted while starting: stopped before running", flush=True)
        return INTERRUPTED
    rcl_files = [str(in_namespace(Path(f), args.namespace)) for f in files] if args.namespace else files
    rcl_args = ["oxygen_bringup", "--ros-args"] + [a for f in rcl_files for a in ("--params-file", f)]
    rcl_args += [a for a in ros_args if a != "--ros-args"]
    if args.namespace:
        rcl_args += ["-r", f"__ns:=/{args.namespace}"]
    sys.setswitchinterval(0.001)
    rclpy.init(args=rcl_args, signal_handler_options=SignalHandlerOptions.NO)
    executors = Executors(args.threads)
    engine_node = EngineNode(attach=lambda engine: ProcessNodes(engine, executors, engine_node, args.record,
                                                                args.console),
                             params_files=ParamsFiles(files), stop_loading=stop)
    nodes = [engine_node]
    servers = []            # the openpi and LeRobot clients' (--openpi-port, --lerobot-port)
    try:
        crossing = claim_engine_name(engine_node.get_fully_qualified_name()) or \
            crosswiring(engine_node, startup_topics(files, ros_args), wait_s=DISCOVERY_S)
        if crossing:
            print(crossing, file=sys.stderr)
            return 2
        executors.services.add_node(engine_node)
        if not args.managed:
            # The bringup is the lifecycle manager: configure (load, check everything), then activate.
            engine_node.trigger_configure()
            if stop.is_set():              # Ctrl-C during the load (stopped at its next tensor): nothing started
                print("oxygen_bringup: interrupted while starting: stopped before running", flush=True)
                return INTERRUPTED
            if engine_node.failure:        # its problems: logged by oxygen_engine just above, each once
                print("oxygen_bringup: refusing to start, bad parameters (oxygen_engine's configure failed: "
                      "above)", file=sys.stderr)
                return 2
            # Again once loaded (another engine may have started meanwhile), now with this process's own nodes.
            crossing = crosswiring(engine_node, startup_topics(files, ros_args), own=1)
            if crossing:
                print(crossing, file=sys.stderr)
                return 2
            engine_node.trigger_activate()
            from .serve.cli import start_for_bringup
            try:
                servers = start_for_bringup(engine_node.engine, args)
            except ValueError as e:
                print(f"oxygen_bringup: refusing to start: {e}", file=sys.stderr)
                return 2
        if args.demo:
            from .nodes.demo_client import DemoClient, SceneQuestions
            from .nodes.sim_robot import SimRobotNode

            sim = SimRobotNode()
            questions = SceneQuestions(lambda: (sim.world.layout, sim.world.scene.tip()), sim.scene_shown)
            for node in (sim, DemoClient(questions=questions)):
                nodes.append(node)
                executors.other.add_node(node)
        executors.start()
        how = ("managed: waiting for lifecycle transitions on /oxygen_engine/change_state" if args.managed
               else "Ctrl-C stops")
        stop.running = True
        print(f"oxygen_bringup: running ({', '.join(n.get_name() for n in nodes)}); {how}", flush=True)
        start = time.monotonic()
        next_status = start + args.status_period
        late = 0
        while not stop.is_set() and not stop.wait(0.1):
            now = time.monotonic()
            if args.duration and now - start >= args.duration:
                break
            if args.status_period and now >= next_status:
                attached = engine_node.attached
                if attached is not None and engine_node.state_label == "active":
                    warning, late = late_warning(engine_node.engine, late)
                    print(status_line(engine_node.engine, attached.robots)
                          + "".join(f" | {server.status()}" for server in servers)
                          + (f" | {sim.status()}" if args.demo else "") + warning, flush=True)
                else:
                    print(inactive_status(engine_node), flush=True)
                next_status += args.status_period
        # Safe shutdown order: the demo's robot and client leave first (they would report the action output's
        # and the conversation's services going away: warnings at every stop), no more commands, then the
        # engine lets go of the device, then ROS.
        for node in nodes[1:]:
            executors.other.remove_node(node)
        for server in servers:
            server.stop()
        if engine_node.state_label != "finalized":
            engine_node.trigger_shutdown()
        executors.shutdown()
        print("oxygen_bringup: stopped", flush=True)
        return 0
    finally:
        # A start stopped by a signal skips the teardown: the process ends at once (exit_interrupted) with nothing
        # moved, where destroying the nodes and DDS (in C, holding the interpreter) held a Ctrl-C past 2 s.
        if not (stop.is_set() and not stop.running):
            if engine_node.state_label != "finalized":
                engine_node.trigger_shutdown()
            for node in nodes:
                node.destroy_node()
            if rclpy.ok():
                rclpy.shutdown()
        # Python puts back the default handlers of the signals it handled while it finalises (torch, DDS and
        # MuJoCo teardown: 0.7-2.6 s measured): a further Ctrl-C there killed the stopped process (exit
        # -2, 130 in a shell). Everything is stopped by now: ignore them.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    raise SystemExit(main())
