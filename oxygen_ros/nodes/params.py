"""Declaring ROS parameters the ros2/examples way (defaults and descriptions), read back as plain values.

Problems are collected, not raised one by one, so a node that refuses to start lists every bad
parameter in one message. Parameters are read-only by default: a node that reads its values once, at
start, would report success for a change at run time and change nothing; rclpy refuses it with a reason.
Bounds go into the descriptor (`ros2 param describe` shows them: FloatingPointRange / IntegerRange, the
choices in additional_constraints), and rclpy enforces them on a later `ros2 param set`. A value given at
start outside them is still reported here with the others (rclpy would refuse the declaration alone).
A value's type is rclpy's rule (`type_problem`): the default's type, an int for a float included; oxygen_ros/param_files.py
applies the same rules to the params files before rclpy reads them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.exceptions import InvalidParameterValueException

INT64 = (-(1 << 63), (1 << 63) - 1)


class ParameterError(ValueError):
    """Bad or inconsistent parameters: the message lists every problem, one per line."""


@dataclass(frozen=True)
class Param:
    name: str
    default: Any
    description: str
    choices: tuple = ()
    minimum: float | None = None
    maximum: float | None = None
    item: type | None = None        # a list's entry type where the default is empty (rclpy cannot tell it)

    @property
    def entry_type(self) -> type | None:
        """The entry type of a list parameter (None: not a list)."""
        if not isinstance(self.default, list):
            return None
        return type(self.default[0]) if self.default else self.item


def declare_all(node, specs: list[Param], read_only: bool = True) -> tuple[dict[str, Any], list[str]]:
    """Declare `specs` on `node`; return ({name: value}, problems): every value outside its choices or
    range, one line each. The node adds its own consistency checks and raises ParameterError once.
    read_only=False only for a node that reads its parameters again (a lifecycle node's configure)."""
    for p in specs:
        try:
            node.declare_parameter(p.name, p.default, descriptor(p, read_only))
        except InvalidParameterValueException:     # given outside its range: listed by read_all
            node.declare_parameter(p.name, p.default, descriptor(p, read_only, ranged=False))
    return read_all(node, specs)


def descriptor(p: Param, read_only: bool = True, ranged: bool = True) -> ParameterDescriptor:
    """The ROS descriptor of `p`: description, choices and bounds as `ros2 param describe` shows them."""
    desc = p.description
    if p.choices:
        desc += f" One of: {', '.join(map(str, p.choices))}."
    # Empty-list defaults cannot carry their element type in rclpy: accept any type, check in read_all.
    dynamic = isinstance(p.default, list) and not p.default
    d = ParameterDescriptor(description=desc, dynamic_typing=dynamic, read_only=read_only)
    constraints = [f"one of: {', '.join(map(repr, p.choices))}"] if p.choices else []
    if p.minimum is not None or p.maximum is not None:
        constraints.append(" and ".join(f"{op} {bound:g}" for op, bound in ((">=", p.minimum), ("<=", p.maximum))
                                        if bound is not None) + (", finite" if type(p.default) is float else ""))
        if ranged and type(p.default) is float:
            d.floating_point_range = [FloatingPointRange(
                from_value=float(p.minimum if p.minimum is not None else -math.inf),
                to_value=float(p.maximum if p.maximum is not None else math.inf), step=0.0)]
        elif ranged and type(p.default) is int:
            d.integer_range = [IntegerRange(from_value=int(p.minimum if p.minimum is not None else INT64[0]),
                                            to_value=int(p.maximum if p.maximum is not None else INT64[1]), step=1)]
    d.additional_constraints = "; ".join(constraints)
    return d


def read_all(node, specs: list[Param]) -> tuple[dict[str, Any], list[str]]:
    """The current values of declared `specs` and their problems (a lifecycle node reads them again at
    every configure: they may have been set since it was constructed)."""
    values, problems = {}, []
    for p in specs:
        value = node.get_parameter(p.name).value
        if isinstance(p.default, list) and value is None:
            value = []
        if isinstance(p.default, list):
            value = list(value)
            if p.entry_type is float:
                value = [float(v) for v in value]
        values[p.name] = value
        wrong = problem(p, value)
        if wrong:
            problems.append(f"{node.get_name()}.{p.name} = {value!r}: {wrong}")
    return values, problems


def problem(p: Param, value: Any) -> str | None:
    """What is wrong with `value` for `p`, or None. NaN compares false with everything, so it is refused
    before any range check (`hold_timeout_s: .nan` would otherwise mean 'hold forever')."""
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if isinstance(value, list) and any(isinstance(v, float) and not math.isfinite(v) for v in value):
        return "every entry must be a finite number"
    if p.choices and value not in p.choices:
        return f"must be one of {list(p.choices)}"
    if p.minimum is not None and value < p.minimum:
        return f"must be >= {p.minimum}"
    if p.maximum is not None and value > p.maximum:
        return f"must be <= {p.maximum}"
    return None


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a float", str: "a string"}


def expected(p: Param) -> str:
    """What `p` takes, in words: 'a float such as 256.0', 'a list of strings'..."""
    if p.entry_type is None and isinstance(p.default, list):
        return "a list"
    if p.entry_type is not None:
        return "a list of " + {bool: "true/false", int: "integers", float: "numbers", str: "strings"}[p.entry_type]
    return _TYPE_NAMES[type(p.default)] + (f" such as {p.default!r}" if type(p.default) is float else "")


def _is(value: Any, kind: type) -> bool:
    return type(value) is kind           # bool is an int to isinstance, not to rclpy


def type_problem(p: Param, value: Any) -> str | None:
    """What is wrong with the type of `value` (as rcl reads a params file: bool, int, float, str or a list of
    one of them) for `p`, or None. rclpy's rule: the declared default's type, so an int for a float parameter
    is refused (64 -> write 64.0). A list parameter with an empty default is declared dynamically typed
    (rclpy takes anything): it is checked here against its entry type, ints accepted for numbers (read_all
    converts them)."""
    if not isinstance(p.default, list):
        if _is(value, type(p.default)):
            return None
        if type(p.default) is float and _is(value, int):
            return f"must be a float: write {value:.1f} (ROS takes no integer for a float parameter)"
        return f"must be {expected(p)}"
    kind = p.entry_type
    if not isinstance(value, list):
        return f"must be {expected(p)}" + (f", e.g. [{value}]" if kind is None or _is(value, kind) else "")
    if kind is None:
        return None
    ints_for_floats = kind is float and not p.default        # dynamically typed: read_all converts them
    wrong = [v for v in value if not (_is(v, kind) or (ints_for_floats and _is(v, int)))]
    return f"must be {expected(p)} ({wrong[0]!r} is not)" if wrong else None
