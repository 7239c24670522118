"""The engine and a robot's drivers on two hosts, over DDS only: two network namespaces joined by a veth
pair, made here (root), with nothing but loopback and that pair in them. The engine host runs
oxygen_bringup (tiny model); the robot host runs test/fleet_robot.py: JPEG cameras and joint states out
(best effort), commands and chunks in (best effort), one conversation call. Discovery is configured as
on a network where multicast does not cross: ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST plus
ROS_STATIC_PEERS=<the other host>; FASTDDS_BUILTIN_TRANSPORTS=UDPv4 keeps Fast DDS off shared memory, so
every byte crosses the veth (asserted from its counters). Then the veth goes down for 2 s and everything
must resume by itself. The hosts share one kernel clock; the last phase skews the robot's stamps 2 s
ahead, as from a robot whose clock is not synchronised, and the engine must reject them and stop the
actions (docs/fleet.md)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from ros_harness import REPO, Bringup, private_domain


RATE_HZ = 70.0
ENGINE_IP, ROBOT_IP = "192.0.2.1", "192.0.2.2"   # TEST-NET-1 (RFC 5737): reachable only inside the pair


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


class TwoHosts:
    """Namespaces `<engine>` and `<robot>`, veth `<engine>v` <-> `<robot>v`, /30 addresses, lo up."""

    def __init__(self):
        tag = os.getpid() % 100_000
        self.engine, self.robot = f"oxe{tag}", f"oxr{tag}"
        self.veth = {self.engine: f"{self.engine}v", self.robot: f"{self.robot}v"}
        steps = [("netns", "add", self.engine), ("netns", "add", self.robot),
                 ("link", "add", self.veth[self.engine], "type", "veth", "peer", "name", self.veth[self.robot])]
        for ns, addr in ((self.engine, ENGINE_IP), (self.robot, ROBOT_IP)):
            steps += [("link", "set", self.veth[ns], "netns", ns),
                      ("-n", ns, "addr", "add", f"{addr}/30", "dev", self.veth[ns]),
                      ("-n", ns, "link", "set", "lo", "up"), ("-n", ns, "link", "set", self.veth[ns], "up")]
        for step in steps:
            r = _ip(*step)
            if r.returncode:
                self.close()
                raise RuntimeError(f"ip {' '.join(step)}: {r.stderr.strip()}")

    @staticmethod
    def exec_prefix(ns: str) -> tuple:
        return ("ip", "netns", "exec", ns)

    @staticmethod
    def dds_env(peer_ip: str) -> dict:
        return {"ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST", "ROS_STATIC_PEERS": peer_ip,
                "FASTDDS_BUILTIN_TRANSPORTS": "UDPv4"}

    def bytes_sent(self, ns: str) -> int:
        r = _ip("-n", ns, "-s", "-j", "link", "show", self.veth[ns])
        return json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"]

    def close(self):
        for ns in (self.engine, self.robot):
            _ip("netns", "del", ns)      # takes its end of the veth pair with it


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two-host test: needs root and iproute2 to create network namespaces")
    try:
        pair = TwoHosts()
    except RuntimeError as e:
        pytest.skip(f"two-host test: network namespaces are not permitted here ({e})")
    yield pair
    pair.close()


def test_engine_and_robot_on_two_hosts_over_dds(hosts, tmp_path):
    overrides = tmp_path / "fleet.yaml"
    overrides.write_text("""
oxygen_observation:
  ros__parameters:
    cameras:
      base_0_rgb: {topic: /robot/cam_base/image/compressed, compressed: true, required: true}
      left_wrist_0_rgb: {topic: /robot/cam_wrist/image/compressed, compressed: true}
    state_topic: /robot/joint_states
    state_type: joint_state
    max_stamp_future_s: 0.05
    max_stamp_age_s: 0.5
""")
    domain = private_domain(17)
    bringup = Bringup(["--robot", "demo", "--params-file", str(overrides), "--status-period", "2"], domain,
                      prefix=hosts.exec_prefix(hosts.engine), env=hosts.dds_env(ROBOT_IP))
    out = tmp_path / "robot.json"
    try:
        assert bringup.wait_for_line("oxygen_bringup: running", 120), bringup.output()
        sent_before = {ns: hosts.bytes_sent(ns) for ns in (hosts.engine, hosts.robot)}
        env = dict(os.environ, ROS_DOMAIN_ID=str(domain), PYTHONUNBUFFERED="1", **hosts.dds_env(ENGINE_IP))
        robot = subprocess.run([*hosts.exec_prefix(hosts.robot), sys.executable, str(REPO / "test" / "fleet_robot.py"),
                                "--json", str(out), "--min-window-s", "6", "--outage-veth", hosts.veth[hosts.robot],
                                "--outage-s", "2", "--skewed-s", "4", "--skew-s", "2"],
                               env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
        sent = {ns: hosts.bytes_sent(ns) - sent_before[ns] for ns in sent_before}
    finally:
        code = bringup.stop()
    print(bringup.output()[-4000:])
    assert robot.returncode == 0, robot.stdout + robot.stderr
    r = json.loads(out.read_text())
    print(json.dumps(r, indent=1)[:4000], f"\nbytes over the veth: {sent}")
    assert r["ok"], r
    assert code == 0, f"bringup exited with {code}"

    # Synced clocks: commands flow across the link without a stall, finite, from chunks of this robot's
    # observations. The rate itself (70 Hz to 0.3% on a quiet machine) is a benchmark figure, not a test: a
    # loaded 2-core machine slows the timer without anything being wrong. What the test holds is behaviour:
    # the stream is alive (at least a quarter of the nominal count) and never stops for half a second.
    assert r["rate_window_s"] >= 5.0 and r["rate_hz"] > RATE_HZ / 4 and r["max_gap_s"] < 0.5, r
    assert r["actions_finite"]
    assert r["chunks_total_synced"] >= 3 and r["chunks_stamped_by_us"] == r["chunks_total_synced"], \
        "every chunk carries the stamp of a state this robot sent"
    c = r["converse"]
    assert c["success"] and c["reply"] and c["tokens"] >= 1 and c["frame_stamped_by_us"], c
    synced = r["inputs"]["synced"]
    assert synced["message"] == "receiving" and synced["stamps_future"] == "0", synced
    # The traffic went over the pair (the only link between the namespaces): cameras (2 x 15 Hz JPEG) one
    # way, 70 Hz commands the other.
    assert sent[hosts.robot] > 1_000_000 and sent[hosts.engine] > 100_000, sent

    # The link down for 2 s, then up: nothing crosses while it is down; the engine's inputs went stale (its
    # actions stopped) and everything resumes by itself, with the same DDS participants, once it is up.
    outage = r["outage"]
    assert outage["actions_during"] <= 2, outage          # at most what was in flight when it went down
    assert outage["fresh_chunk_after_s"] is not None and outage["fresh_chunk_after_s"] < 5.0, outage
    assert outage["commands_after_s"] is not None, outage
    assert int(outage["inputs_after"]["stale_transitions"]) >= 1 and outage["inputs_after"]["message"] == "receiving"

    # Robot clock 2 s ahead: every stamp rejected and counted, inputs stale, actions stop within
    # stale_after_s (0.5 s) plus a few ticks, and stay stopped.
    late = r["skewed_actions_after_s"]
    assert not late or max(late) < 1.0, f"actions went on {max(late)} s after the stamps went wrong"
    skewed = r["inputs"]["skewed"]
    assert int(skewed["stamps_future"]) > 0 and "ahead of this host's clock" in skewed["last_error"], skewed
    assert skewed["message"].startswith("no complete observation"), skewed
