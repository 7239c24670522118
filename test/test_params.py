"""Parameter declaration (nodes/params.py) on a real rclpy node: every bad value is listed (NaN and inf
included), and parameters are read-only once the node runs (a change would report success and do nothing)."""
from __future__ import annotations

import math

import pytest
import rclpy
from rclpy.context import Context
from rclpy.node import Node
from rclpy.parameter import Parameter

from oxygen_ros.nodes.params import Param, declare_all

SPECS = [
    Param("hold_timeout_s", 1.0, "Longest hold.", minimum=0.0),
    Param("rate_hz", 70.0, "Rate.", minimum=1.0, maximum=1000.0),
    Param("gain", 0.5, "No range: still finite."),
    Param("limits", [], "Per-dimension bounds."),
    Param("mode", "hold", "Mode.", choices=("hold", "stop")),
]


@pytest.fixture
def make_node():
    context = Context()
    rclpy.init(context=context)
    nodes = []

    def make(**overrides) -> Node:
        node = Node("params_test", context=context,
                    parameter_overrides=[Parameter(k, value=v) for k, v in overrides.items()])
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.destroy_node()
    rclpy.shutdown(context=context)


def test_good_values_pass(make_node):
    values, problems = declare_all(make_node(hold_timeout_s=2.5, limits=[1.0, -2.0]), SPECS)
    assert problems == []
    assert values == {"hold_timeout_s": 2.5, "rate_hz": 70.0, "gain": 0.5, "limits": [1.0, -2.0], "mode": "hold"}


def test_nan_and_inf_are_refused_with_the_parameter_named(make_node):
    # NaN compares false with everything, so `value < minimum` let `hold_timeout_s: .nan` (hold forever) in.
    node = make_node(hold_timeout_s=math.nan, rate_hz=math.inf, gain=-math.inf, limits=[0.0, math.nan])
    _, problems = declare_all(node, SPECS)
    assert problems == [
        "params_test.hold_timeout_s = nan: must be a finite number",
        "params_test.rate_hz = inf: must be a finite number",
        "params_test.gain = -inf: must be a finite number",
        "params_test.limits = [0.0, nan]: every entry must be a finite number",
    ]


def test_out_of_range_values_are_listed_together(make_node):
    _, problems = declare_all(make_node(hold_timeout_s=-1.0, rate_hz=5000.0, mode="teleport"), SPECS)
    assert problems == ["params_test.hold_timeout_s = -1.0: must be >= 0.0",
                        "params_test.rate_hz = 5000.0: must be <= 1000.0",
                        "params_test.mode = 'teleport': must be one of ['hold', 'stop']"]


def test_parameters_are_read_only_at_run_time(make_node):
    node = make_node()
    values, _ = declare_all(node, SPECS)
    result = node.set_parameters([Parameter("hold_timeout_s", value=9.0)])[0]
    assert not result.successful and "read-only" in result.reason
    assert node.get_parameter("hold_timeout_s").value == 1.0 == values["hold_timeout_s"]
    assert node.describe_parameter("hold_timeout_s").read_only
