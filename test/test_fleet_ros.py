"""One engine, many robots, on the ROS side (issue #17): the fleet declared in oxygen_engine's parameters
(oxygen_ros/nodes/fleet.py), checked with every problem listed; then two robots on one engine in one
process over DDS (a DROID-like arm with 8 action dims and norm stats of its own, an ALOHA-like one with
14), each on its own /<namespace>/oxygen/... interface, while this test process plays both robots' drivers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from oxygen_ros.nodes.fleet import ParamsFiles, flatten, read_fleet
from ros_harness import private_domain  # a domain of this test process: no other bringup on it


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------ the fleet's parameters
def test_flatten_names_nested_parameters_as_ros_does():
    assert flatten({"cameras": {"base": {"topic": "a", "required": True}}, "prompt": "p", "l": [1, 2]}) == {
        "cameras.base.topic": "a", "cameras.base.required": True, "prompt": "p", "l": [1, 2]}


def test_a_robot_takes_its_config_then_the_params_files_section(tmp_path):
    files = ParamsFiles([write(tmp_path / "fleet.yaml", """
/**:
  ros__parameters: {action_rate_hz: 70.0}
oxygen_engine:
  ros__parameters:
    robots: [arm_a, arm_b]
    arm_a: {robot_config: droid}
    arm_b: {robot_config: aloha, namespace: cell/arm_b}
/arm_a/oxygen_action:
  ros__parameters: {replan_steps: 3}
""")])
    robots, problems = read_fleet(["arm_a", "arm_b"], {"arm_a": {"robot_config": "droid"},
                                                       "arm_b": {"robot_config": "aloha", "namespace": "cell/arm_b"}},
                                  files)
    assert problems == []
    a, b = robots
    assert (a.name, a.namespace, a.config_file.name) == ("arm_a", "/arm_a", "droid.yaml")
    assert (b.namespace, b.io.transform, b.io.robot_action_dim) == ("/cell/arm_b", "aloha", 14)
    assert a.io.robot_action_dim == 8 and a.io.control_period_s == pytest.approx(1 / 15)
    action = a.parameters("oxygen_action", files)
    assert action["replan_steps"] == 3                      # the fleet file's section wins...
    assert action["on_stale"] == "stop" and action["output_type"] == "float64_array"   # ...over droid.yaml
    assert action["action_rate_hz"] == 70.0
    assert b.parameters("oxygen_action", files)["replan_steps"] == 25                  # aloha.yaml's own
    observation = b.parameters("oxygen_observation", files)
    assert observation["cameras.base_0_rgb.required"] is True and len(observation["joint_names"]) == 14
    # The model is the fleet engine's: droid.yaml's checkpoint, horizon... are named as not used.
    assert {"checkpoint", "action_horizon", "model", "norm_stats"} <= set(a.ignored)
    assert "robot_action_dim" not in a.ignored


def test_every_problem_of_a_fleet_is_listed(tmp_path):
    files = ParamsFiles([write(tmp_path / "fleet.yaml", """
oxygen_engine:
  ros__parameters:
    transform: aloha
    norm_stats: /somewhere
    arm_c: {robot_config: droid}
    arm_a: {robot_confg: droid}
    robots.arm_b.namespace: /b
oxygen_observation:
  ros__parameters: {prompt: x}
/arm_z/oxygen_action:
  ros__parameters: {replan_steps: 3}
""")])
    values = {"arm_a": {"robot_config": "droid", "namespace": "/shared"},
              "arm_b": {"robot_config": "aloha", "namespace": "shared"},
              "arm_d": {"robot_config": "no_such_robot"},
              "arm_e": {"robot_config": ""},
              "arm_f": {"robot_config": "droid", "norm_stats": str(tmp_path / "missing.json")},
              "arm_g": {"robot_config": "droid", "namespace": "/"},
              "arm_h": {"robot_config": 5}}
    names = list(values) + ["arm_a", "bad-name"]
    robots, problems = read_fleet(names, values, files)
    expected = [
        "arm_a and arm_b have the same namespace /shared: each robot needs its own",
        "arm_d.robot_config: no robot config no_such_robot.yaml in",
        "arm_e.robot_config is empty: name a robot config",
        f"arm_f.norm_stats not found: {tmp_path / 'missing.json'}",
        "arm_g.namespace is '/': every robot of a fleet has a namespace of its own",
        "arm_h.robot_config = 5: must be a string",
        "robots lists arm_a twice",
        "robots: 'bad-name' is not a robot name",
        "arm_c.robot_config is set but arm_c is not in robots",
        "robots.arm_b.namespace: a robot's settings go under its name (arm_a: {namespace: ...}), not under robots",
        "arm_a.robot_confg: 'robot_confg' is not a robot setting (one of namespace, robot_config, norm_stats, asset_id)",
        "oxygen_engine.transform is a robot's setting",
        "oxygen_engine.norm_stats is a robot's setting",
        "section oxygen_observation configures no robot of the fleet: name it /<namespace>/oxygen_observation",
        "section /arm_z/oxygen_action: no robot has the namespace /arm_z",
    ]
    for line in expected:
        assert sum(line in p for p in problems) == 1, (line, problems)
    assert len(problems) == len(expected), problems
    assert [r.name for r in robots] == ["arm_a", "arm_b", "arm_f", "arm_g"]   # the others could not be read


def test_output_names_resolve_as_ros_resolves_them():
    from oxygen_ros.nodes.fleet import resolve_name

    assert resolve_name("oxygen/action", "/arm_a", "oxygen_action") == "/arm_a/oxygen/action"
    assert resolve_name("/cmd", "/arm_a", "oxygen_action") == "/cmd"
    assert resolve_name("~/action", "/cell/arm_a", "oxygen_action") == "/cell/arm_a/oxygen_action/action"
    assert resolve_name("oxygen/action", "/", "oxygen_action") == "/oxygen/action"


# ------------------------------------------------------------------------------ refused before anything moves
def bringup(*args, timeout=180):
    env = dict(os.environ, ROS_DOMAIN_ID=str(private_domain(94)), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "oxygen_ros.bringup", *args, "--duration", "1"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_a_bad_fleet_is_refused_with_every_problem_listed(tmp_path):
    params = write(tmp_path / "fleet.yaml", """
oxygen_engine:
  ros__parameters:
    model: tiny
    robots: [arm_a, arm_b, arm_c]
    arm_a: {robot_config: droid, namespace: /cell}
    arm_b: {robot_config: aloha, namespace: cell}
    arm_c: {robot_config: franka_typo}
    arm_d: {robot_config: droid}
/arm_x/oxygen_observation:
  ros__parameters: {prompt: hello}
""")
    r = bringup("--params-file", str(params))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refusing to start, bad parameters" in r.stderr
    for line in ("arm_a and arm_b have the same namespace /cell: each robot needs its own",
                 "arm_c.robot_config: no robot config franka_typo.yaml in",
                 "arm_d.robot_config is set but arm_d is not in robots [arm_a, arm_b, arm_c]: an unknown robot",
                 "section /arm_x/oxygen_observation: no robot has the namespace /arm_x"):
        assert line in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_each_robot_s_node_problems_are_listed_with_its_name(tmp_path):
    fleet = FLEET.replace("    state_topic: joint_states\n/arm_b/oxygen_action:",   # arm_b reads arm_a's joints
                          "    state_topic: /arm_a/joint_states\n/arm_b/oxygen_action:")
    # ... and writes its commands, chunks, captions and pictures where arm_a's go, and serves arm_a's service.
    fleet = fleet.replace("  ros__parameters: {output_type: float64_array}",
                          "  ros__parameters: {output_type: float64_array, action_topic: /arm_a/oxygen/action, "
                          "chunk_topic: /arm_a/oxygen/action_chunk}")
    assert fleet != FLEET
    params = write(tmp_path / "fleet.yaml", fleet + """
/arm_a/oxygen_action:
  ros__parameters: {joint_names: [a, b]}
/arm_b/oxygen_conversation:
  ros__parameters: {memory_topic: /arm_a/oxygen/memory, service_name: /arm_a/oxygen/converse}
/arm_b/oxygen_view:
  ros__parameters: {debug_topic: /arm_a/oxygen/debug_image}
""")
    r = bringup("--params-file", str(params), "--record", str(tmp_path / "bag"))
    assert r.returncode == 2, r.stdout + r.stderr
    for line in ("arm_a: joint_names has 2 names, the actions have 8 dimensions",
                 "--record: not available with a fleet (robots: arm_a, arm_b) yet",
                 "arm_a and arm_b both read their state from /arm_a/joint_states",
                 "arm_a and arm_b both publish their commands (action_topic) on /arm_a/oxygen/action",
                 "arm_a and arm_b both publish their chunks (chunk_topic) on /arm_a/oxygen/action_chunk",
                 "arm_a and arm_b both publish their captions (memory_topic) on /arm_a/oxygen/memory",
                 "arm_a and arm_b both serve their conversation service (service_name) on /arm_a/oxygen/converse"):
        assert line in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_robots_sharing_only_an_output_topic_are_refused(tmp_path):
    """The review's case: everything else right, arm_b's commands on arm_a's topic (the view is built only
    once the robots' nodes are good, so its topics are checked in a fleet that is otherwise right)."""
    fleet = FLEET.replace("  ros__parameters: {output_type: float64_array}",
                          "  ros__parameters: {output_type: float64_array, action_topic: /arm_a/oxygen/action}")
    params = write(tmp_path / "fleet.yaml", fleet + """
/arm_a/oxygen_view:
  ros__parameters: {debug_topic: /debug_image}
/arm_b/oxygen_view:
  ros__parameters: {debug_topic: /debug_image}
""")
    r = bringup("--params-file", str(params))
    assert r.returncode == 2, r.stdout + r.stderr
    for line in ("arm_a and arm_b both publish their commands (action_topic) on /arm_a/oxygen/action: give each "
                 "robot its own",
                 "arm_a and arm_b both publish their debug pictures (debug_topic) on /debug_image"):
        assert line in r.stderr, r.stderr


def test_robots_given_as_one_name_is_refused(tmp_path):
    params = write(tmp_path / "fleet.yaml", "oxygen_engine:\n  ros__parameters:\n    model: tiny\n    robots: arm_a\n")
    r = bringup("--params-file", str(params))
    assert r.returncode == 2 and "fleet.yaml:4: oxygen_engine.robots = 'arm_a': must be a list of strings, e.g. [arm_a]" in r.stderr, r.stderr


def test_a_robot_config_and_a_fleet_together_are_refused():
    r = bringup("--robot", "droid", "--params-file", str(REPO / "config" / "fleet_example.yaml"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == ("oxygen_bringup: --robot droid and a fleet (robots: ['arm_a', 'arm_b']) both given: "
                                "a fleet names each robot's config in <robot>.robot_config (docs/fleet.md)")


def test_the_fleet_example_starts_and_stops():
    r = bringup("--params-file", str(REPO / "config" / "fleet_example.yaml"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "serving 2 robots: arm_a (/arm_a, droid.yaml, 8 action dims), arm_b (/arm_b, aloha.yaml, 14 action dims)" in out
    assert "Traceback" not in out


# ------------------------------------------------------------------------------ two robots, one engine, DDS
FLEET = """
/**:
  ros__parameters: {action_rate_hz: 70.0}
oxygen_engine:
  ros__parameters:
    model: tiny
    checkpoint: ''
    tokenizer: ''
    kv_budget_mb: 32.0
    torch_threads: 1
    memory_period_s: 1.0
    memory_max_tokens: 2
    robots: [arm_a, arm_b]
    arm_a: {robot_config: droid}
    arm_b: {robot_config: aloha}
/arm_a/oxygen_observation:
  ros__parameters:
    cameras:
      base_0_rgb: {topic: camera, required: true}
      left_wrist_0_rgb: {topic: '', required: false}
    state_topic: joint_states
/arm_b/oxygen_observation:
  ros__parameters:
    cameras:
      base_0_rgb: {topic: camera, required: true}
      left_wrist_0_rgb: {topic: ''}
      right_wrist_0_rgb: {topic: ''}
    state_topic: joint_states
/arm_b/oxygen_action:
  ros__parameters: {output_type: float64_array}
"""
B_STAMP_OFFSET_S = 0.002      # B's stamps sit 2 ms before A's: a stamp says whose observation it was


class TwoRobots:
    """Both robots' drivers in this process: a camera and joint states per robot at 20 Hz (the joints of
    config/droid.yaml and config/aloha.yaml), stamped by this host's clock; `camera_on[robot]` silences one."""

    def __init__(self, node):
        import yaml
        from sensor_msgs.msg import Image, JointState

        self.node, self.Image, self.JointState = node, Image, JointState
        self.joints = {robot: yaml.safe_load((REPO / "config" / f"{cfg}.yaml").read_text())
                       ["oxygen_observation"]["ros__parameters"]["joint_names"]
                       for robot, cfg in (("arm_a", "droid"), ("arm_b", "aloha"))}
        self.camera_on = {"arm_a": True, "arm_b": True}
        self.stamps = {"arm_a": [], "arm_b": []}
        self.pubs = {r: (node.create_publisher(Image, f"/{r}/camera", 10),
                         node.create_publisher(JointState, f"/{r}/joint_states", 10)) for r in self.joints}
        self.rng = np.random.default_rng(0)
        node.create_timer(0.05, self._tick)

    def _tick(self):
        now = self.node.get_clock().now().nanoseconds * 1e-9
        for robot, (camera, joints) in self.pubs.items():
            t = now - (B_STAMP_OFFSET_S if robot == "arm_b" else 0.0)
            stamp = self._stamp(t)
            if self.camera_on[robot]:
                image = self.Image(encoding="rgb8", width=64, height=64, step=192,
                                   data=self.rng.integers(0, 256, 64 * 64 * 3, dtype=np.uint8).tobytes())
                image.header.stamp = stamp
                camera.publish(image)
            state = self.JointState(name=self.joints[robot], position=[0.1] * len(self.joints[robot]))
            state.header.stamp = stamp
            joints.publish(state)
            self.stamps[robot].append(t)

    @staticmethod
    def _stamp(t: float):
        from builtin_interfaces.msg import Time

        sec = int(t)
        return Time(sec=sec, nanosec=int(round((t - sec) * 1e9)))

    def whose(self, stamp) -> list[str]:
        """The robots that published an observation with this stamp (within 1 µs)."""
        t = stamp.sec + stamp.nanosec * 1e-9
        return [r for r, ts in self.stamps.items() if ts and np.min(np.abs(np.array(ts) - t)) < 1e-6]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from ros_harness import private_domain, running_bringup

    folder = tmp_path_factory.mktemp("fleet")
    # arm_a's own norm stats: every action quantile 0.25, so each of its actions un-normalises to 0.25 +
    # (x + 1) / 2 * 1e-6 (openpi's formula) whatever the model says; arm_b has none (the model's units).
    norm = write(folder / "arm_a_norm_stats.json", json.dumps({"norm_stats": {"actions": {
        "mean": [0.25] * 8, "std": [0.0] * 8, "q01": [0.25] * 8, "q99": [0.25] * 8}}}))
    params = write(folder / "fleet.yaml", FLEET.replace("arm_a: {robot_config: droid}",
                                                        f"arm_a: {{robot_config: droid, norm_stats: '{norm}'}}"))
    with running_bringup(["--params-file", str(params), "--status-period", "2"], private_domain(31)) as (b, client):
        yield b, client, TwoRobots(client.node)


def test_each_robot_gets_commands_of_its_own_dims_from_its_own_observations(fleet):
    from std_msgs.msg import Float64MultiArray

    from oxygen_interfaces.msg import ActionChunk
    from ros_harness import wait_until

    bringup, client, robots = fleet
    actions = {r: client.collect(Float64MultiArray, f"/{r}/oxygen/action") for r in ("arm_a", "arm_b")}
    chunks = {r: client.collect(ActionChunk, f"/{r}/oxygen/action_chunk") for r in ("arm_a", "arm_b")}
    assert wait_until(lambda: all(len(actions[r]) > 20 and len(chunks[r]) > 2 for r in actions), 90), (
        {r: len(a) for r, a in actions.items()}, bringup.output()[-3000:])
    for robot, dim in (("arm_a", 8), ("arm_b", 14)):             # droid.yaml: 8 dims, aloha.yaml: 14
        for _, m in list(actions[robot]):
            assert len(m.data) == dim and np.all(np.isfinite(m.data))
        for _, c in list(chunks[robot]):
            assert (c.dim, c.horizon) == (dim, 10)                # the shared tiny model's horizon
            assert robots.whose(c.header.stamp) == [robot], "a chunk computed from another robot's observation"
    # Each robot's own norm stats: arm_a's pin every action to 0.25 (to 1e-4), arm_b's model units vary.
    a = np.array([m.data for _, m in list(actions["arm_a"])])
    np.testing.assert_allclose(a, 0.25, atol=1e-4)
    np.testing.assert_allclose(np.concatenate([c.actions for _, c in list(chunks["arm_a"])]), 0.25, atol=1e-4)
    b = np.concatenate([c.actions for _, c in list(chunks["arm_b"])])
    assert np.std(b) > 1e-2, "arm_b's actions are not arm_a's norm stats"
    # The single robot's names are not used by a fleet.
    assert client.node.count_publishers("/oxygen/action") == 0
    assert client.node.count_publishers("/arm_a/oxygen/action") == 1


def test_a_question_to_arm_b_is_answered_from_arm_b_s_frame(fleet):
    from oxygen_interfaces.srv import Converse
    from ros_harness import wait_until

    bringup, client, robots = fleet
    cli = client.node.create_client(Converse, "/arm_b/oxygen/converse")
    assert cli.wait_for_service(20)
    assert wait_until(lambda: len(robots.stamps["arm_b"]) > 10, 20)
    future = cli.call_async(Converse.Request(text="What do you see?", max_tokens=4))
    assert wait_until(future.done, 60), bringup.output()[-3000:]
    r = future.result()
    assert r.success, r.error
    assert robots.whose(r.frame_stamp) == ["arm_b"], "answered about another robot's camera"


def test_each_robot_s_captions_come_on_its_memory_topic_from_its_frames(fleet):
    from oxygen_interfaces.msg import Caption
    from ros_harness import wait_until

    bringup, client, robots = fleet
    captions = {r: client.collect(Caption, f"/{r}/oxygen/memory") for r in ("arm_a", "arm_b")}
    assert wait_until(lambda: all(len(c) >= 2 for c in captions.values()), 60), (
        {r: len(c) for r, c in captions.items()}, bringup.output()[-2000:])
    for robot, received in captions.items():
        for _, c in list(received):
            assert robots.whose(c.header.stamp) == [robot], f"{robot}'s caption describes another robot's frame"
    assert client.node.count_publishers("/oxygen/memory") == 0


def test_each_robot_has_its_own_debug_picture(fleet):
    from sensor_msgs.msg import Image

    from ros_harness import wait_until

    bringup, client, robots = fleet
    pictures = {r: client.collect(Image, f"/{r}/oxygen/debug_image") for r in ("arm_a", "arm_b")}
    assert wait_until(lambda: all(len(p) >= 2 for p in pictures.values()), 30), {r: len(p) for r, p in pictures.items()}
    for robot, received in pictures.items():
        for _, picture in list(received):
            assert picture.encoding == "rgb8" and picture.width > 0
            assert robots.whose(picture.header.stamp) == [robot], f"{robot}'s picture shows another robot's chunk"


@pytest.mark.timing
def test_a_stale_camera_stops_only_its_robot(fleet):
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
    from std_msgs.msg import Float64MultiArray

    from ros_harness import wait_until

    bringup, client, robots = fleet
    actions = {r: client.collect(Float64MultiArray, f"/{r}/oxygen/action") for r in ("arm_a", "arm_b")}
    diagnostics = client.collect(DiagnosticArray, "/diagnostics")
    assert wait_until(lambda: all(len(a) > 10 for a in actions.values()), 30)
    robots.camera_on["arm_a"] = False
    try:
        time.sleep(2.0)              # stale_after_s 0.5 (droid.yaml's on_stale: stop), with slack for the load
        since = time.monotonic()
        time.sleep(2.0)
        a_late = [t for t, _ in list(actions["arm_a"]) if t > since]
        b_late = [t for t, _ in list(actions["arm_b"]) if t > since]
        assert a_late == [], f"arm_a published {len(a_late)} commands with its camera silent"
        assert len(b_late) > 40, f"arm_b kept publishing: {len(b_late)} commands in 2 s (70 Hz nominal)"

        def newest(name):
            for _, msg in reversed(list(diagnostics)):
                for s in msg.status:
                    if s.name == name:
                        return s
            return None

        assert wait_until(lambda: newest("oxygen_ros: arm_a actions") is not None
                          and newest("oxygen_ros: arm_a actions").message == "inputs stale: actions stopped", 5)
        assert newest("oxygen_ros: arm_a inputs").level == DiagnosticStatus.ERROR
        # arm_b plays (or holds, between chunks: aloha.yaml's 50 Hz rows outrun the tiny model's 10-row
        # chunks on a loaded machine) and is not stopped.
        actions_b = {kv.key: kv.value for kv in newest("oxygen_ros: arm_b actions").values}
        assert actions_b["status"] in ("ok", "blending", "hold"), actions_b
        assert newest("oxygen_ros: arm_b inputs").message == "receiving"
        engine_b = {kv.key: kv.value for kv in newest("oxygen_ros: arm_b engine").values}
        assert int(engine_b["chunks"]) > 0 and "deadline_misses" in engine_b
    finally:
        robots.camera_on["arm_a"] = True
    # A's camera back: A's commands resume.
    back = time.monotonic()
    assert wait_until(lambda: any(t > back for t, _ in list(actions["arm_a"])), 10)


@pytest.mark.timing
def test_each_robot_has_its_own_enable_service(fleet):
    from std_msgs.msg import Float64MultiArray
    from std_srvs.srv import SetBool

    from ros_harness import wait_until

    bringup, client, robots = fleet
    actions = {r: client.collect(Float64MultiArray, f"/{r}/oxygen/action") for r in ("arm_a", "arm_b")}
    cli = client.node.create_client(SetBool, "/arm_b/oxygen/enable")
    assert cli.wait_for_service(20)
    assert wait_until(lambda: all(len(a) > 10 for a in actions.values()), 30)
    off = cli.call_async(SetBool.Request(data=False))
    assert wait_until(off.done, 10) and off.result().success
    t_off = time.monotonic()
    time.sleep(1.5)
    assert [t for t, _ in list(actions["arm_b"]) if t > t_off + 0.05] == [], "arm_b published after its disable"
    assert len([t for t, _ in list(actions["arm_a"]) if t > t_off + 0.05]) > 30, "arm_a kept publishing"
    on = cli.call_async(SetBool.Request(data=True))
    assert wait_until(on.done, 10) and on.result().success
    t_on = time.monotonic()
    assert wait_until(lambda: any(t > t_on for t, _ in list(actions["arm_b"])), 5)


def test_a_managed_fleet_is_fixed_configured_deactivated_and_configured_again(tmp_path):
    """Through the lifecycle services, as a lifecycle manager drives it: a fleet with a misspelt robot config
    stays unconfigured and says why; the robot's parameter set, configure and activate bring both robots'
    actions; deactivate stops both; cleanup and configure again (the robots' parameters are read again)."""
    from lifecycle_msgs.msg import State, Transition
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters
    from std_msgs.msg import Float64MultiArray

    from ros_harness import private_domain, running_bringup, wait_until
    from test_lifecycle import call, state, transition

    params = write(tmp_path / "fleet.yaml", FLEET.replace("arm_b: {robot_config: aloha}",
                                                          "arm_b: {robot_config: alohaa}"))
    with running_bringup(["--params-file", str(params), "--managed", "--status-period", "0"],
                         private_domain(37), "fleet_lifecycle_test") as (bringup, client):
        TwoRobots(client.node)
        actions = {r: client.collect(Float64MultiArray, f"/{r}/oxygen/action") for r in ("arm_a", "arm_b")}
        assert not transition(client, Transition.TRANSITION_CONFIGURE)
        assert state(client) == State.PRIMARY_STATE_UNCONFIGURED
        assert bringup.wait_for_line("arm_b.robot_config: no robot config alohaa.yaml", 5), bringup.output()

        value = ParameterValue(type=ParameterType.PARAMETER_STRING, string_value="aloha")
        r = call(client, SetParameters, "/oxygen_engine/set_parameters",
                 SetParameters.Request(parameters=[Parameter(name="arm_b.robot_config", value=value)]))
        assert r.results[0].successful, r.results[0].reason
        for _ in range(2):                    # configured, cleaned up, configured again
            assert transition(client, Transition.TRANSITION_CONFIGURE)
            assert transition(client, Transition.TRANSITION_ACTIVATE)
            since = time.monotonic()
            assert wait_until(lambda: all(sum(t > since for t, _ in list(a)) > 20 for a in actions.values()), 60), (
                {r: len(a) for r, a in actions.items()}, bringup.output()[-3000:])
            assert transition(client, Transition.TRANSITION_DEACTIVATE)
            stopped = time.monotonic()
            time.sleep(1.0)
            late = {r: sum(t > stopped + 0.3 for t, _ in list(a)) for r, a in actions.items()}
            assert late == {"arm_a": 0, "arm_b": 0}, f"actions after deactivate: {late}"
            assert transition(client, Transition.TRANSITION_CLEANUP)
            assert state(client) == State.PRIMARY_STATE_UNCONFIGURED
