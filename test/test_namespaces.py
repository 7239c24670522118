"""Two bringups on one ROS domain never cross-wire: a second one where an engine already runs refuses in one
line naming the other and the two ways out; with --namespace each robot's whole node set lives apart
(/robot2/oxygen_engine, /robot2/oxygen/action, the demo's /robot2/sim/...), and neither sees the other's
topics. Two real demo bringups (the simulated robot closes each loop)."""
from __future__ import annotations

import time

from std_msgs.msg import Float64MultiArray

from ros_harness import Bringup, RosClient, private_domain, wait_until

WAYS_OUT = "give this one another ROS_DOMAIN_ID (now {domain}) or a namespace (oxygen_bringup --namespace robot2"


def endpoints(client: RosClient, topic: str, publishers: bool) -> set[str]:
    info = (client.node.get_publishers_info_by_topic if publishers else client.node.get_subscriptions_info_by_topic)(topic)
    return {f"{i.node_namespace.rstrip('/')}/{i.node_name}" for i in info} - {"/namespaces_test"}   # not this test's


def test_a_second_bringup_refuses_then_two_namespaces_run_apart():
    domain = private_domain(71)
    first = Bringup(["--demo", "--status-period", "0"], domain)
    client = RosClient(domain, "namespaces_test")
    second = third = None
    try:
        assert first.wait_for_line("oxygen_bringup: running", 120), first.output()
        # The same node set again on the same domain: refused before the load, in one line.
        second = Bringup(["--demo", "--status-period", "0"], domain)
        assert second.proc.wait(120) == 2, second.output()
        refusal = [line for line in second.lines if "refusing to start" in line]
        assert len(refusal) == 1, second.output()
        # Named by the engine, or (when discovery has not named it yet) by the topic it already commands on.
        assert "another /oxygen_engine runs on ROS domain" in refusal[0] or \
            "already publishes on /oxygen/action (ROS domain" in refusal[0], refusal
        assert WAYS_OUT.format(domain=domain) in refusal[0], refusal
        # On this machine: found by the first one's claim on its name, before the load, whatever DDS has seen.
        assert "(on this machine, pid " in refusal[0] and "loading model" not in second.output(), second.output()
        assert first.proc.poll() is None                       # the first one runs on, untouched

        # In its own namespace the second robot runs beside the first.
        third = Bringup(["--demo", "--status-period", "0", "--namespace", "robot2"], domain)
        assert third.wait_for_line("oxygen_bringup: running", 120), third.output()
        first_actions = client.collect(Float64MultiArray, "/oxygen/action")
        second_actions = client.collect(Float64MultiArray, "/robot2/oxygen/action")
        assert wait_until(lambda: len(first_actions) > 20 and len(second_actions) > 20, 60), third.output()[-3000:]
        # Each command topic has its own engine's publisher and its own robot's subscriber; each engine reads its
        # own robot's camera and joints.
        assert endpoints(client, "/oxygen/action", True) == {"/oxygen_action"}
        assert endpoints(client, "/robot2/oxygen/action", True) == {"/robot2/oxygen_action"}
        assert endpoints(client, "/oxygen/action", False) == {"/oxygen_sim_robot"}
        assert endpoints(client, "/robot2/oxygen/action", False) == {"/robot2/oxygen_sim_robot"}
        for namespace in ("", "/robot2"):
            for topic in ("sim/joint_states", "sim/camera/base/image_raw"):
                readers = endpoints(client, f"{namespace}/{topic}", False)
                assert readers == {f"{namespace}/oxygen_observation"}, (topic, readers)
        names = {f"{ns.rstrip('/')}/{n}" for n, ns in client.node.get_node_names_and_namespaces()}
        assert {"/oxygen_engine", "/robot2/oxygen_engine", "/robot2/oxygen_conversation"} <= names, names
    finally:
        client.close()
        codes = [b.stop() for b in (first, second, third) if b is not None]
    assert codes[0] == 0 and codes[-1] == 0, (first.output()[-2000:], third and third.output()[-2000:])
    assert "Traceback" not in first.output() + (third.output() if third else "")


def test_a_namespace_is_checked_before_anything_starts():
    from oxygen_ros.bringup import parse_args

    assert parse_args(["--demo", "--namespace", "/lab/robot2/"])[0].namespace == "lab/robot2"
    import pytest

    with pytest.raises(SystemExit):
        parse_args(["--demo", "--namespace", "2robot"])


def test_params_sections_move_into_the_namespace(tmp_path):
    from pathlib import Path

    from oxygen_ros.bringup import in_namespace

    params = tmp_path / "robot.yaml"
    params.write_text("# a comment\n/**:\n  ros__parameters:\n    a: 1\noxygen_engine:\n  ros__parameters:\n"
                      "    model: tiny\n/other/node:\n  ros__parameters: {}\n")
    lines = Path(in_namespace(params, "robot2")).read_text().splitlines()
    assert lines == ["# a comment", "/**:", "  ros__parameters:", "    a: 1", "/robot2/oxygen_engine:",
                     "  ros__parameters:", "    model: tiny", "/other/node:", "  ros__parameters: {}"]


def test_an_engine_name_is_claimed_on_this_machine_while_its_process_lives(monkeypatch):
    """The claim behind the refusal above (a locked file per domain and engine name): a second claim is refused
    naming the holder's pid; released, the name can be claimed again; other domains and names are apart;
    with DDS discovery off nothing is claimed (processes on one machine do not see each other then)."""
    import os

    from oxygen_ros import bringup

    monkeypatch.setenv("ROS_DOMAIN_ID", str(private_domain(72)))
    name = f"/claim_test_{os.getpid()}/oxygen_engine"
    assert bringup.claim_engine_name(name) == ""
    held = bringup._CLAIMS[-1]
    try:
        refusal = bringup.claim_engine_name(name)
        assert refusal.startswith(f"oxygen_bringup: refusing to start: another {name} runs on ROS domain "
                                  f"{private_domain(72)} (on this machine, pid {os.getpid()})"), refusal
        assert WAYS_OUT.format(domain=private_domain(72)) in refusal
        assert bringup.claim_engine_name(name + "2") == ""              # another name
        bringup._CLAIMS.pop().close()
        monkeypatch.setenv("ROS_AUTOMATIC_DISCOVERY_RANGE", "OFF")
        assert bringup.claim_engine_name(name) == ""
    finally:
        bringup._CLAIMS.remove(held)
        held.close()
    monkeypatch.delenv("ROS_AUTOMATIC_DISCOVERY_RANGE")
    assert bringup.claim_engine_name(name) == ""                      # released with its file
    bringup._CLAIMS.pop().close()
