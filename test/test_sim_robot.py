"""The demo's simulated robot: the MuJoCo reach scene, its scripted expert, the scene questions' ground
truth, episodes in wall time, and SimRobotNode over rclpy.

The node tests run the node and a probe node in this process, on a private rclpy Context with a domain
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

from oxygen_ros.robot.errors import ActionError
from oxygen_ros.sim.episodes import ReachEpisodes, ResetSwitch
from oxygen_ros.sim.expert import expert_chunk, forward_kinematics, inverse_kinematics
from oxygen_ros.sim.questions import caption, scene_questions
from oxygen_ros.sim.scene import (CONTROL_PERIOD_S, JOINT_NAMES, MIN_CUBE_DISTANCE, Layout, ReachScene,
                                  touch_point)


@pytest.fixture(scope="module")
def scene():
    s = ReachScene(64)
    yield s
    s.close()


def run_expert(scene, layout, target, steps=210):
    scene.reset(layout)
    goal = inverse_kinematics(touch_point(layout.positions[target]))
    for k in range(steps):
        if k % 10 == 0:
            chunk = expert_chunk(scene.joints(), goal, 20)
        scene.step(chunk[k % 10])
        if scene.touching() == target:
            return k + 1
    return None


def test_the_expert_touches_the_named_cube_in_every_scene(scene):
    touched = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        layout = Layout.random(rng)
        target = int(rng.integers(len(layout.colours)))
        goal = inverse_kinematics(touch_point(layout.positions[target]))
        np.testing.assert_allclose(forward_kinematics(goal), touch_point(layout.positions[target]), atol=1e-9)
        touched.append(run_expert(scene, layout, target))
    assert all(t is not None for t in touched), touched
    assert max(touched) < 150      # within ~2 s at 70 Hz: an episode's 3 s leave room for the model


def test_the_tip_does_not_touch_a_cube_it_is_not_near(scene):
    layout = Layout(("red", "blue"), np.array([[0.25, 0.15, 0.02], [0.25, -0.15, 0.02]]), np.array([0, 0.2, 1.2]))
    assert run_expert(scene, layout, 1) is not None
    assert scene.touching() == 1 and scene.distance_to(0) > 0.2


def test_layouts_are_seeded_and_cubes_apart():
    for seed in range(50):
        a, b = Layout.random(np.random.default_rng(seed)), Layout.random(np.random.default_rng(seed))
        assert a.colours == b.colours and np.array_equal(a.positions, b.positions)
        assert len(set(a.colours)) == len(a.colours) and 2 <= len(a.colours) <= 3
        for i in range(len(a.colours)):
            for j in range(i):
                assert np.linalg.norm(a.positions[i, :2] - a.positions[j, :2]) >= MIN_CUBE_DISTANCE
    with pytest.raises(ValueError, match="no green cube"):
        Layout(("red", "blue"), np.zeros((2, 3)), np.zeros(3)).index("green")


def _colour_pixels(image, rgb):
    return int((np.abs(image.astype(int) - np.array(rgb)).max(axis=-1) < 60).sum())


def test_the_base_camera_shows_exactly_the_scene_cubes(scene):
    layout = Layout(("red", "blue"), np.array([[0.22, 0.12, 0.02], [0.28, -0.1, 0.02]]), np.array([0, 0.2, 1.2]))
    scene.reset(layout)
    image = scene.render("base")
    assert image.shape == (64, 64, 3) and image.dtype == np.uint8
    red, blue, yellow = (_colour_pixels(image, c) for c in ((230, 25, 25), (25, 64, 242), (242, 217, 25)))
    assert red >= 3 and blue >= 3 and yellow == 0     # the unused cube slot is out of sight
    # Left in the image is the arm's left (+y): the red cube (y = +0.12) is in the left half.
    cols = np.nonzero((np.abs(image.astype(int) - (230, 25, 25)).max(axis=-1) < 60))[1]
    assert cols.mean() < 32
    assert scene.render("wrist").shape == (64, 64, 3)


def test_scene_questions_have_the_true_answers():
    layout = Layout(("green", "red", "yellow"),
                    np.array([[0.2, 0.15, 0.02], [0.3, -0.05, 0.02], [0.25, -0.2, 0.02]]), np.zeros(3))
    tip = np.array([0.29, -0.04, 0.1])
    answers = {}
    for seed in range(30):
        for q in scene_questions(layout, tip, np.random.default_rng(seed)):
            answers[q.text] = q.answer
            assert 0 < q.chance <= 0.5
    assert answers["How many cubes are there?"] == "three"
    assert answers["What colour is the leftmost cube?"] == "green"
    assert answers["What colour is the rightmost cube?"] == "yellow"
    assert answers["Which cube is nearest the gripper?"] == "red"
    assert answers["Is the green cube left or right of the red cube?"] == "left"
    assert answers["Is the yellow cube left or right of the red cube?"] == "right"
    assert answers["Is there a blue cube?"] == "no" and answers["Is there a red cube?"] == "yes"
    assert answers["Describe the scene."] == caption(layout) == "a green cube, a red cube and a yellow cube"


def test_episodes_count_successes_and_timeouts_in_wall_time():
    world = ReachEpisodes(seed=3, episode_s=2.0, pause_s=0.5)
    clock = 100.0
    assert world.advance(clock), "the first task is announced at once"
    assert world.tally.episodes == 0 and "episodes 0/0" in world.status() and "getting ready" in world.status()
    # Episode k is the in-process evaluation's episode k of the same seed.
    rng = np.random.default_rng([3, 0])
    layout = Layout.random(rng)
    assert world.layout.colours == layout.colours and world.target == int(rng.integers(len(layout.colours)))
    np.testing.assert_array_equal(world.layout.positions, layout.positions)
    # Ready phase: commands (computed for another task or pose) are ignored and the arm holds its start.
    world.set_command(world.layout.start + 0.5)
    announced = [world.advance(clock + t) for t in (0.1, 0.2, 0.3, 0.4, 0.5 + CONTROL_PERIOD_S)]
    assert announced == [False] * 4 + [True], "the running phase announces the task again"
    np.testing.assert_allclose(world.joints(), world.layout.start, atol=1e-9)
    assert world.command is None and world.running
    clock += 0.5 + CONTROL_PERIOD_S
    # Expert chunks played at the control rate: touched, counted, and at once the next task gets ready.
    first_prompt = world.prompt
    goal = inverse_kinematics(touch_point(world.layout.positions[world.target]))
    announced = False
    for k in range(400):
        if k % 10 == 0:
            chunk = expert_chunk(world.joints(), goal, 20)
        world.set_command(chunk[k % 10])
        clock += CONTROL_PERIOD_S
        announced = world.advance(clock)
        if announced:
            break
    assert announced and world.tally.episodes == 1 and world.tally.successes == 1
    outcome = world.outcomes[0]
    assert outcome.success and outcome.index == 0 and outcome.prompt == first_prompt and outcome.distance_cm <= 4.0
    assert world.last_outcome == f"episode 0: '{first_prompt}': touched in {outcome.seconds:.2f} s"
    assert not world.running and world.command is None and world.episode_index == 1
    # No command: after the ready phase the arm holds its start pose and the episode times out after episode_s.
    for _ in range(26):
        clock += 0.1
        world.advance(clock)
    assert world.tally.episodes == 2 and world.tally.successes == 1 and "timed out" in world.last_outcome
    assert not world.outcomes[1].success and 2.0 <= world.outcomes[1].seconds <= 2.0 + CONTROL_PERIOD_S + 1e-3
    world.close()


def test_multistep_episodes_are_judged_step_by_step_in_wall_time():
    """The demo's multi-step episodes: the evaluation's episode k of the seed, a step done when its cube is
    touched (the cube darkens), the truth of subtask and memory following, success only after the last step."""
    from oxygen_ros.sim.tasks import draw_multistep_episode

    world = ReachEpisodes(seed=4, episode_s=3.0, pause_s=0.2, multistep=True)
    drawn = draw_multistep_episode(4, 0)
    assert world.prompt == drawn.task.text and world.layout.colours == drawn.layout.colours
    clock = 10.0
    world.advance(clock)
    clock += 0.2 + CONTROL_PERIOD_S
    world.advance(clock)
    assert world.running and world.memory == "" and world.subtask == f"touch the {world.layout.colours[world.target]} cube"
    assert f"step 1/{drawn.task.steps}" in world.status()
    seen, target = [(world.subtask, world.memory)], None
    for k in range(210 * drawn.task.steps):
        if world.target != target or k % 10 == 0:
            target = world.target
            chunk = expert_chunk(world.joints(), inverse_kinematics(touch_point(world.layout.positions[target])), 20)
            row = 0
        world.set_command(chunk[row])
        row = min(row + 1, 19)
        clock += CONTROL_PERIOD_S
        if world.advance(clock):
            break
        if (world.subtask, world.memory) != seen[-1]:
            seen.append((world.subtask, world.memory))
    colours = [drawn.layout.colours[i] for i in drawn.task.order]
    assert [s for s, _ in seen] == [f"touch the {c} cube" for c in colours[:len(seen)]]
    assert len(seen) == drawn.task.steps and seen[1][1] == f"{colours[0]} touched; next: {colours[1]}"
    outcome = world.outcomes[0]
    assert outcome.success and outcome.steps_done == outcome.steps == drawn.task.steps
    assert world.last_outcome.endswith(f"({drawn.task.steps}/{drawn.task.steps} steps)")
    world.close()


def test_a_stall_does_not_make_the_simulation_race():
    world = ReachEpisodes(seed=0)
    world.advance(0.0)
    t0 = world.scene.time
    world.advance(60.0)          # a minute without callbacks: at most MAX_CATCH_UP_STEPS simulated
    assert world.scene.time - t0 <= 35 * CONTROL_PERIOD_S + 1e-9
    world.close()


def test_bad_commands_are_refused_and_change_nothing():
    world = ReachEpisodes(seed=0)
    world.set_command([0.1, 0.2, 0.3])
    for bad, message in (([0.0] * 7, "3 joints"), ([0.0, float("nan"), 0.0], "non-finite"),
                         (["a", "b", "c"], "not numbers")):
        with pytest.raises(ActionError, match=message):
            world.set_command(bad)
    with pytest.raises(ActionError, match="lacks joints"):
        world.set_command_by_name(["joint_1"], [0.0])
    with pytest.raises(ActionError, match="2 names but 1"):
        world.set_command_by_name(["joint_1", "joint_2"], [0.0])
    np.testing.assert_array_equal(world.command, [0.1, 0.2, 0.3])
    world.set_command_by_name(["joint_3", "joint_1", "joint_2", "gripper"], [3.0, 1.0, 2.0, 9.0])
    np.testing.assert_array_equal(world.command, [1.0, 2.0, 3.0])
    world.close()


def test_the_reset_switches_off_only_an_output_that_is_on_and_back_on_only_what_it_switched_off():
    switch = ResetSwitch(on_within_s=0.25)
    assert switch.on_phase_change(False, 10.0, 9.99) is False      # commands coming: off for the reset
    assert switch.on_phase_change(True, 10.7, 9.99) is True        # the episode starts: on again
    assert switch.on_phase_change(False, 20.0, 19.0) is None       # no command for 1 s: someone switched it off
    assert switch.on_phase_change(True, 20.7, 19.0) is None        # ...and it stays off
    assert switch.on_phase_change(False, 1.0, None) is None        # the first reset, before any command
    assert switch.on_phase_change(True, 1.7, None) is None
    assert switch.on_phase_change(False, 30.0, 29.99, reachable=False) is False   # wanted, could not be made...
    assert switch.on_phase_change(True, 30.7, 29.99) is None       # ...so nothing to switch back on


# ------------------------------------------------------------------------------------------------ node

class _Probe:
    """Collects the node's output in the executor thread; waits in the test thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.images: dict[str, list] = {"base": [], "wrist": []}
        self.states: list = []
        self.prompts: list = []

    def on_image(self, camera):
        def callback(msg):
            with self.lock:
                self.images[camera].append(msg)
        return callback

    def on_state(self, msg):
        with self.lock:
            self.states.append(msg)

    def on_prompt(self, msg):
        with self.lock:
            self.prompts.append(msg.data)

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
    from ros_harness import private_domain

    rclpy.init(context=context, domain_id=private_domain(1))
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


def test_node_publishes_tasks_images_states_and_follows_commands(ros_context):
    from rclpy.parameter import Parameter
    from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import Float64MultiArray, String

    from oxygen_ros.nodes.sim_robot import SimRobotNode
    from oxygen_ros.robot.images import image_from_msg

    context, executor, nodes, thread = ros_context
    # A long episode: the first one must still be running when its start pose is checked.
    node = SimRobotNode(context=context, parameter_overrides=[Parameter("camera_rate_hz", value=20.0),
                                                              Parameter("episode_s", value=120.0)])
    probe_node = __import__("rclpy").create_node("sim_robot_test_probe", context=context)
    nodes += [node, probe_node]
    probe = _Probe()
    for camera in ("base", "wrist"):
        probe_node.create_subscription(Image, f"/sim/camera/{camera}/image_raw", probe.on_image(camera),
                                       qos_profile_sensor_data)
    probe_node.create_subscription(JointState, "/sim/joint_states", probe.on_state, qos_profile_sensor_data)
    probe_node.create_subscription(String, "/oxygen/prompt", probe.on_prompt, 10)
    commands = probe_node.create_publisher(Float64MultiArray, "/oxygen/action",
                                           QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    executor.add_node(node)
    executor.add_node(probe_node)
    thread.start()

    probe.wait(lambda: min(len(v) for v in probe.images.values()) >= 3 and len(probe.states) >= 5
               and probe.prompts, 10.0, "3 images per camera, 5 joint states and a task")
    with probe.lock:
        msg, state, prompt = probe.images["base"][-1], probe.states[-1], probe.prompts[-1]
    assert (msg.encoding, msg.height, msg.width, msg.step) == ("rgb8", 64, 64, 3 * 64)
    assert msg.header.frame_id == "base" and msg.header.stamp.sec > 0
    assert image_from_msg(msg).shape == (64, 64, 3)
    assert list(state.name) == list(JOINT_NAMES) and state.header.stamp.sec > 0
    world = node.world
    assert prompt == world.prompt and prompt.startswith("touch the ")
    np.testing.assert_allclose(state.position, world.layout.start, atol=1e-6)  # holds until commanded
    assert node.command_count == 0 and node.last_command_time is None

    probe.wait(lambda: commands.get_subscription_count() > 0, 5.0, "the command subscription to match")
    for bad in ([0.0] * 7, [float("nan")] * 3):
        commands.publish(Float64MultiArray(data=bad))
    probe.wait(lambda: node.rejected_count >= 2 or node.command_count > 0, 5.0, "two rejected commands")
    assert node.command_count == 0

    # A command once the episode runs (the ready phase ignores them): the joint states go there.
    probe.wait(lambda: world.running and len(probe.prompts) >= 2, 5.0, "the episode to run, announced again")
    target = world.layout.start + np.array([0.3, -0.2, 0.25])
    commands.publish(Float64MultiArray(data=target.tolist()))
    probe.wait(lambda: node.command_count >= 1, 5.0, "the command to arrive")
    probe.wait(lambda: np.allclose(probe.states[-1].position, target, atol=0.02), 5.0,
               "the joint states to reach the target")
    assert "episodes" in node.status()


def test_node_joint_state_commands_and_bad_parameters(ros_context):
    import rclpy
    from rclpy.parameter import Parameter
    from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from sensor_msgs.msg import JointState

    from oxygen_ros.nodes.sim_robot import SimRobotNode

    context, executor, nodes, thread = ros_context
    for bad, message in ((Parameter("command_type", value="twist"), "command_type"),
                         (Parameter("cameras", value=["base", "head"]), "cameras"),
                         (Parameter("state_rate_hz", value=0.0), "state_rate_hz"),
                         (Parameter("episode_s", value=-1.0), "episode_s")):
        with pytest.raises(ValueError, match=message):
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
    probe.wait(lambda: len(probe.states) >= 2 and node.world.running, 10.0, "joint states, the episode running")
    expected = [0.2, 0.4, 1.0]
    deadline = time.monotonic() + 5.0  # a reliable publisher may still be matching: resend until taken
    while node.command_count == 0 and time.monotonic() < deadline:
        commands.publish(JointState(name=["joint_3", "joint_1", "joint_2"], position=[1.0, 0.2, 0.4]))
        time.sleep(0.05)
    probe.wait(lambda: np.allclose(probe.states[-1].position, expected, atol=0.02), 5.0, "the named targets")
    commands.publish(JointState(name=["joint_1"], position=[1.0, 2.0]))  # length mismatch: ignored
    probe.wait(lambda: node.rejected_count >= 1, 5.0, "the rejected command")
    np.testing.assert_allclose(node.world.command, expected)


def test_node_switches_the_action_output_off_for_each_reset(ros_context):
    """The episode times out while commands come: the node asks /oxygen/enable for off, then, when the next
    episode runs, for on; commands that stop before a reset (an output switched off by someone else) leave
    the switch alone."""
    import rclpy
    from rclpy.parameter import Parameter
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from std_msgs.msg import Float64MultiArray
    from std_srvs.srv import SetBool

    from oxygen_ros.nodes.sim_robot import SimRobotNode

    context, executor, nodes, thread = ros_context
    node = SimRobotNode(context=context, parameter_overrides=[Parameter("episode_s", value=0.6),
                                                              Parameter("camera_rate_hz", value=5.0)])
    probe_node = rclpy.create_node("sim_robot_test_probe_enable", context=context)
    nodes += [node, probe_node]
    probe = _Probe()
    requests = []

    def on_enable(request, response):
        with probe.lock:
            requests.append((request.data, node.world.running))
        response.success = True
        return response
    probe_node.create_service(SetBool, "/oxygen/enable", on_enable)
    commands = probe_node.create_publisher(Float64MultiArray, "/oxygen/action",
                                           QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    executor.add_node(node)
    executor.add_node(probe_node)
    thread.start()
    probe.wait(lambda: node.world.running, 10.0, "the first episode to run")
    assert requests == [], "the first reset came before any command: nothing to switch"
    while node.world.tally.episodes < 1:            # the output is on: a command every control period
        commands.publish(Float64MultiArray(data=node.world.layout.start.tolist()))
        time.sleep(CONTROL_PERIOD_S)
    probe.wait(lambda: requests[:1] == [(False, False)], 5.0, "off while the scene is reset")
    probe.wait(lambda: requests[1:] == [(True, True)], 5.0, "on when the next episode runs")
    probe.wait(lambda: node.world.tally.episodes >= 2, 5.0, "the next episode to time out, without commands")
    time.sleep(0.3)
    with probe.lock:
        assert len(requests) == 2, "no commands before that reset: the switch was left alone"
