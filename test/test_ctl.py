"""oxygen_ctl: every operator command of docs/operating.md and the README in a form that works without the
`ros2` CLI (the README's pip install has none), run against a real bringup the way an operator would: the
lifecycle (get, set, a refused transition), parameters (list, get, describe with bounds, set, a refused
value), topics (list, echo, hz), service calls (the conversation, the enable switch, mistakes named), and
the recording (bag info)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ros_harness import REPO, Bringup, private_domain


def ctl(domain: int, *args, timeout: float = 120.0) -> tuple[int, str, str]:
    env = dict(os.environ, ROS_DOMAIN_ID=str(domain), PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "oxygen_ros.ctl", "--timeout", "120", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def test_every_operator_command_through_oxygen_ctl(tmp_path):
    domain = private_domain(81)
    bag = tmp_path / "bag"
    bringup = Bringup(["--demo", "--managed", "--record", str(bag), "--status-period", "0"], domain)
    try:
        assert bringup.wait_for_line("oxygen_bringup: running", 120), bringup.output()
        code, out, err = ctl(domain, "lifecycle", "get", "/oxygen_engine")
        assert (code, out.strip()) == (0, "unconfigured [1]"), err
        code, out, err = ctl(domain, "lifecycle", "set", "/oxygen_engine", "activate")
        assert code == 1 and "oxygen_ctl: /oxygen_engine is unconfigured: no activate from there" in err, err

        code, out, err = ctl(domain, "param", "list", "/oxygen_engine")
        assert code == 0 and "kv_budget_mb" in out.split() and "checkpoint" in out.split(), err
        code, out, err = ctl(domain, "param", "describe", "/oxygen_engine", "kv_budget_mb")
        assert code == 0 and "Type: double" in out and "Min value: 1.0" in out, out + err
        code, out, err = ctl(domain, "param", "set", "/oxygen_engine", "kv_budget_mb", "48.0")
        assert code == 0, err
        code, out, err = ctl(domain, "param", "get", "/oxygen_engine", "kv_budget_mb")
        assert (code, out.strip()) == (0, "48.0"), err
        code, out, err = ctl(domain, "param", "set", "/oxygen_engine", "kv_budget_mb", "lots")
        assert code == 1 and "oxygen_ctl: /oxygen_engine kv_budget_mb: not set:" in err, err

        for transition in ("configure", "activate"):
            code, out, err = ctl(domain, "lifecycle", "set", "/oxygen_engine", transition)
            assert code == 0 and out.strip() == f"/oxygen_engine: {transition}: done", (out, err, bringup.output())
        assert ctl(domain, "lifecycle", "get", "/oxygen_engine")[1].strip() == "active [3]"

        code, out, err = ctl(domain, "topic", "list")
        assert "/oxygen/action [std_msgs/msg/Float64MultiArray]" in out.splitlines(), out + err
        code, out, err = ctl(domain, "topic", "echo", "/oxygen/action", "--count", "2")
        assert code == 0 and out.count("---") == 2 and "data:" in out, out + err
        code, out, err = ctl(domain, "topic", "hz", "/oxygen/action", "--window", "2")
        assert code == 0 and out.startswith("average rate: ") and float(out.split()[2]) > 0, out + err

        code, out, err = ctl(domain, "service", "call", "/oxygen/converse", "oxygen_interfaces/srv/Converse",
                             "{text: 'How many cubes are there?', max_tokens: 4}")
        assert code == 0 and "success: true" in out and "reply: " in out, out + err
        code, out, err = ctl(domain, "service", "call", "/oxygen/enable", "std_srvs/srv/SetBool", "{data: false}")
        assert code == 0 and "success: true" in out, out + err
        code, out, err = ctl(domain, "service", "call", "/oxygen/enable", "std_srvs/srv/SetBool", "{dat: false}")
        assert code == 1 and err.strip() == "oxygen_ctl: dat: no such field (fields: data)", err

        for transition in ("deactivate", "cleanup"):      # cleanup closes the recording
            code, out, err = ctl(domain, "lifecycle", "set", "/oxygen_engine", transition)
            assert code == 0, (transition, out, err, bringup.output()[-3000:])
        code, out, err = ctl(domain, "bag", "info", str(bag))
        assert code == 0 and "/oxygen/action [std_msgs/msg/Float64MultiArray]:" in out, out + err
        count = int(out.split("/oxygen/action [std_msgs/msg/Float64MultiArray]:")[1].split()[0])
        assert count > 0, out
    finally:
        assert bringup.stop() == 0, bringup.output()[-3000:]


@pytest.mark.parametrize("args, message", [
    (["service", "call", "/x", "std_srvs/SetBol"], "oxygen_ctl: std_srvs/SetBol: no such srv type in this install"),
    (["service", "call", "/x", "SetBool"], "oxygen_ctl: SetBool: not a srv type name (package/srv/Name, e.g. "
                                           "std_srvs/srv/SetBool)"),
    (["bag", "info", "/nonexistent/bag"], "oxygen_ctl: /nonexistent/bag: no MCAP recording there"),
])
def test_mistakes_are_one_line(args, message):
    code, out, err = ctl(0, *args, timeout=60)
    assert code == 1 and err.strip() == message, err


def test_a_missing_service_is_named_within_the_timeout():
    env = dict(os.environ, ROS_DOMAIN_ID=str(private_domain(82)))
    r = subprocess.run([sys.executable, "-m", "oxygen_ros.ctl", "--timeout", "1", "lifecycle", "get", "/nobody"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("oxygen_ctl: no service /nobody/get_state within 1 s"), r.stderr
