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


def test_ros2_param_describe_shows_the_bounds(make_node):
    """What `ros2 param describe` prints comes from the descriptor: the ranges and the choices are there,
    asked through the node's describe_parameters service as the CLI asks (issue #21)."""
    from rcl_interfaces.srv import DescribeParameters
    from rclpy.executors import SingleThreadedExecutor

    from oxygen_ros.nodes.engine_node import EngineNode

    node = make_node()
    declare_all(node, SPECS)
    engine_node = EngineNode(context=node.context)
    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(engine_node)
    executor.add_node(node)
    client = node.create_client(DescribeParameters, "/oxygen_engine/describe_parameters")
    future = client.call_async(DescribeParameters.Request(
        names=["action_rate_hz", "max_active_requests", "policy", "kv_budget_mb", "torch_threads", "checkpoint"]))
    executor.spin_until_future_complete(future, timeout_sec=10)
    rate, active, policy, kv, threads, checkpoint = future.result().descriptors
    engine_node.destroy_node()
    assert (rate.floating_point_range[0].from_value, rate.floating_point_range[0].to_value) == (1.0, 1000.0)
    assert rate.additional_constraints == ">= 1 and <= 1000, finite"
    assert active.integer_range[0].from_value == 1 and active.integer_range[0].to_value == 2**63 - 1
    assert policy.additional_constraints == "one of: 'isolated', 'shared_kv', 'oxygen'"
    assert kv.floating_point_range[0].from_value == 1.0 and kv.floating_point_range[0].to_value == math.inf
    assert (threads.integer_range[0].from_value, threads.integer_range[0].to_value) == (0, 1024)
    assert not checkpoint.floating_point_range and not checkpoint.integer_range
    described = {n: node.describe_parameter(n) for n in ("hold_timeout_s", "rate_hz", "mode")}
    assert described["hold_timeout_s"].floating_point_range[0].from_value == 0.0
    assert described["mode"].additional_constraints == "one of: 'hold', 'stop'"


def test_a_value_out_of_range_is_listed_and_a_later_set_is_refused_by_the_range(make_node):
    node = make_node(rate_hz=5000.0, hold_timeout_s=0.5)
    values, problems = declare_all(node, SPECS, read_only=False)
    assert problems == ["params_test.rate_hz = 5000.0: must be <= 1000.0"]      # listed, not raised by rclpy
    result = node.set_parameters([Parameter("hold_timeout_s", value=-1.0)])[0]
    assert not result.successful and "out of range" in result.reason
