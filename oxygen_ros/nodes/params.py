"""Declaring ROS parameters the ros2/examples way (defaults and descriptions), read back as plain values.

Problems are collected, not raised one by one, so a node that refuses to start lists every bad
parameter in one message. Parameters are read-only by default: a node that reads its values once, at
start, would report success for a change at run time and change nothing; rclpy refuses it with a reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rcl_interfaces.msg import ParameterDescriptor


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


def declare_all(node, specs: list[Param], read_only: bool = True) -> tuple[dict[str, Any], list[str]]:
    """Declare `specs` on `node`; return ({name: value}, problems): every value outside its choices or
    range, one line each. The node adds its own consistency checks and raises ParameterError once.
    read_only=False only for a node that reads its parameters again (a lifecycle node's configure)."""
    for p in specs:
        desc = p.description
        if p.choices:
            desc += f" One of: {', '.join(map(str, p.choices))}."
        # Empty-list defaults cannot carry their element type in rclpy: accept any type, check below.
        dynamic = isinstance(p.default, list) and not p.default
        node.declare_parameter(p.name, p.default,
                               ParameterDescriptor(description=desc, dynamic_typing=dynamic, read_only=read_only))
    return read_all(node, specs)


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
            kind = type(p.default[0]) if p.default else None
            if kind is float:
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
