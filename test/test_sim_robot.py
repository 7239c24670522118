"""The demo's simulated robot: SimArm (motion, limits, rendering) and SimRobotNode over rclpy.

The node test runs the node and a probe node in this process, on a private rclpy Context with a domain
id derived from the pid (parallel test runs do not see each other), spun by a SingleThreadedExecutor in a
daemon thread. Every wait has a deadline; faulthandler ends the process if the test still hangs.
"""
from __future__ import annotations

import faulthandler
import os
import threading
import time

import numpy as np
import pytest

from oxygen_ros.robot.errors import ActionError, ConfigError
from oxygen_ros.robot.sim_arm import HOME, JOINT_NAMES, LOWER_LIMITS, UPPER_LIMITS, SimArm

TARGET = HOME + np.array([0.4, -0.3, 0.25, 0.5, -0.35, 0.6, -0.7])  # reachable, clear of the table


# ---------------------------------------------------------------------------------------------- SimArm

def test_joint_names_and_home():
    arm = SimArm()
    assert arm.joint_names == ("joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6", "gripper")
    assert JOINT_NAMES == arm.joint_names
    np.testing.assert_allclose(arm.positions, HOME)
    np.testing.assert_allclose(arm.target, HOME)
    assert [o.name for o in arm.objects] == ["red cup", "blue block", "green bowl"]
    assert arm.ee_position()[2] > 0.1  # the tool starts above the table


def test_moves_towards_target_at_bounded_speed():
    arm = SimArm(max_speed=2.0)
    dt = 0.02
    prev = arm.positions
    for _ in range(5):
        arm.apply(TARGET, dt)
        q = arm.positions
        step = np.abs(q - prev)
        assert np.all(step <= 2.0 * dt + 1e-12)
        # every joint that is not there yet moved by exactly the max step, towards the target
        moving = np.abs(TARGET - prev) > 2.0 * dt
        np.testing.assert_allclose(step[moving], 2.0 * dt)
        assert np.all(np.abs(TARGET - q) <= np.abs(TARGET - prev) + 1e-12)
        prev = q
    np.testing.assert_allclose(arm.velocities[moving], 2.0 * np.sign(TARGET - HOME)[moving])
    for _ in range(100):  # 2 s: far more than the 0.35 s the largest move needs
        arm.step(dt)
    np.testing.assert_allclose(arm.positions, TARGET, atol=1e-12)
    np.testing.assert_allclose(arm.velocities, 0.0)


def test_per_joint_speed_limits():
    speed = np.array([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 0.25])
    arm = SimArm(max_speed=speed)
    arm.apply(HOME + np.where(np.arange(7) < 6, 1.0, -1.0), 0.1)
    np.testing.assert_allclose(np.abs(arm.positions - HOME), speed * 0.1)
    with pytest.raises(ConfigError):
        SimArm(max_speed=0.0)


def test_targets_are_clamped_to_limits():
    arm = SimArm()
    clamped = arm.set_target([10.0, -10.0, 10.0, -10.0, 10.0, -10.0, 5.0])
    expected = np.where(np.arange(7) % 2 == 0, UPPER_LIMITS, LOWER_LIMITS)
    expected[6] = 1.0
    np.testing.assert_array_equal(clamped, expected)
    arm.set_target([0.0, -1.0, 0.0, 0.0, 0.0, 0.0, -3.0])  # straight up, gripper below 0
    for _ in range(500):
        arm.step(0.02)
        assert np.all(arm.positions >= LOWER_LIMITS) and np.all(arm.positions <= UPPER_LIMITS)
    assert arm.positions[6] == 0.0


def test_holds_without_commands():
    arm = SimArm()
    for _ in range(50):
        arm.step(0.02)
    np.testing.assert_array_equal(arm.positions, HOME)  # no command yet: hold the start pose
    arm.set_target(TARGET)
    for _ in range(100):
        arm.step(0.02)
    for _ in range(100):  # no more commands: hold the last target
        arm.step(0.02)
        np.testing.assert_allclose(arm.positions, TARGET, atol=1e-12)
    before = arm.positions
    for dt in (0.0, -1.0, float("nan")):  # not a time step: nothing moves
        arm.step(dt)
    np.testing.assert_array_equal(arm.positions, before)


@pytest.mark.parametrize("bad", [[0.0] * 6, [0.0] * 8, [0.0] * 6 + [float("nan")], [float("inf")] + [0.0] * 6,
                                 "abcdefg", [[0.0] * 7]])
def test_bad_commands_are_rejected_and_change_nothing(bad):
    arm = SimArm()
    arm.set_target(TARGET)
    with pytest.raises(ActionError):
        arm.set_target(bad)
    np.testing.assert_array_equal(arm.target, TARGET)


def test_targets_by_name():
    arm = SimArm()
    arm.set_target_by_name(["gripper", "camera_pan", "joint_2"], [0.25, 9.0, 0.1])
    expected = HOME.copy()
    expected[[6, 1]] = [0.25, 0.1]
    np.testing.assert_allclose(arm.target, expected)
    for names, pos in ((["joint_1"], [1.0, 2.0]), (["head"], [1.0]), (["joint_1", "joint_1"], [0.0, 1.0]),
                       (["joint_3"], [float("nan")])):
        with pytest.raises(ActionError):
            arm.set_target_by_name(names, pos)
    np.testing.assert_allclose(arm.target, expected)


def test_arm_stops_on_the_table():
    arm = SimArm()
    arm.set_target([0.2, 1.5, 1.2, 0.0, 0.5, 0.0, 0.0])  # a pose through the table top
    for _ in range(200):
        arm.step(0.02)
        assert arm.forward_kinematics()[0][2:, 2].min() >= -1e-9
    assert arm.positions[6] == 0.0  # the gripper is not held back
    arm.set_target(HOME)  # and the arm can leave the table again
    for _ in range(200):
        arm.step(0.02)
    np.testing.assert_allclose(arm.positions, HOME, atol=1e-9)
    free = SimArm(table_collision=False)
    free.apply([0.2, 1.5, 1.2, 0.0, 0.5, 0.0, 0.0], 5.0)
    assert free.forward_kinematics()[0][2:, 2].min() < 0.0


@pytest.mark.parametrize("camera", ["base", "wrist"])
def test_render_shape_and_change_with_joints(camera):
    arm = SimArm()
    img = arm.render(camera)
    assert img.shape == (224, 224, 3) and img.dtype == np.uint8
    assert arm.render(camera, size=96).shape == (96, 96, 3)
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 10  # not a blank frame
    changes = []
    for j in range(7):  # every joint (the gripper included) changes the picture
        moved = SimArm()
        q = HOME.copy()
        q[j] += 0.3 if j < 6 else -0.5
        moved.reset(q)
        changes.append(int((np.abs(moved.render(camera).astype(int) - img).sum(axis=2) > 30).sum()))
    assert all(c > 0 for c in changes), changes
    assert sum(changes) > 1000, changes


def test_render_is_deterministic():
    a, b = SimArm(seed=7), SimArm(seed=7)
    for arm in (a, b):
        arm.apply(TARGET, 0.1)
    for camera in ("base", "wrist"):
        np.testing.assert_array_equal(a.render(camera), b.render(camera))
        np.testing.assert_array_equal(a.render(camera), a.render(camera))  # the cached background is intact
    other = SimArm(seed=8)
    other.apply(TARGET, 0.1)
    assert [o.position for o in other.objects] != [o.position for o in a.objects]
    assert not np.array_equal(other.render("base"), a.render("base"))
    with pytest.raises(ConfigError):
        a.render("left_wrist")


def test_render_time():
    arm = SimArm()
    rng = np.random.default_rng(0)
    for camera in ("base", "wrist"):
        arm.render(camera)  # the base background is drawn once per size
        times = []
        for _ in range(30):
            arm.reset(rng.uniform(LOWER_LIMITS, UPPER_LIMITS))
            t0 = time.perf_counter()
            arm.render(camera)
            times.append(time.perf_counter() - t0)
        median_ms = 1e3 * float(np.median(times))
        print(f"render {camera} 224x224: median {median_ms:.2f} ms, max {1e3 * max(times):.2f} ms")
        assert median_ms < 20.0


# ------------------------------------------------------------------------------------------------ node

class _Probe:
    """Collects the node's output in the executor thread; waits in the test thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.images: dict[str, list] = {"base": [], "wrist": []}
        self.states: list = []

    def on_image(self, camera):
        def callback(msg):
            with self.lock:
                self.images[camera].append(msg)
        return callback

    def on_state(self, msg):
        with self.lock:
            self.states.append(msg)

    def wait(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if predicate():
                    return
            time.sleep(0.01)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture
def ros_context():
    rclpy = pytest.importorskip("rclpy")
    from rclpy.executors import SingleThreadedExecutor

    faulthandler.dump_traceback_later(120, exit=True)  # last resort: never hang the test run
    context = rclpy.Context()
    rclpy.init(context=context, domain_id=100 + os.getpid() % 100)
    executor = SingleThreadedExecutor(context=context)
    thread = threading.Thread(target=executor.spin, daemon=True, name="sim-robot-test-executor")
    nodes = []
    try:
        yield context, executor, nodes, thread
    finally:
        executor.shutdown(timeout_sec=2.0)
        for node in nodes:
            node.destroy_node()
        rclpy.try_shutdown(context=context)
        thread.join(timeout=5.0)
        faulthandler.cancel_dump_traceback_later()
        assert not thread.is_alive()


def test_node_publishes_and_follows_commands(ros_context):
    from rclpy.parameter import Parameter
    from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import Float64MultiArray

    from oxygen_ros.nodes.sim_robot import SimRobotNode
    from oxygen_ros.robot.images import image_from_msg

    context, executor, nodes, thread = ros_context
    node = SimRobotNode(context=context, parameter_overrides=[Parameter("camera_rate_hz", value=20.0)])
    probe_node = __import__("rclpy").create_node("sim_robot_test_probe", context=context)
    nodes += [node, probe_node]
    probe = _Probe()
    for camera in ("base", "wrist"):
        probe_node.create_subscription(Image, f"/sim/camera/{camera}/image_raw", probe.on_image(camera),
                                       qos_profile_sensor_data)
    probe_node.create_subscription(JointState, "/sim/joint_states", probe.on_state, qos_profile_sensor_data)
    commands = probe_node.create_publisher(Float64MultiArray, "/oxygen/action",
                                           QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    executor.add_node(node)
    executor.add_node(probe_node)
    thread.start()

    probe.wait(lambda: min(len(v) for v in probe.images.values()) >= 3 and len(probe.states) >= 5, 10.0,
               "3 images per camera and 5 joint states")
    with probe.lock:
        images = {c: list(v) for c, v in probe.images.items()}
        state = probe.states[-1]
    reference = SimArm()  # the node's arm holds its start pose until a command arrives
    for camera, msgs in images.items():
        msg = msgs[0]
        assert (msg.encoding, msg.height, msg.width, msg.step) == ("rgb8", 224, 224, 3 * 224)
        assert msg.header.frame_id == camera and len(msg.data) == 224 * 224 * 3
        assert msg.header.stamp.sec > 0
        np.testing.assert_array_equal(image_from_msg(msg), reference.render(camera))
    assert list(state.name) == list(JOINT_NAMES) and state.header.stamp.sec > 0
    np.testing.assert_allclose(state.position, HOME)
    assert node.command_count == 0 and node.last_command_time is None

    probe.wait(lambda: commands.get_subscription_count() > 0, 5.0, "the command subscription to match")
    # Bad commands are ignored (with a warning), the node keeps going.
    for bad in ([0.0] * 3, [float("nan")] * 7):
        commands.publish(Float64MultiArray(data=bad))
    probe.wait(lambda: node.rejected_count >= 2 or node.command_count > 0, 5.0, "two rejected commands")
    assert node.command_count == 0

    # A command: the joint states move towards it, at most 2 rad/s, and get there.
    start = time.monotonic()
    commands.publish(Float64MultiArray(data=TARGET.tolist()))
    probe.wait(lambda: node.command_count >= 1, 5.0, "the command to arrive")
    assert node.last_command_time is not None
    probe.wait(lambda: np.allclose(probe.states[-1].position, TARGET, atol=1e-9), 5.0,
               "the joint states to reach the target")
    elapsed = time.monotonic() - start
    assert elapsed >= 0.7 / 2.0 * 0.9  # the longest move, 0.7, takes 0.35 s at 2 per second
    with probe.lock:
        positions = np.array([s.position for s in probe.states])
    progress = np.abs(positions - TARGET).max(axis=1)
    assert np.all(np.diff(progress) <= 1e-9)  # monotonically closer
    assert np.any((progress > 0.05) & (progress < 0.6))  # seen on the way, not only before and after
    with probe.lock:
        n_images = len(probe.images["wrist"])
    probe.wait(lambda: len(probe.images["wrist"]) > n_images, 2.0, "a new image")
    with probe.lock:
        latest = probe.images["base"][-1]
    assert not np.array_equal(image_from_msg(latest), reference.render("base"))


def test_node_joint_state_commands_and_bad_parameters(ros_context):
    import rclpy
    from rclpy.parameter import Parameter
    from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from sensor_msgs.msg import JointState

    from oxygen_ros.nodes.sim_robot import SimRobotNode

    context, executor, nodes, thread = ros_context
    for bad in (Parameter("command_type", value="twist"), Parameter("cameras", value=["base", "head"]),
                Parameter("state_rate_hz", value=0.0), Parameter("max_joint_speed", value=-1.0)):
        with pytest.raises(ValueError):
            SimRobotNode(context=context, parameter_overrides=[bad])
    node = SimRobotNode(context=context, parameter_overrides=[
        Parameter("command_type", value="joint_state"), Parameter("cameras", value=["wrist"]),
        Parameter("command_topic", value="/sim/joint_commands")])
    probe_node = rclpy.create_node("sim_robot_test_probe_js", context=context)
    nodes += [node, probe_node]
    probe = _Probe()
    probe_node.create_subscription(JointState, "/sim/joint_states", probe.on_state, qos_profile_sensor_data)
    commands = probe_node.create_publisher(JointState, "/sim/joint_commands",
                                           QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    executor.add_node(node)
    executor.add_node(probe_node)
    thread.start()
    probe.wait(lambda: len(probe.states) >= 2, 10.0, "joint states")
    deadline = time.monotonic() + 5.0  # a reliable publisher may still be matching: resend until taken
    while node.command_count == 0 and time.monotonic() < deadline:
        commands.publish(JointState(name=["gripper", "joint_1", "elbow_camera"], position=[0.2, -0.3, 5.0]))
        time.sleep(0.05)
    expected = HOME.copy()
    expected[[6, 0]] = [0.2, -0.3]
    probe.wait(lambda: np.allclose(probe.states[-1].position, expected, atol=1e-9), 5.0, "the named targets")
    commands.publish(JointState(name=["joint_1"], position=[1.0, 2.0]))  # length mismatch: ignored
    probe.wait(lambda: node.rejected_count >= 1, 5.0, "the rejected command")
    np.testing.assert_allclose(node.arm.target, expected)
