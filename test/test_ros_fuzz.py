"""Fuzz at the ROS boundary: the four nodes and the engine in this process, as oxygen_bringup composes them
(one executor per traffic class), and a client node that sends random and malformed camera images (raw and
compressed), joint states, prompts, service requests and streaming goals (some cancelled) over DDS for a
bounded time, next to a well-behaved robot. Invariants checked afterwards:

- the 70 Hz action loop kept its rate (within 10% of 70 Hz, or of the rate it reached just before the fuzz
  when other jobs load the machine) and never published a NaN;
- every service request got exactly one response (counted where the server sends them) and every goal
  one result;
- nothing crashed: bad inputs were counted, the engine is not in a safe stop, and once the requests are
  done and the engine stopped the KV pool is empty.
"""
from __future__ import annotations

import collections
import math
import os
import threading
import time

import cv2
import numpy as np
import pytest
import rclpy
from action_msgs.msg import GoalStatus
from rclpy.action import ActionClient
from rclpy.context import Context
from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Float64MultiArray, String

from oxygen_interfaces.action import Converse as ConverseAction
from oxygen_interfaces.srv import Converse
from oxygen_ros.robot.rate import RateMeter
from ros_harness import private_domain, wait_until

FUZZ_S = 8.0
BASELINE_S = 3.0
JOINTS = ["joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6", "gripper"]
PARAMS = """
/**:
  ros__parameters:
    action_rate_hz: 70.0
oxygen_engine:
  ros__parameters:
    model: tiny
    robot_action_dim: 7
    action_horizon: 20
    kv_budget_mb: 16.0
    memory_period_s: 1.0
    memory_max_tokens: 4
    max_tokens_limit: 64
    max_queued_requests: 16
    torch_threads: 1
oxygen_observation:
  ros__parameters:
    cameras:
      base_0_rgb: {topic: /fuzz/base, required: true}
      left_wrist_0_rgb: {topic: /fuzz/wrist/compressed, compressed: true}
    state_topic: /fuzz/joint_states
    joint_names: [joint_1, joint_2, joint_3, joint_4, joint_5, joint_6, gripper]
    prompt: pick up the red cup
oxygen_action:
  ros__parameters:
    joint_names: [joint_1, joint_2, joint_3, joint_4, joint_5, joint_6, gripper]
    lower_limits: [-2.9, -1.8, -2.6, -2.9, -2.1, -2.9, 0.0]
    upper_limits: [2.9, 1.8, 2.6, 2.9, 2.1, 2.9, 1.0]
    hold_timeout_s: 5.0
oxygen_conversation:
  ros__parameters:
    default_timeout_s: 20.0
    max_streams: 4
"""
ODD_FLOATS = [0.0, -1.0, 0.5, 1.0, 2.0, 1e30, -1e30, math.nan, math.inf, -math.inf]


class Fuzzer:
    """Random and malformed inputs, reproducible from the seed."""

    def __init__(self, node: Node, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.node = node
        self.base = node.create_publisher(Image, "/fuzz/base", qos_profile_sensor_data)
        self.wrist = node.create_publisher(CompressedImage, "/fuzz/wrist/compressed", qos_profile_sensor_data)
        self.joints = node.create_publisher(JointState, "/fuzz/joint_states", qos_profile_sensor_data)
        self.prompt = node.create_publisher(String, "/oxygen/prompt", 10)
        self.frame = self.rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)
        ok, png = cv2.imencode(".png", self.frame)
        self.png = png.tobytes()
        ok, bomb = cv2.imencode(".png", np.zeros((10, 9000), np.uint8))   # header says 9000 px wide
        self.bomb = bomb.tobytes()

    def _stamp(self, msg, offset: float = 0.0):
        t = self.node.get_clock().now().nanoseconds * 1e-9 + offset
        msg.header.stamp.sec, msg.header.stamp.nanosec = int(t), int((t - int(t)) * 1e9)
        return msg

    def good_robot(self):
        """What a healthy robot sends: images from both cameras and a joint state, one instant."""
        self.base.publish(self._stamp(Image(encoding="rgb8", width=96, height=96, step=288,
                                            data=self.frame.tobytes())))
        self.wrist.publish(self._stamp(CompressedImage(format="png", data=self.png)))
        self.joints.publish(self._stamp(JointState(name=JOINTS, position=[0.1] * 7)))

    def text(self, limit: int = 3000) -> str:
        kind = self.rng.integers(6)
        if kind == 0:
            return ""
        if kind == 1:
            return " \t\n"
        if kind == 2:
            return "hi" + "\x00" * int(self.rng.integers(1, limit))
        if kind == 3:
            return "".join(chr(int(c)) for c in self.rng.integers(1, 0x2FFF, int(self.rng.integers(1, 50))))
        if kind == 4:
            return "x" * int(self.rng.integers(1, limit))
        return "What is on the table?"

    def bad_input(self):
        r = self.rng
        kind = r.integers(7)
        if kind == 0:       # raw image: random encoding, sizes, step and payload
            w, h = (int(v) for v in r.choice([0, 1, 7, 96, 5000, 9000], 2))
            msg = Image(encoding=str(r.choice(["rgb8", "bgr8", "mono16", "yuv422", ""])), width=w, height=h,
                        step=int(r.integers(0, 4 * max(w, 1))), data=r.bytes(int(r.integers(0, 200_000))))
            self.base.publish(self._stamp(msg, float(r.choice([0.0, -100.0, 1e6]))))
        elif kind == 1:     # compressed: garbage, truncated, a decompression bomb, nothing
            data = [r.bytes(int(r.integers(0, 5000))), self.png[: int(r.integers(1, len(self.png)))], self.bomb,
                    b""][int(r.integers(4))]
            self.wrist.publish(self._stamp(CompressedImage(format=str(r.choice(["png", "jpeg", "x"])), data=data)))
        elif kind == 2:     # joint states: wrong names, lengths, non-finite values, huge
            n = int(r.choice([0, 3, 7, 8, 5000]))
            names = list(JOINTS[:n]) if n <= 7 else [f"j{i}" for i in range(n)]
            positions = [float(v) for v in r.choice(ODD_FLOATS, int(r.choice([n, max(n - 1, 0)])))]
            self.joints.publish(self._stamp(JointState(name=names, position=positions)))
        elif kind == 3:
            self.prompt.publish(String(data=self.text(1000)))
        else:               # the robot's good messages, between the bad ones
            self.good_robot()

    def request(self) -> Converse.Request:
        r = self.rng
        return Converse.Request(
            text=self.text(), session_id=str(r.choice(["", "a", "b", "s" * 300])),
            max_tokens=int(r.choice([0, 1, 3, 8, 64, 65, 10_000])), temperature=float(r.choice(ODD_FLOATS)),
            top_p=float(r.choice(ODD_FLOATS)), timeout_s=float(r.choice(ODD_FLOATS + [0.05])),
            stop=[self.text(20) for _ in range(int(r.choice([0, 1, 3, 50])))])


@pytest.fixture
def system(tmp_path, monkeypatch):
    from oxygen_ros.nodes.action_publisher import ActionPublisher
    from oxygen_ros.nodes.conversation_service import ConversationService
    from oxygen_ros.nodes.engine_node import EngineNode
    from oxygen_ros.nodes.observation_node import ObservationNode

    params = tmp_path / "fuzz.yaml"
    params.write_text(PARAMS)
    monkeypatch.setenv("ROS_DOMAIN_ID", str(private_domain(37)))
    context = Context()
    rclpy.init(args=["fuzz", "--ros-args", "--params-file", str(params)], context=context)
    engine_node = EngineNode(context=context)
    engine_node.trigger_configure()             # a lifecycle node: the engine exists once configured
    engine = engine_node.engine
    assert engine is not None, engine_node.failure
    observation = ObservationNode(engine, context=context)
    action = ActionPublisher(engine, inputs_fresh=observation.inputs_fresh, context=context)
    conversation = ConversationService(engine, context=context)
    client = Node("fuzz_client", context=context)
    executors = [(SingleThreadedExecutor(context=context), [action]),
                 (SingleThreadedExecutor(context=context), [observation]),
                 (MultiThreadedExecutor(num_threads=6, context=context), [engine_node, conversation]),
                 # The fuzzing client on a single thread: on a MultiThreadedExecutor(2) its second thread
                 # busy-waits (rclpy: an entity ready while its callback group is busy wakes the wait at
                 # once) and took 5-7.5 s of CPU in 8 s holding the GIL, starving this whole process (CI
                 # run of 2026-12-01: 24 Hz, 59 calls sent instead of ~220). A real adversary is another
                 # process; its busy loop must not be charged to the system under test.
                 (SingleThreadedExecutor(context=context), [client])]
    for executor, nodes in executors:
        for node in nodes:
            executor.add_node(node)
    engine.start()
    threads = [threading.Thread(target=e.spin, daemon=True) for e, _ in executors]
    for t in threads:
        t.start()
    try:
        yield engine, observation, action, conversation, client
    finally:
        action.shut_down()
        engine.stop()
        for executor, _ in executors:
            executor.shutdown(timeout_sec=2.0)
        for node in (engine_node, observation, action, conversation, client):
            node.destroy_node()
        rclpy.shutdown(context=context)


@pytest.mark.timing
def test_random_and_malformed_traffic_keeps_every_invariant(system):
    engine, observation, action, conversation, client = system
    sent = collections.Counter()                # responses the server sent, per request sequence number
    # The service's raw send: `_send_response` here, `service.send` once replies are sent from the executor
    # (wave-2 engine branch); whichever exists is counted.
    owner, name = ((conversation.service, "send") if hasattr(conversation.service, "send")
                   else (conversation, "_send_response"))
    send = getattr(owner, name)
    setattr(owner, name, lambda response, header: (sent.update([header.request_id.sequence_number]),
                                                   send(response, header)))
    commands = []
    client.create_subscription(Float64MultiArray, "/oxygen/action", lambda m: commands.append(list(m.data)), 100)
    service = client.create_client(Converse, "/oxygen/converse", qos_profile=QoSProfile(depth=1000))
    deep = QoSProfile(depth=1000)                   # a client of bursts needs deep response queues too
    streams = ActionClient(client, ConverseAction, "/oxygen/converse_stream", goal_service_qos_profile=deep,
                           result_service_qos_profile=deep, cancel_service_qos_profile=deep)
    fuzz = Fuzzer(client, seed=int(os.environ.get("OXYGEN_FUZZ_SEED", "0")))
    robot = Fuzzer(client, seed=1)                  # a healthy robot at 15 Hz underneath the fuzz
    client.create_timer(1 / 15, robot.good_robot)
    assert service.wait_for_service(20) and streams.wait_for_server(20)
    assert wait_until(lambda: len(commands) > 10, 60), "no actions before the fuzz"

    # The rate without fuzz first, in the same conditions: on a machine shared with other jobs the timer may
    # fall short of 70 Hz by itself, and the fuzz is judged against what the loop reaches then.
    action.rate = RateMeter()
    time.sleep(BASELINE_S)
    baseline = action.rate.summary()
    futures, goals, results = [], [], []
    action.rate = RateMeter()                       # the rate during the fuzz only
    end = time.monotonic() + FUZZ_S
    while time.monotonic() < end:
        fuzz.bad_input()
        roll = fuzz.rng.random()
        if roll < 0.3:
            futures.append(service.call_async(fuzz.request()))
        elif roll < 0.35:
            r = fuzz.request()
            goals.append(streams.send_goal_async(ConverseAction.Goal(
                text=r.text, session_id=r.session_id, max_tokens=r.max_tokens, temperature=r.temperature,
                top_p=r.top_p, timeout_s=r.timeout_s, stop=r.stop)))
            # As a client does: ask for the result once accepted (the server keeps results only 10 s).
            goals[-1].add_done_callback(lambda g: g.result().accepted and results.append(g.result().get_result_async()))
        elif roll < 0.38 and goals and goals[-1].done() and goals[-1].result().accepted:
            goals[-1].result().cancel_goal_async()
        time.sleep(0.01)
    fuzz_rate = action.rate.summary()

    # Every request resolves, exactly once.
    assert wait_until(lambda: all(f.done() for f in futures), 90), \
        f"{sum(not f.done() for f in futures)} of {len(futures)} service calls unanswered"
    assert wait_until(lambda: all(g.done() for g in goals), 30)
    accepted = [g.result() for g in goals if g.result().accepted]
    assert wait_until(lambda: len(results) == len(accepted), 10)
    assert wait_until(lambda: all(r.done() for r in results), 90), (
        f"{sum(not r.done() for r in results)} of {len(results)} streaming goals never ended; "
        f"{conversation.counts}, slots {conversation._stream_slots}, engine active {engine.active_requests} "
        f"queued {engine.queued_requests}, goals on the server {len(conversation.action_server._goal_handles)}")
    assert len(sent) == len(futures) and set(sent.values()) == {1}, "a request answered twice or never"
    replies = [f.result() for f in futures]
    assert all(r.success or r.error for r in replies), "every failure says why"
    assert {r.result().status for r in results} <= {GoalStatus.STATUS_SUCCEEDED, GoalStatus.STATUS_ABORTED,
                                                      GoalStatus.STATUS_CANCELED}
    print(f"fuzz: {len(futures)} calls ({sum(r.success for r in replies)} answered), {len(goals)} goals "
          f"({len(accepted)} accepted), {observation.bad_inputs} bad inputs; action rate "
          f"{fuzz_rate['rate_hz']:.1f} Hz (before the fuzz {baseline['rate_hz']:.1f} Hz), period max "
          f"{fuzz_rate['period_ms_max']:.1f} ms")

    # The loop kept its rate (within 10% of 70 Hz, or of what it reached just before on a loaded machine),
    # published only finite commands; bad input was counted, nothing tripped.
    assert fuzz_rate["rate_hz"] >= 0.9 * min(70.0, baseline["rate_hz"]) and fuzz_rate["rate_hz"] < 77.0
    assert commands and all(len(c) == 7 and all(math.isfinite(v) for v in c) for c in commands)
    assert observation.bad_inputs > 50
    assert not engine.faulted
    assert wait_until(lambda: engine.active_requests == 0 and engine.queued_requests == 0, 30)
    assert conversation._stream_slots == 0 and conversation._streams == {}
    engine.stop()
    assert engine.stats.snapshot()["pool_blocks_used"] == 0
