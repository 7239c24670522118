"""A ROS 2 parameters file read as rcl reads it, and safely: the one reader of params files (the checker in
param_files.py, the fleet in nodes/fleet.py).

The bytes are read with a size cap from regular files only (a FIFO or a device is refused without waiting
for it), must be UTF-8, and are composed by PyYAML with what rcl's parser reads differently refused with
file:line: aliases (rcl expands none; expanded, a few hundred bytes can stand for gigabytes, or a cycle),
nesting past MAX_DEPTH, a second `ros__parameters:` block or a name given twice under one node (rcl applies
both), a NUL in a string (rcl cuts it there). Values are typed as rcl types them (`rcl_value`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .model.files import CheckpointError, read_bytes

PARAMETERS_KEY = "ros__parameters"
MAX_PARAMS_BYTES = 1 << 20     # a params file is a few kB; a fleet's with every robot's sections, tens of kB
MAX_DEPTH = 32                 # nested maps and lists (cameras.<slot>.topic: 4 with the node and its section)
FORMAT = "node_name:\n  ros__parameters:\n    name: value"

# rcl's YAML parameter parser (rcl_yaml_param_parser/src/parse.c, get_value): plain scalars only.
_TRUE = {"Y", "y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"}
_FALSE = {"N", "n", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"}
_SPECIAL_FLOATS = {f"{sign}{word}" for sign in ("", "+", "-") for word in (".inf", ".Inf", ".INF")} | {
    ".nan", ".NaN", ".NAN"}
_INTEGER = re.compile(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)\Z")    # strtol, base 0
_INT64 = (-(1 << 63), (1 << 63) - 1)


def rcl_value(text: str, quoted: bool) -> Any:
    """A YAML scalar as rcl types it: bool, int (decimal, 0x hex, 0 octal), float, else str; quoted: str."""
    if quoted:
        return text
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    m = _INTEGER.match(text)
    if m:
        digits = m.group(2)
        base = 16 if digits[:2] in ("0x", "0X") else 8 if len(digits) > 1 and digits[0] == "0" else 10
        value = int(digits, base) * (-1 if m.group(1) == "-" else 1)
        if _INT64[0] <= value <= _INT64[1]:
            return value
    if text in _SPECIAL_FLOATS:
        return float(text.replace(".", ""))
    if "_" not in text:                        # Python's float() takes 1_000, strtod does not
        try:
            return float(text)
        except ValueError:
            pass
    return text


@dataclass(frozen=True)
class Given:
    """One parameter value as the command line gives it: `where` names the file and line (or the argument)."""
    where: str
    section: str          # as written: oxygen_action, /**, /arm_a/oxygen_observation
    name: str
    value: Any
    section_where: str = ""     # the section's own line (default: `where`)

    @property
    def node(self) -> str:
        return self.section.rstrip("/").rpartition("/")[2] or "**"

    @property
    def namespace(self) -> str:
        return "/" + self.section.strip("/").rpartition("/")[0]


# ----------------------------------------------------------------------------------------------- reading files
def read_file(path: str | Path) -> tuple[list[Given], list[str]]:
    """The values a params file gives, with each one's line, and the file's problems, one line each: a file
    that is not a regular one (a FIFO or a device is refused without waiting for it) or is larger than
    MAX_PARAMS_BYTES, not UTF-8, YAML errors with their line and column, what rcl's parser reads differently
    (aliases, which it does not expand; a second `ros__parameters:` block or a name given twice under one
    node, both applied by rcl; a NUL in a string, where rcl cuts it), nesting past MAX_DEPTH, and a
    structure rcl would not read as parameters."""
    try:
        data = read_bytes(path, MAX_PARAMS_BYTES)
    except CheckpointError as e:
        return [], [f"{path}: cannot read the parameters file: {str(e).removeprefix(f'{path}: ')}"]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        return [], [f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); ROS parameters files are UTF-8"]
    try:
        root = yaml.compose(text, Loader=_RclLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        return [], [f"{path}{at}: not valid YAML: {_one_line(str(e.problem or e.context))}"]
    except yaml.YAMLError as e:
        return [], [f"{path}: not valid YAML: {_one_line(str(e))}"]
    if root is None:
        return [], []
    if not isinstance(root, yaml.MappingNode):
        return [], [f"{path}:{root.start_mark.line + 1}: not a ROS parameters file ({_one_line(FORMAT)})"]
    given, problems = [], []
    for key, body in root.value:
        section, where = str(key.value), f"{path}:{key.start_mark.line + 1}"
        pairs = body.value if isinstance(body, yaml.MappingNode) else []
        children = dict((k.value, v) for k, v in pairs)
        if PARAMETERS_KEY not in children:
            nested = [k for k, v in children.items() if isinstance(v, yaml.MappingNode)]
            if nested:
                problems.append(f"{where}: {section}: a namespace written as a nesting level; write each node's "
                                f"full name as one key (/{section.strip('/')}/{nested[0]}:)")
            else:
                problems.append(f"{where}: {section}: no {PARAMETERS_KEY} ({_one_line(FORMAT)})")
            continue
        blocks = [k for k, _ in pairs if k.value == PARAMETERS_KEY]
        if len(blocks) > 1:
            problems.append(f"{path}:{blocks[1].start_mark.line + 1}: {section}: a second {PARAMETERS_KEY} block "
                            f"(the first at line {blocks[0].start_mark.line + 1}): rcl applies both; write one")
            continue
        others = [k for k in children if k != PARAMETERS_KEY]
        if others:
            problems.append(f"{where}: {section}: only {PARAMETERS_KEY} belongs under a node's name, not {others[0]}")
        params = children[PARAMETERS_KEY]
        if isinstance(params, yaml.ScalarNode) and params.value == "":
            continue                                        # `ros__parameters:` with nothing under it
        if not isinstance(params, yaml.MappingNode):
            problems.append(f"{where}: {section}.{PARAMETERS_KEY}: must be a map of name: value")
            continue
        _flatten(str(path), section, where, params, "", given, problems)
    return given, problems


class _RclLoader(yaml.SafeLoader):
    """PyYAML's composer refusing what rcl's parser does not read as PyYAML would: an alias (rcl expands none;
    expanded, a few hundred bytes can stand for gigabytes, and a recursive one for a cycle) and nesting
    past MAX_DEPTH (PyYAML composes recursively: 10,000 levels are a RecursionError)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"an alias (*{event.anchor}): ROS's parameter parser "
                                              "reads none; write the value", event.start_mark)
        if self._depth >= MAX_DEPTH:
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _flatten(path: str, section: str, section_where: str, mapping: yaml.MappingNode, prefix: str, given: list,
             problems: list) -> None:
    """Nested names as ROS names them ({cameras: {base: {topic: x}}} -> cameras.base.topic), rcl-typed."""
    first_line: dict[str, int] = {}
    for key, node in mapping.value:
        name, line = f"{prefix}{key.value}", key.start_mark.line + 1
        where = f"{path}:{line}"
        if name in first_line:
            problems.append(f"{where}: {section}.{name}: given twice under one node (first at line "
                            f"{first_line[name]}); write it once")
            continue
        first_line[name] = line
        if isinstance(node, yaml.MappingNode):
            _flatten(path, section, section_where, node, name + ".", given, problems)
            continue
        value, wrong = yaml_value(node)
        if wrong:
            problems.append(f"{where}: {section}.{name}: {wrong}")
        else:
            given.append(Given(where, section, name, value, section_where))


def yaml_value(node: yaml.Node) -> tuple[Any, str | None]:
    """(value, None) as rcl reads a parameter's YAML node, or (None, what rcl would refuse or read otherwise)."""
    scalars = [node] if isinstance(node, yaml.ScalarNode) else node.value if isinstance(node, yaml.SequenceNode) else []
    if any(isinstance(item, yaml.ScalarNode) and "\0" in item.value for item in scalars):
        return None, "a NUL character in a string: rcl would cut it there"
    if isinstance(node, yaml.ScalarNode):
        quoted = node.style in ("'", '"')
        if node.value == "" and not quoted:
            return None, "no value (write '' for an empty string)"
        return rcl_value(node.value, quoted), None
    if isinstance(node, yaml.SequenceNode):
        if not all(isinstance(item, yaml.ScalarNode) for item in node.value):
            return None, "a list of plain values (true/false, numbers or strings), not of lists or maps"
        values = [rcl_value(item.value, item.style in ("'", '"')) for item in node.value]
        kinds = {type(v) for v in values}
        if len(kinds) > 1:
            return None, (f"a list mixes {' and '.join(sorted(k.__name__ for k in kinds))} entries: ROS lists "
                          "have one type (write 1.0, not 1, among floats)")
        return values, None
    return None, "not a value"


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines())
