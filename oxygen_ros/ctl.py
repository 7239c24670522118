"""oxygen_ctl: the operator's ROS 2 commands with rclpy alone, for installs without the `ros2` CLI (the README's
pip install: ROS 2 from PyPI has rclpy and the messages, not ros2cli). Each form is the `ros2` one's:

    oxygen_ctl lifecycle get /oxygen_engine                  # ros2 lifecycle get
    oxygen_ctl lifecycle set /oxygen_engine configure        # ros2 lifecycle set (configure, activate, ...)
    oxygen_ctl param list /oxygen_engine                     # ros2 param list
    oxygen_ctl param get /oxygen_engine kv_budget_mb         # ros2 param get
    oxygen_ctl param describe /oxygen_engine action_rate_hz  # ros2 param describe (bounds, choices)
    oxygen_ctl param set /oxygen_engine checkpoint /models/other      # ros2 param set (YAML-typed value)
    oxygen_ctl topic list                                    # ros2 topic list -t
    oxygen_ctl topic echo /oxygen/memory --count 1           # ros2 topic echo
    oxygen_ctl topic hz /oxygen/action --window 5            # ros2 topic hz
    oxygen_ctl service call /oxygen/enable std_srvs/srv/SetBool "{data: true}"     # ros2 service call
    oxygen_ctl bag info /tmp/bag                             # ros2 bag info, for the recorder's MCAP files

An entry point of the package rather than scripts: it is installed with the package on both installs
(pip and colcon) and on the PATH like oxygen_bringup, its errors are one line like the package's others
(exit 1: no such node, service or topic within --timeout; 2: a usage mistake), and CI runs every form
against a running bringup (test/test_ctl.py). Node names, topics and services are absolute or relative to
the root namespace (/robot2/oxygen_engine for a bringup started with --namespace robot2).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from importlib import import_module

TRANSITIONS = ("configure", "activate", "deactivate", "cleanup", "shutdown")


class CtlError(Exception):
    """A command that could not be done: one line for the operator."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="oxygen_ctl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for a node, service or topic to appear (default 10)")
    commands = parser.add_subparsers(dest="command", required=True)

    lifecycle = commands.add_parser("lifecycle", help="a lifecycle node's state and transitions").add_subparsers(
        dest="verb", required=True)
    get = lifecycle.add_parser("get", help="the node's state")
    get.add_argument("node")
    change = lifecycle.add_parser("set", help="trigger a transition")
    change.add_argument("node")
    change.add_argument("transition", choices=TRANSITIONS)

    param = commands.add_parser("param", help="a node's parameters").add_subparsers(dest="verb", required=True)
    listing = param.add_parser("list", help="the node's parameter names")
    listing.add_argument("node")
    for verb, what in (("get", "a parameter's value"), ("describe", "a parameter's type, description, bounds")):
        sub = param.add_parser(verb, help=what)
        sub.add_argument("node")
        sub.add_argument("name")
    change = param.add_parser("set", help="set a parameter (the value read as YAML: 64.0, true, [1, 2], text)")
    change.add_argument("node")
    change.add_argument("name")
    change.add_argument("value")

    topic = commands.add_parser("topic", help="topics").add_subparsers(dest="verb", required=True)
    topic.add_parser("list", help="every topic with its type")
    echo = topic.add_parser("echo", help="print a topic's messages")
    echo.add_argument("topic")
    echo.add_argument("--count", type=int, default=0, help="stop after this many messages (0: until Ctrl-C)")
    hz = topic.add_parser("hz", help="a topic's message rate")
    hz.add_argument("topic")
    hz.add_argument("--window", type=float, default=5.0, help="seconds to measure over (default 5)")

    service = commands.add_parser("service", help="services").add_subparsers(dest="verb", required=True)
    call = service.add_parser("call", help="call a service once")
    call.add_argument("service")
    call.add_argument("type", help="its type, e.g. std_srvs/srv/SetBool")
    call.add_argument("request", nargs="?", default="{}", help="the request's fields as YAML, e.g. '{data: true}'")

    bag = commands.add_parser("bag", help="recordings").add_subparsers(dest="verb", required=True)
    info = bag.add_parser("info", help="what a recording (a directory of MCAP files, or one file) holds")
    info.add_argument("path")

    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout {args.timeout}: must be positive")
    if getattr(args, "count", 0) < 0:
        parser.error(f"--count {args.count}: must be 0 (every message) or more")
    if args.command == "topic" and args.verb == "hz" and not args.window > 0:
        parser.error(f"--window {args.window}: must be positive")
    return args


# ---------------------------------------------------------------------------------------------- messages
def interface_type(name: str, kind: str):
    """The class of `pkg/kind/Name` (kind: msg or srv); CtlError naming what is wrong."""
    parts = name.split("/")
    if len(parts) == 2:
        parts = [parts[0], kind, parts[1]]
    if len(parts) != 3 or parts[1] != kind or not all(parts):
        raise CtlError(f"{name}: not a {kind} type name (package/{kind}/Name, e.g. "
                       f"{'std_srvs/srv/SetBool' if kind == 'srv' else 'std_msgs/msg/String'})")
    try:
        return getattr(import_module(f"{parts[0]}.{kind}"), parts[2])
    except (ImportError, AttributeError):
        raise CtlError(f"{name}: no such {kind} type in this install") from None


def to_plain(msg):
    """A message as plain Python (dicts, lists, numbers, text), for printing as YAML."""
    if hasattr(msg, "get_fields_and_field_types"):
        return {field: to_plain(getattr(msg, field)) for field in msg.get_fields_and_field_types()}
    if hasattr(msg, "tolist"):                  # numpy arrays of numeric sequences
        return msg.tolist()
    if isinstance(msg, (list, tuple)):
        return [to_plain(m) for m in msg]
    if isinstance(msg, bytes):
        return list(msg)
    return msg


def fill(msg, values, where: str = ""):
    """Set `msg`'s fields from a YAML mapping (nested messages as nested mappings); CtlError on a field the
    type does not have or a value it does not take."""
    if not isinstance(values, dict):
        raise CtlError(f"{where or 'the request'}: expected a mapping of fields, got {values!r}")
    fields = msg.get_fields_and_field_types()
    for name, value in values.items():
        path = f"{where}.{name}" if where else name
        if name not in fields:
            raise CtlError(f"{path}: no such field (fields: {', '.join(fields)})")
        current = getattr(msg, name)
        if hasattr(current, "get_fields_and_field_types"):
            fill(current, value, path)
            continue
        try:
            setattr(msg, name, float(value) if isinstance(current, float) and isinstance(value, int) else value)
        except (AssertionError, TypeError, ValueError) as e:
            raise CtlError(f"{path}: {value!r} does not fit {fields[name]} ({e})") from None
    return msg


def print_yaml(value) -> None:
    import yaml

    print(yaml.safe_dump(value, sort_keys=False, default_flow_style=False, allow_unicode=True).rstrip())


# ---------------------------------------------------------------------------------------------- ROS side
class Ctl:
    """A short-lived node that does one command."""

    def __init__(self, timeout: float):
        import rclpy
        from rclpy.context import Context
        from rclpy.node import Node

        self.timeout = timeout
        self.context = Context()
        rclpy.init(context=self.context)
        self.node = Node("oxygen_ctl", context=self.context, start_parameter_services=False)
        from rclpy.executors import SingleThreadedExecutor

        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=1.0)
        self.node.destroy_node()
        self.context.try_shutdown()

    def spin_until(self, done, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.executor.spin_once(timeout_sec=min(0.1, remaining))
        return True

    def call(self, srv_type, name: str, request):
        client = self.node.create_client(srv_type, name)
        try:
            if not client.wait_for_service(timeout_sec=self.timeout):
                raise CtlError(f"no service {name} within {self.timeout:g} s (is the node running, on this "
                               "ROS_DOMAIN_ID and namespace?)")
            future = client.call_async(request)
            if not self.spin_until(future.done, self.timeout):
                raise CtlError(f"{name}: no response within {self.timeout:g} s")
            return future.result()
        finally:
            self.node.destroy_client(client)

    def topic_type(self, topic: str):
        found: list[str] = []

        def known() -> bool:
            found[:] = [t for name, types in self.node.get_topic_names_and_types() if name == topic for t in types]
            return bool(found)
        if not self.spin_until(known, self.timeout):
            raise CtlError(f"no topic {topic} within {self.timeout:g} s (oxygen_ctl topic list shows those there are)")
        return interface_type(found[0], "msg")


def node_name(name: str) -> str:
    return name if name.startswith("/") else f"/{name}"


def lifecycle(ctl: Ctl, args) -> int:
    from lifecycle_msgs.srv import ChangeState, GetAvailableTransitions, GetState

    node = node_name(args.node)
    if args.verb == "get":
        state = ctl.call(GetState, f"{node}/get_state", GetState.Request()).current_state
        print(f"{state.label} [{state.id}]")
        return 0
    available = ctl.call(GetAvailableTransitions, f"{node}/get_available_transitions",
                         GetAvailableTransitions.Request()).available_transitions
    match = [t.transition for t in available if t.transition.label == args.transition]
    if not match:
        state = ctl.call(GetState, f"{node}/get_state", GetState.Request()).current_state
        possible = sorted({t.transition.label for t in available})
        raise CtlError(f"{node} is {state.label}: no {args.transition} from there (possible: {', '.join(possible)})")
    result = ctl.call(ChangeState, f"{node}/change_state", ChangeState.Request(transition=match[0]))
    if not result.success:
        print(f"oxygen_ctl: {node}: {args.transition} failed (the node's log says why)", file=sys.stderr)
        return 1
    print(f"{node}: {args.transition}: done")
    return 0


PARAMETER_TYPES = {1: "bool", 2: "integer", 3: "double", 4: "string", 5: "byte array", 6: "bool array",
                   7: "integer array", 8: "double array", 9: "string array"}


def parameter_value(value):
    """A ParameterValue's Python value (None: not set)."""
    field = {1: "bool_value", 2: "integer_value", 3: "double_value", 4: "string_value", 5: "byte_array_value",
             6: "bool_array_value", 7: "integer_array_value", 8: "double_array_value",
             9: "string_array_value"}.get(value.type)
    return None if field is None else to_plain(getattr(value, field))


def as_parameter_value(text: str):
    """The ParameterValue of a command-line value read as YAML (as `ros2 param set` reads it)."""
    import yaml
    from rclpy.parameter import Parameter

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    if value is None:
        value = text if text else ""
    try:
        return Parameter("value", value=value).get_parameter_value()
    except (TypeError, ValueError) as e:
        raise CtlError(f"{text!r}: not a parameter value ({e})") from None


def param(ctl: Ctl, args) -> int:
    from rcl_interfaces.srv import DescribeParameters, GetParameters, ListParameters, SetParameters

    node = node_name(args.node)
    if args.verb == "list":
        names = ctl.call(ListParameters, f"{node}/list_parameters", ListParameters.Request()).result.names
        print("\n".join(sorted(names)))
        return 0
    if args.verb == "get":
        values = ctl.call(GetParameters, f"{node}/get_parameters", GetParameters.Request(names=[args.name])).values
        if not values or values[0].type == 0:
            raise CtlError(f"{node} has no parameter {args.name}")
        print(parameter_value(values[0]))
        return 0
    if args.verb == "describe":
        found = ctl.call(DescribeParameters, f"{node}/describe_parameters",
                         DescribeParameters.Request(names=[args.name])).descriptors
        if not found or found[0].type == 0:
            raise CtlError(f"{node} has no parameter {args.name}")
        d = found[0]
        print(f"Parameter name: {d.name}\n  Type: {PARAMETER_TYPES.get(d.type, d.type)}\n"
              f"  Description: {d.description}")
        if d.additional_constraints:
            print(f"  Constraints: {d.additional_constraints}")
        for r in d.floating_point_range:
            print(f"  Min value: {r.from_value}\n  Max value: {r.to_value}")
        for r in d.integer_range:
            print(f"  Min value: {r.from_value}\n  Max value: {r.to_value}")
        if d.read_only:
            print("  Read only: true")
        return 0
    from rcl_interfaces.msg import Parameter as ParameterMsg

    request = SetParameters.Request(parameters=[ParameterMsg(name=args.name, value=as_parameter_value(args.value))])
    result = ctl.call(SetParameters, f"{node}/set_parameters", request).results[0]
    if not result.successful:
        print(f"oxygen_ctl: {node} {args.name}: not set: {result.reason}", file=sys.stderr)
        return 1
    print(f"{node} {args.name}: set")
    return 0


def topic(ctl: Ctl, args) -> int:
    from rclpy.qos import qos_profile_sensor_data

    if args.verb == "list":
        # Discovery: until other nodes are seen and no topic has appeared for 1 s (at most --timeout).
        seen, changed = set(), [time.monotonic()]

        def settled() -> bool:
            now = {name for name, _ in ctl.node.get_topic_names_and_types()}
            if now != seen:
                seen.clear()
                seen.update(now)
                changed[0] = time.monotonic()
            others = [n for n, _ in ctl.node.get_node_names_and_namespaces() if n != "oxygen_ctl"]
            return bool(others) and time.monotonic() - changed[0] >= 1.0
        ctl.spin_until(settled, ctl.timeout)
        for name, types in sorted(ctl.node.get_topic_names_and_types()):
            print(f"{name} [{', '.join(types)}]")
        return 0
    msg_type = ctl.topic_type(args.topic)
    received: list[tuple[float, object]] = []
    # Sensor-data QoS (best effort) receives from reliable and best-effort publishers alike.
    ctl.node.create_subscription(msg_type, args.topic, lambda m: received.append((time.monotonic(), m)),
                                 qos_profile_sensor_data)
    if args.verb == "echo":
        printed = 0
        while not args.count or printed < args.count:
            if not ctl.spin_until(lambda: len(received) > printed, ctl.timeout if not printed else math.inf):
                raise CtlError(f"no message on {args.topic} within {ctl.timeout:g} s")
            print_yaml(to_plain(received[printed][1]))
            print("---", flush=True)
            printed += 1
        return 0
    if not ctl.spin_until(lambda: bool(received), ctl.timeout):
        raise CtlError(f"no message on {args.topic} within {ctl.timeout:g} s")
    start = received[-1][0]
    ctl.spin_until(lambda: received[-1][0] - start >= args.window, args.window + 1.0)
    stamps = [t for t, _ in received if t >= start]
    periods = [b - a for a, b in zip(stamps, stamps[1:])]
    if not periods:
        raise CtlError(f"one message on {args.topic} in {args.window:g} s: no rate")
    mean = sum(periods) / len(periods)
    std = math.sqrt(sum((p - mean) ** 2 for p in periods) / len(periods))
    print(f"average rate: {1.0 / mean:.3f} Hz\n  min: {min(periods):.4f} s max: {max(periods):.4f} s "
          f"std dev: {std:.5f} s window: {len(periods) + 1} messages")
    return 0


def service(ctl: Ctl, args) -> int:
    import yaml

    srv_type = interface_type(args.type, "srv")
    try:
        values = yaml.safe_load(args.request) or {}
    except yaml.YAMLError as e:
        raise CtlError(f"the request is not YAML: {str(e).splitlines()[0]}") from None
    request = fill(srv_type.Request(), values)
    response = ctl.call(srv_type, args.service if args.service.startswith("/") else f"/{args.service}", request)
    print_yaml(to_plain(response))
    return 0


def bag_info(path: str) -> int:
    """Files, duration, and per topic its type and message count, from each MCAP file's summary."""
    from pathlib import Path

    from mcap.exceptions import McapError
    from mcap.reader import make_reader

    where = Path(path)
    files = sorted(where.glob("*.mcap")) if where.is_dir() else [where]
    if not files or not files[0].is_file():
        raise CtlError(f"{path}: no MCAP recording there")
    topics: dict[str, list] = {}
    start, end, total = None, None, 0
    for f in files:
        try:
            with open(f, "rb") as stream:
                summary = make_reader(stream).get_summary()
        except (McapError, OSError, ValueError) as e:
            raise CtlError(f"{f}: not a readable MCAP file ({e})") from None
        if summary is None or summary.statistics is None:
            raise CtlError(f"{f}: no summary (the recording did not end cleanly): mcap recover {f} -o fixed.mcap")
        stats = summary.statistics
        start = stats.message_start_time if start is None else min(start, stats.message_start_time)
        end = stats.message_end_time if end is None else max(end, stats.message_end_time)
        total += stats.message_count
        for channel_id, count in stats.channel_message_counts.items():
            channel = summary.channels[channel_id]
            schema = summary.schemas.get(channel.schema_id)
            entry = topics.setdefault(channel.topic, [schema.name if schema else "?", 0])
            entry[1] += count
    print(f"Files: {len(files)} ({', '.join(f.name for f in files)})\n"
          f"Duration: {(end - start) / 1e9:.3f} s\nMessages: {total}\nTopics:")
    for name, (type_name, count) in sorted(topics.items()):
        print(f"  {name} [{type_name}]: {count}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "bag":
            return bag_info(args.path)
        if args.command == "service":
            interface_type(args.type, "srv")            # a mistyped type: said before joining ROS
        ctl = Ctl(args.timeout)
        try:
            return {"lifecycle": lifecycle, "param": param, "topic": topic, "service": service}[args.command](ctl, args)
        finally:
            ctl.close()
    except CtlError as e:
        print(f"oxygen_ctl: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
