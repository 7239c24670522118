"""Reliability across processes: the stale-input watchdog, a burst of 1,000 service calls over DDS, and
the shutdown order on SIGTERM. oxygen_bringup runs with the demo parameters but without the simulated
robot: this test process is the robot (cameras + joint states) and the clients."""
import signal
import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.qos import QoSProfile, qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray

from oxygen_interfaces.srv import Converse
from ros_harness import Bringup, RosClient, private_domain, wait_until

JOINTS = ["joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6", "gripper"]


class FakeRobot:
    """Publishes base and wrist images (15 Hz) and joint states (50 Hz) while `on` is True."""

    def __init__(self, node):
        self.node, self.on = node, True
        rng = np.random.default_rng(0)
        self.frames = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8).tobytes() for _ in range(4)]
        self.cams = {name: node.create_publisher(Image, f"/sim/camera/{name}/image_raw", qos_profile_sensor_data)
                     for name in ("base", "wrist")}
        self.js = node.create_publisher(JointState, "/sim/joint_states", qos_profile_sensor_data)
        self.i = 0
        node.create_timer(1 / 15, self._images)
        node.create_timer(1 / 50, self._state)

    def _images(self):
        if not self.on:
            return
        self.i += 1
        for k, pub in enumerate(self.cams.values()):
            m = Image(encoding="rgb8", width=224, height=224, step=672, data=self.frames[(self.i + k) % 4])
            m.header.stamp = self.node.get_clock().now().to_msg()
            pub.publish(m)

    def _state(self):
        if self.on:
            m = JointState(name=JOINTS, position=[0.1 * np.sin(self.i * 0.1 + j) for j in range(7)])
            m.header.stamp = self.node.get_clock().now().to_msg()
            self.js.publish(m)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    overrides = tmp_path_factory.mktemp("params") / "test.yaml"
    overrides.write_text("oxygen_observation:\n  ros__parameters:\n    stale_after_s: 0.5\n"
                         "oxygen_engine:\n  ros__parameters:\n    max_queued_requests: 64\n"
                         "    max_queued_per_owner: 64\n")
    domain = private_domain(23)
    bringup = Bringup(["--robot", "demo", "--params-file", str(overrides), "--status-period", "2"], domain)
    client = RosClient(domain)
    try:
        assert bringup.wait_for_line("oxygen_bringup: running", 90), bringup.output()
        robot = FakeRobot(client.node)
        actions = client.collect(Float64MultiArray, "/oxygen/action")
        assert wait_until(lambda: len(actions) > 20, 60), "no actions:\n" + bringup.output()
        yield bringup, client, robot
    finally:
        client.close()
        if bringup.proc.poll() is None:
            bringup.stop()
        print(bringup.output())


@pytest.mark.timing
def test_stale_inputs_stop_actions_report_an_error_and_recover(system):
    bringup, client, robot = system
    msgs = client.collect(Float64MultiArray, "/oxygen/action")
    diags = client.collect(DiagnosticArray, "/diagnostics")
    time.sleep(1.0)
    robot.on = False
    t_off = time.monotonic()
    time.sleep(2.5)
    times = [t for t, _ in list(msgs)]
    last = max(times)
    print(f"last command {last - t_off:.3f} s after the inputs stopped")
    assert last - t_off < 0.5 + 0.3, "actions stop once inputs are stale (0.5 s)"
    inputs = [s for t, d in list(diags) if t > t_off + 1.0 for s in d.status if s.name == "oxygen_ros: inputs"]
    actions = [s for t, d in list(diags) if t > t_off + 1.0 for s in d.status if s.name == "oxygen_ros: actions"]
    assert inputs and inputs[-1].level == DiagnosticStatus.ERROR and "no complete observation" in inputs[-1].message
    assert actions and actions[-1].level == DiagnosticStatus.ERROR and "stale" in actions[-1].message
    robot.on = True
    t_on = time.monotonic()
    assert wait_until(lambda: any(t > t_on for t, _ in list(msgs)), 15), "publishing resumes by itself"


def test_a_burst_of_1000_service_calls_loses_nothing_and_keeps_the_commands_flowing(system):
    bringup, client, robot = system
    robot.on = True
    # A client that fires a burst needs a deep response queue too (the default keep-last-10 reader drops
    # responses that arrive faster than its executor takes them).
    cli = client.node.create_client(Converse, "/oxygen/converse", qos_profile=QoSProfile(depth=1000))
    assert cli.wait_for_service(20)
    msgs = client.collect(Float64MultiArray, "/oxygen/action")
    t0 = time.monotonic()
    futures = [cli.call_async(Converse.Request(text=f"question {i}", max_tokens=2, timeout_s=120.0))
               for i in range(1000)]
    assert wait_until(lambda: all(f.done() for f in futures), 180), \
        f"{sum(not f.done() for f in futures)} of 1000 calls never got a response"
    elapsed = time.monotonic() - t0
    replies = [f.result() for f in futures]
    answered = sum(r.success for r in replies)
    busy = sum(r.error.startswith("busy:") for r in replies)
    print(f"1000 calls in {elapsed:.1f} s: {answered} answered, {busy} refused as busy, "
          f"{1000 - answered - busy} other errors")
    assert answered + busy == 1000, {r.error for r in replies if not r.success and not r.error.startswith("busy")}
    assert answered >= 64
    # The command stream over the burst, whatever happened: no commands at all (actions stalled) is the failure
    # this check is for, not a reason to skip it. Liveness, not speed: the stream goes on without a stall of
    # half a second and at no less than a quarter of its rate (70 Hz to 0.3% on a quiet machine is a benchmark
    # figure; a loaded 2-core machine slows any timer without anything being wrong).
    start = t0 + min(1.0, elapsed / 2)          # past the first second of the flood, as measured before
    t = np.array([t for t, _ in list(msgs) if start < t < t0 + elapsed])
    window = t0 + elapsed - start
    assert len(t) >= 70.0 / 4 * window, f"{len(t)} commands in the {window:.1f} s of the burst measured"
    gaps = np.diff(np.concatenate([[start], t, [t0 + elapsed]]))
    print(f"action rate during the burst: {(len(t) - 1) / (t[-1] - t[0]):.1f} Hz, longest gap {gaps.max() * 1e3:.0f} ms")
    assert gaps.max() < 0.5, f"the commands stopped for {gaps.max():.2f} s during the burst"


def test_sigterm_stops_actions_first_then_exits_cleanly(system):
    bringup, client, robot = system
    msgs = client.collect(Float64MultiArray, "/oxygen/action")
    assert wait_until(lambda: len(msgs) > 10, 10)
    bringup.proc.send_signal(signal.SIGTERM)
    bringup.proc.wait(30)
    out = bringup.output()
    assert bringup.proc.returncode == 0, out
    disabled = out.index("action output disabled")
    assert disabled < out.index("oxygen_bringup: stopped")
