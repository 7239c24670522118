"""A fleet: one engine serving N robots, declared in oxygen_engine's parameters the way nav2 declares its
plugins (a list of names, then a section per name):

    oxygen_engine:
      ros__parameters:
        model: pi05                              # the model, the KV pool, the engine: shared
        robots: [arm_a, arm_b]
        arm_a: {robot_config: droid, norm_stats: /models/droid/norm_stats.json}   # namespace: /arm_a
        arm_b: {robot_config: aloha, namespace: /cell2/arm_b}
    /arm_a/oxygen_observation:                   # per robot node: its namespace + the node's name
      ros__parameters: {state_topic: /arm_a/joint_states, ...}

Per robot: `namespace` (default /<name>), `robot_config` (config/<name>.yaml, or a file: its cameras,
state, action type, limits, prompt and policy I/O), `norm_stats` (a file or folder, a hub id or a gs:// URL,
fetched at configure as the engine's own: fetch_norm_stats) and `asset_id` (empty: none). A robot's
nodes (observation, action, conversation, view) live in its namespace and take their parameters from its
robot config's sections (`/**`, then `oxygen_<node>`), then the params files' `/<namespace>/oxygen_<node>`
section. The model-level settings in a robot config (model, checkpoint, horizon, ...) are the fleet
engine's: ignored there, and said so.

Names: every interface name is relative (`oxygen/action`), so ROS resolves it in the node's namespace:
`/oxygen/action` for the single robot in `/` (today's names, `robots` empty), `/arm_a/oxygen/action` for
robot arm_a. Nothing builds a name by hand.

Everything here is plain Python (no ROS): the engine node and the bringup call it; every problem is listed.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from oxygen_ros.model.download import is_remote
from oxygen_ros.params_yaml import read_file
from oxygen_ros.robot.configs import find_config
from oxygen_ros.robot.policy_io import RobotIOConfig

# oxygen_engine's <robot>.<key> parameters, with their descriptions ({0}: the robot's name).
ROBOT_KEYS = {
    "namespace": "Namespace of robot {0}'s nodes and interface (/<namespace>/oxygen/...). Empty: /{0}.",
    "robot_config": "Robot {0}'s config: a name in config/ (droid, aloha, libero, demo) or a YAML file.",
    "norm_stats": "Robot {0}'s norm_stats.json (or a directory with assets/<asset_id>/, or a LeRobot policy "
                  "folder; a hub id org/name[@revision] or a gs:// URL: its statistics fetched once into the hub's / "
                  "openpi's cache). Empty: a LeRobot checkpoint's own, else none.",
    "asset_id": "Which assets/<asset_id> folder robot {0}'s norm stats come from when there are several.",
}
ROBOT_NODES = ("oxygen_observation", "oxygen_action", "oxygen_conversation", "oxygen_view")
# What a robot config's oxygen_engine section says about the robot itself (the rest, state_in_prompt
# included, is the engine's: one prompt format for the shared model).
ROBOT_IO_KEYS = tuple(f.name for f in fields(RobotIOConfig))
ENGINE_NODE = "oxygen_engine"
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")


def valid_name(name: str) -> bool:
    """A robot name (and each part of a namespace): a letter, then letters, digits or _."""
    return bool(_NAME.match(name))


def flatten(params: dict, prefix: str = "") -> dict:
    """Nested parameter maps as ROS names them: {cameras: {base: {topic: x}}} -> {cameras.base.topic: x}."""
    out = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _section_name(node: str) -> str:
    """Node names in params files: `oxygen_action` and `/oxygen_action` are the same node (rcl adds the /)."""
    return node if node.startswith("/") else "/" + node


class ParamsFiles:
    """ROS parameter files as rcl reads them: node section -> flat parameters, later files winning. Read by
    the checker's reader (params_yaml.read_file: bounded, regular files only, rcl's value types, aliases and
    duplicate blocks refused), so that the fleet sees what the checker checked and rcl applies."""

    def __init__(self, paths: list[str | Path] = ()):
        self.sections: dict[str, dict] = {}
        self.problems: list[str] = []
        for path in paths:
            given, problems = read_file(path)
            self.problems += problems
            for g in given:
                name = g.section if g.section == "/**" else _section_name(g.section)
                self.sections.setdefault(name, {})[g.name] = g.value

    def node(self, name: str) -> dict:
        """The parameters node `name` (fully qualified) gets: the `/**` section, then its own."""
        return dict(self.sections.get("/**", {}), **self.sections.get(_section_name(name), {}))

    def engine(self) -> dict:
        return self.sections.get(_section_name(ENGINE_NODE), {})


@dataclass(frozen=True)
class FleetRobot:
    name: str
    namespace: str                     # absolute: /arm_a
    config_file: Path
    io: RobotIOConfig
    norm_stats: str                    # empty: no (un)normalisation
    asset_id: str
    node_params: dict                  # node name -> parameters from the robot config (files override them)
    ignored: tuple[str, ...] = ()      # engine settings in the robot config that the fleet's engine decides

    def parameters(self, node: str, files: ParamsFiles) -> dict:
        """What this robot's `node` is given: its robot config's values under the params files' section."""
        return dict(self.node_params.get(node, {}), **files.node(f"{self.namespace}/{node}"))


def robot_config_path(value: str) -> Path:
    """A robot config by name (config/<name>.yaml, found the ROS way) or a YAML file's path."""
    if value.endswith((".yaml", ".yml")) or "/" in value:
        path = Path(value)
        if not path.is_file():
            raise FileNotFoundError(f"no robot config file {value}")
        return path
    return find_config(value)


def _namespace(value: str) -> str:
    return "/" + value.strip("/") if value.strip("/") else "/"


def read_fleet(names: list[str], values: dict[str, dict], files: ParamsFiles) -> tuple[list[FleetRobot], list[str]]:
    """The fleet from oxygen_engine's `robots` and `<robot>.<key>` values, and every problem, one line each:
    bad or repeated robot names and namespaces, robot configs missing or unreadable, norm stats missing,
    settings for a robot not in `robots`, and params-file sections that would configure no robot."""
    problems: list[str] = []
    robots: list[FleetRobot] = []
    seen_names: set[str] = set()
    namespaces: dict[str, str] = {}
    for name in names:
        if not valid_name(name):
            problems.append(f"robots: {name!r} is not a robot name (a letter, then letters, digits or _)")
            continue
        if name in seen_names:
            problems.append(f"robots lists {name} twice")
            continue
        seen_names.add(name)
        v = values.get(name, {})
        wrong = [f"{name}.{key} = {value!r}: must be a string" for key, value in v.items()
                 if not isinstance(value, str)]
        if wrong:
            problems += wrong
            continue
        namespace = _namespace(v.get("namespace") or name)
        if namespace == "/":
            problems.append(f"{name}.namespace is '/': every robot of a fleet has a namespace of its own "
                            "(the single robot in / is `robots: []`)")
        elif not all(valid_name(part) for part in namespace.strip("/").split("/")):
            problems.append(f"{name}.namespace {v.get('namespace')!r} is not a ROS namespace")
        elif namespace in namespaces:
            problems.append(f"{namespaces[namespace]} and {name} have the same namespace {namespace}: "
                            "each robot needs its own (its topics would mix)")
        else:
            namespaces[namespace] = name
        config = v.get("robot_config", "")
        if not config:
            problems.append(f"{name}.robot_config is empty: name a robot config (droid, aloha, libero, demo) "
                            "or a YAML file")
            continue
        try:
            path = robot_config_path(config)
            robot_files = ParamsFiles([path])
        except FileNotFoundError as e:
            problems.append(f"{name}.robot_config: {e}")
            continue
        if robot_files.problems:
            problems += [f"{name}.robot_config: {p}" for p in robot_files.problems]
            continue
        engine_section = robot_files.engine()
        norm_stats = v.get("norm_stats", "")
        if norm_stats and not is_remote(norm_stats) and not Path(norm_stats).exists():
            problems.append(f"{name}.norm_stats not found: {norm_stats}")
        io_values = {k: engine_section[k] for k in ROBOT_IO_KEYS if k in engine_section}
        try:
            io = RobotIOConfig.from_params(io_values)
        except TypeError as e:
            problems.append(f"{name}.robot_config {path}: {e}")
            continue
        robots.append(FleetRobot(
            name=name, namespace=namespace, config_file=path, io=io,
            norm_stats=norm_stats,
            asset_id=v.get("asset_id", ""),
            node_params={node: robot_files.node(node) for node in ROBOT_NODES},
            ignored=tuple(sorted(k for k in engine_section if k not in ROBOT_IO_KEYS))))
    problems += _stray_settings(names, namespaces, files)
    return robots, problems


def fetch_norm_stats(robots: list[FleetRobot], fetch: Callable[[FleetRobot], str | Path]
                     ) -> tuple[list[FleetRobot], list[str]]:
    """The robots with each remote `norm_stats` (a hub id or gs:// URL) replaced by its local copy, `fetch(robot)`
    (model/download.py's resolve_checkpoint, as the engine's own), and the fetches' one-line refusals, each
    named with its robot."""
    fetched, problems = [], []
    for robot in robots:
        if robot.norm_stats and is_remote(robot.norm_stats):
            try:
                robot = replace(robot, norm_stats=str(fetch(robot)))
            except ValueError as e:
                problems.append(f"{robot.name}.norm_stats: {e}")
                robot = replace(robot, norm_stats="")
        fetched.append(robot)
    return fetched, problems


# Each robot's outputs (node -> parameter -> what it is): two robots on one of them would mix commands, chunks,
# captions, pictures or answers of two robots, so a fleet sharing any is refused.
OUTPUTS = {
    "oxygen_action": {"action_topic": "publish their commands", "chunk_topic": "publish their chunks"},
    "oxygen_conversation": {"service_name": "serve their conversation service",
                            "action_name": "serve their streaming conversation action",
                            "memory_topic": "publish their captions",
                            "subtask_topic": "publish their subtasks", "progress_topic": "publish their progress memory",
                            "plan_topic": "publish their plans", "speech_topic": "publish their speech",
                            "interject_service": "serve their interjection service"},
    "oxygen_view": {"debug_topic": "publish their debug pictures", "marker_topic": "publish their chunk markers"},
}


def resolve_name(name: str, namespace: str, node: str) -> str:
    """A topic or service name as ROS resolves it in a node (without remapping): absolute as given, `~/x`
    under the node's name, anything else under its namespace."""
    if name.startswith("/"):
        return name
    if name.startswith("~"):
        return f"{namespace.rstrip('/')}/{node}/{name[1:].lstrip('/')}"
    return f"{namespace.rstrip('/')}/{name}"


def shared_outputs(robots: list[FleetRobot], files: ParamsFiles, defaults: dict[str, dict]) -> list[str]:
    """Every output name two robots share, one line each. `defaults`: node -> its parameters' defaults (the
    nodes' own declarations). Read from the parameters, so it is said even when a node could not be built."""
    problems, owners = [], {}
    for robot in robots:
        for node, outputs in OUTPUTS.items():
            values = dict(defaults.get(node, {}), **robot.parameters(node, files))
            for key, what in outputs.items():
                name = resolve_name(str(values[key]), robot.namespace, node)
                other = owners.setdefault((what, name), robot.name)
                if other != robot.name:
                    problems.append(f"{other} and {robot.name} both {what} ({key}) on {name}: give each robot its "
                                    f"own (/<namespace>/{node})")
    return problems


def _stray_settings(names: list[str], namespaces: dict[str, str], files: ParamsFiles) -> list[str]:
    """Settings that would silently configure nothing: <robot>.<key> for a robot not in `robots`, robot
    I/O set on the engine itself (with a fleet it is each robot's), a robot node's section without a
    namespace or in a namespace no robot has."""
    problems = []
    listed = ", ".join(names)
    for key in files.engine():
        robot, _, rest = key.partition(".")
        if robot == "robots" and rest:
            problems.append(f"{key}: a robot's settings go under its name (arm_a: {{namespace: ...}}), not under robots")
        elif rest and robot not in names:         # the engine's own parameters have no dot
            problems.append(f"{key} is set but {robot} is not in robots [{listed}]: an unknown robot")
        elif rest and rest not in ROBOT_KEYS:
            problems.append(f"{key}: {rest!r} is not a robot setting (one of {', '.join(ROBOT_KEYS)})")
        elif key in ROBOT_IO_KEYS:
            problems.append(f"oxygen_engine.{key} is a robot's setting: with a fleet it comes from each "
                            "robot's robot_config")
        elif key in ("norm_stats", "asset_id"):
            problems.append(f"oxygen_engine.{key} is a robot's setting: with a fleet it is each robot's "
                            f"<robot>.{key}")
    known = ", ".join(namespaces) or "none"
    for section in files.sections:
        namespace, _, node = section.rpartition("/")
        if node not in ROBOT_NODES or "*" in namespace:
            continue
        if not namespace:
            problems.append(f"section {node} configures no robot of the fleet: name it /<namespace>/{node} "
                            f"(namespaces: {known})")
        elif namespace not in namespaces:
            problems.append(f"section {section}: no robot has the namespace {namespace} (namespaces: {known}): "
                            "an unknown robot")
    return problems
