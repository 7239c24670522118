"""The parameters a process is started with, checked before rclpy reads them: every params file, the robot
configs a fleet names, `--ros-args -p node:name:=value` and `--ros-args --params-file`.

rclpy alone would start on most mistakes: it ignores a parameter no node declares (a misspelled
`upper_limit` leaves the arm at the config's limits), ignores a node section no node has (`oxygen_engin:`),
keeps an earlier file's value when a later one has another type (`kv_budget_mb: lots` stayed 16.0), and
answers a wrong type or a YAML syntax error with a traceback. Here every problem is one line naming the file
(and line), the node and the parameter, all of them listed before anything starts:

    bad.yaml:3: oxygen_action.upper_limit: unknown parameter (did you mean upper_limits?)

What is known comes from the nodes themselves: each node module's `Param` list (the engine's settings from
EngineConfig through engine_node.PARAMS), the same specs the nodes declare. Values are typed as rcl types
them (`rcl_value`: unquoted true/yes/on are booleans, 64 an integer, 64.0 a float, anything quoted a string)
and must have the declared type, as rclpy requires (params.type_problem: an int for a float parameter is
refused: write 64.0), then lie within the declared choices and bounds (params.problem).

Section names as ROS matches them: `oxygen_action` and `/oxygen_action` are one node, `/**` (or a node part
`*`/`**`) every node, whose parameters then must be some node's; `/arm_a/oxygen_action` is a fleet robot's
node (nodes/fleet.py checks the namespaces against the robots). A namespace written as a nesting level
(`arm_a: {oxygen_action: {ros__parameters: ...}}`) is refused: the fleet reads each node's full name as one key.

Ports are checked here too (`port_problems`): each server's port is bound and released before the model
loads, so a port in use is said at once, as such.
"""
from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .nodes.params import Param, problem, type_problem
from .params_yaml import Given, read_file, yaml_value

WILDCARDS = ("*", "**")
PACKAGE_PREFIX = "oxygen_"     # every node of this package: an unknown node named so is a mistake, not another's


@dataclass
class Report:
    """What the parameters say, and every problem with them (one line each); `others`: the sections for
    other packages' nodes, once each (no problem: said so that a misplaced section is seen)."""
    given: list[Given] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)

    def values(self, node: str, namespace: str = "/") -> dict[str, Any]:
        """What node `node` in `namespace` is given, later files winning: the wildcard sections, then its own."""
        out: dict[str, Any] = {}
        for g in self.given:
            if g.node == "**" or g.node == "*" or (g.node == node and g.namespace in (namespace, "/**")):
                out[g.name] = g.value
        return out


# ----------------------------------------------------------------------------------------- the command line
ROS_OPTIONS_WITH_VALUE = ("-p", "--param", "-r", "--remap", "--params-file", "-e", "--enclave", "--log-level",
                          "--log-config-file", "--log-file-name")


def split_ros_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the ROS arguments: every `--ros-args ... [--]` block, stray: anything outside them)."""
    ros, stray, inside = [], [], False
    for arg in argv:
        if arg == "--ros-args":
            inside = True
            ros.append(arg)
        elif arg == "--" and inside:
            inside = False
        else:
            (ros if inside else stray).append(arg)
    return ros, stray


@dataclass
class RosArgs:
    files: list[str] = field(default_factory=list)
    given: list[Given] = field(default_factory=list)
    namespace: str | None = None            # a `__ns` remap
    problems: list[str] = field(default_factory=list)


def read_ros_args(ros_args: list[str]) -> RosArgs:
    """The parameters in ROS arguments: `--params-file F`, `-p [node:]name:=value` (rcl reads the value as
    YAML), and a `__ns` remap (the nodes' namespace)."""
    out = RosArgs()
    args = [a for a in ros_args if a != "--ros-args"]
    i = 0
    while i < len(args):
        option = args[i]
        value = args[i + 1] if option in ROS_OPTIONS_WITH_VALUE and i + 1 < len(args) else None
        i += 2 if value is not None else 1
        if option == "--params-file" and value is not None:
            out.files.append(value)
        elif option in ("-p", "--param") and value is not None:
            lhs, sep, text = value.partition(":=")
            node, _, name = lhs.rpartition(":")
            where = f"--ros-args {option} {value}"
            if not sep or not name:
                out.problems.append(f"{where}: write name:=value (or node_name:name:=value)")
                continue
            try:
                parsed, wrong = yaml_value(yaml.compose(text, Loader=yaml.SafeLoader) or yaml.ScalarNode("", ""))
            except yaml.YAMLError as e:
                parsed, wrong = None, f"not valid YAML: {getattr(e, 'problem', None) or e}"
            if wrong:
                out.problems.append(f"{where}: {wrong}")
            else:
                out.given.append(Given(where, node or "/**", name, parsed))
        elif option in ("-r", "--remap") and value is not None:
            lhs, _, target = value.partition(":=")
            if lhs.rpartition(":")[2] == "__ns":
                out.namespace = "/" + target.strip("/")
    return out


# --------------------------------------------------------------------------------------------- the registry
def node_params(camera_slots: tuple[str, ...] | None = None) -> dict[str, list[Param]]:
    """Every node of this package by name, with the parameters it declares: its module's Param list (the
    observation node's cameras for `camera_slots`, the model's), plus those rclpy declares on every node."""
    from oxygen_ros.console.console_node import PARAMS as CONSOLE
    from oxygen_ros.model.config import CAMERA_SLOTS
    from oxygen_ros.record.recorder import PARAMS as RECORDER
    from oxygen_ros.view.view_node import PARAMS as VIEW

    from .nodes.action_publisher import PARAMS as ACTION
    from .nodes.conversation_service import PARAMS as CONVERSATION
    from .nodes.engine_node import PARAMS as ENGINE
    from .nodes.observation_node import params_for
    from .nodes.sim_robot import PARAMS as SIM_ROBOT

    nodes = {"oxygen_engine": ENGINE, "oxygen_observation": params_for(camera_slots or CAMERA_SLOTS),
             "oxygen_action": ACTION, "oxygen_conversation": CONVERSATION, "oxygen_view": VIEW,
             "oxygen_recorder": RECORDER, "oxygen_console": CONSOLE, "oxygen_sim_robot": SIM_ROBOT,
             "oxygen_demo_client": []}
    return {name: specs + ros_params() for name, specs in nodes.items()}


def ros_params() -> list[Param]:
    """The parameters rclpy declares on every node (use_sim_time; the type description service from Jazzy)."""
    from rclpy.time_source import USE_SIM_TIME_NAME

    out = [Param(USE_SIM_TIME_NAME, False, "Use the /clock topic's time.")]
    try:
        from rclpy.type_description_service import START_TYPE_DESCRIPTION_SERVICE_PARAM
    except ImportError:                                   # Humble's rclpy has no such service
        return out
    return out + [Param(START_TYPE_DESCRIPTION_SERVICE_PARAM, True, "Start the ~/get_type_description service.")]


def model_camera_slots(model: Any) -> tuple[str, ...] | None:
    """The camera slots of oxygen_engine's `model` (a preset or a config file), None when it cannot be read
    here (the engine says why at configure)."""
    from oxygen_ros.model.config import PRESETS

    if isinstance(model, str) and model in PRESETS:
        return tuple(PRESETS[model].camera_slots)
    if isinstance(model, str) and Path(model).is_file():
        try:
            from oxygen_ros.engine.factory import model_config

            return tuple(model_config(model).camera_slots)
        except Exception:  # noqa: BLE001 - a broken model file is the engine's to report, with its reason
            return None
    return None


# ------------------------------------------------------------------------------------------------ checking
def check(files: list[str | Path], ros_args: list[str] = (), given: list[Given] = ()) -> Report:
    """Every problem with these parameters, one line each: the params files in order, then the ROS arguments
    (their --params-file files, then -p values), then `given` (values the program sets: --console's port)."""
    report = Report()
    ros = read_ros_args(list(ros_args))
    for path in [*files, *ros.files]:
        values, problems = read_file(path)
        report.given += values
        report.problems += problems
    report.given += ros.given + list(given)
    report.problems += ros.problems
    engine = report.values("oxygen_engine")
    registry = node_params(model_camera_slots(engine.get("model")))
    robots = engine.get("robots") if isinstance(engine.get("robots"), list) else []
    report.problems += _check_given(report.given, registry, [str(r) for r in robots], report.others)
    if not robots:
        report.problems += _namespaced_sections(report.given, ros.namespace or "/", set(registry))
    report.problems += _fleet_robot_configs(report, robots, registry)
    return report


def _check_given(given: list[Given], registry: dict[str, list[Param]], robots: list[str],
                 others: list[str] | None = None) -> list[str]:
    """The problems with `given` against the package's nodes; a section for a node of another package (a name
    neither this package's nor close to one of its nodes' names) is no problem: ROS 2 lets each node take its
    own section from a shared file. Such sections are added to `others` once each."""
    problems, unknown_sections = [], set()
    for g in given:
        if g.node in WILDCARDS:
            specs = [(node, p) for node, params in registry.items() for p in params if p.name == g.name]
            if not specs:
                known = sorted({p.name for params in registry.values() for p in params})
                node, _, name = g.name.partition(".")
                hint = (f" (a parameter of {node}: -p {node}:{name}:=...)" if node in registry and name
                        else _did_you_mean(g.name, known))
                problems.append(f"{g.where}: {g.section}.{g.name}: no node has this parameter{hint}")
            for node, p in specs:                     # every node that declares it gets it: each must take it
                wrong = type_problem(p, g.value) or problem(p, g.value)
                if wrong:
                    problems.append(f"{g.where}: {g.section}.{g.name} = {g.value!r}: {wrong} (as {node}'s)")
                    break
            continue
        if g.node not in registry:
            if g.section not in unknown_sections:
                unknown_sections.add(g.section)
                hint = _did_you_mean(g.node, list(registry))
                if hint or g.node.startswith(PACKAGE_PREFIX):
                    problems.append(f"{g.section_where or g.where}: {g.section}: unknown node"
                                    + (hint or f" (this package's: {', '.join(registry)})"))
                elif others is not None:
                    others.append(f"{g.section_where or g.where}: {g.section}: not a node of this package (left to "
                                  f"its own node)")
            continue
        specs = {p.name: p for p in registry[g.node]}
        if g.node == "oxygen_engine" and g.name not in specs and "." in g.name and robots:
            continue        # a fleet robot's <robot>.<key>: nodes/fleet.py checks them, before the model loads
        if g.name not in specs:
            owners = [node for node, params in registry.items() if any(p.name == g.name for p in params)]
            wrong = (f"belongs to {' and '.join(owners)} (write it under {owners[0]}:)" if owners
                     else f"unknown parameter{_did_you_mean(g.name, list(specs))}")
        else:
            p = specs[g.name]
            wrong = type_problem(p, g.value) or problem(p, g.value)
            wrong = wrong and f"= {g.value!r}: {wrong}"
        if wrong:
            sep = " " if wrong.startswith("=") else ": "
            problems.append(f"{g.where}: {g.section}.{g.name}{sep}{wrong}")
    return problems


def _did_you_mean(name: str, candidates: list[str]) -> str:
    """A hint only for a name a typo away from one candidate: at most 2 edits (1 for names under 6 characters),
    counted on what differs once a prefix shared by all the candidates (oxygen_) is set aside, so that a
    name is never matched for the prefix alone."""
    shared = os.path.commonprefix(candidates) if len(candidates) > 1 else ""
    stem = name.removeprefix(shared) if name.startswith(shared) else name
    allowed = 1 if len(stem) < 6 else 2
    close = sorted((_edits(stem, c.removeprefix(shared)), c) for c in candidates)
    return f" (did you mean {close[0][1]}?)" if close and close[0][0] <= allowed else ""


def _edits(a: str, b: str) -> int:
    """Levenshtein distance, an adjacent swap counting as one edit (optimal string alignment)."""
    rows = [list(range(len(b) + 1))]
    for i, x in enumerate(a, 1):
        row = [i]
        for j, y in enumerate(b, 1):
            row.append(min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (x != y)))
            if i > 1 and j > 1 and x == b[j - 2] and a[i - 2] == y:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def _namespaced_sections(given: list[Given], namespace: str, nodes: set[str]) -> list[str]:
    """Without a fleet every node of the package (`nodes`) runs in `namespace`: a section for one in another
    namespace configures nothing (a fleet's robot sections are nodes/fleet.py's to check against its robots)."""
    problems, seen = [], set()
    for g in given:
        if g.node not in nodes or "*" in g.namespace or g.namespace == namespace or g.section in seen:
            continue
        seen.add(g.section)
        problems.append(f"{g.section_where or g.where}: {g.section}: configures no node: the nodes run in {namespace} (a namespace "
                        f"per robot is a fleet's: oxygen_engine's robots, docs/fleet.md)")
    return problems


def _fleet_robot_configs(report: Report, robots: list[str], registry: dict[str, list[Param]]) -> list[str]:
    """A fleet robot's nodes take its robot config's sections too: each named config is checked like a params
    file (a missing one is nodes/fleet.py's to report, with the robot's name)."""
    from .nodes.fleet import robot_config_path

    engine, problems, seen = report.values("oxygen_engine"), [], set()
    for robot in robots:
        config = engine.get(f"{robot}.robot_config")
        if not isinstance(config, str) or not config:
            continue
        try:
            path = robot_config_path(config)
        except FileNotFoundError:
            continue
        if path in seen:
            continue
        seen.add(path)
        given, file_problems = read_file(path)
        problems += file_problems + _check_given(given, registry, [])
    return problems


# ---------------------------------------------------------------------------------------------------- ports
@dataclass(frozen=True)
class PortUse:
    """A server the process will start: `what` names the option that sets it (--console, --openpi-port...).
    A further server (a LeRobot policy server) adds its PortUse to the list its entry point checks."""
    what: str
    host: str
    port: int


def port_problems(uses: list[PortUse]) -> list[str]:
    """Each server's address bound and released now, before the model loads: one line per port in use (or
    given twice, or not bindable), saying so. Port 0 (any free port) is not checked. SO_REUSEADDR as asyncio's
    servers set it, so a port only in TIME_WAIT passes, as the server would."""
    problems, owners = [], {}
    for use in uses:
        if not use.port:
            continue
        if use.port in owners:
            problems.append(f"{owners[use.port]} and {use.what} both use port {use.port}: give each its own")
            continue
        owners[use.port] = use.what
        wrong = _bind_problem(use.host, use.port)
        if wrong:
            problems.append(f"{use.what}: {wrong}")
    return problems


def _bind_problem(host: str, port: int) -> str | None:
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot listen on {host}:{port}: {e.strerror}"
    except OverflowError:
        return f"port {port} is not a TCP port (0-65535)"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return (f"port {port} on {host} is in use (another program listens there): give another port "
                            "or stop that program")
                return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None
