"""The nodes in-process on a real rclpy context, driven tick by tick on a simulated clock (no timers spun,
so nothing here depends on the machine's load): every output type, the safe behaviours (`on_stale`,
`on_exhausted`, `hold_timeout_s`), the shutdown order, compressed cameras and conversation sessions."""
from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
from geometry_msgs.msg import PoseStamped, TwistStamped
from rclpy.parameter import Parameter
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Float64MultiArray, String
from trajectory_msgs.msg import JointTrajectory

from conftest import SimClock
from oxygen_ros.robot.chunks import ActionChunkPlan

DT = 1 / 70.0
NAMES = [f"j{i}" for i in range(7)]


@pytest.fixture
def publisher(ros, engine_factory):
    """make(inputs_fresh=..., **params) -> ActionPublisher on a simulated clock, its published messages
    recorded (through the real rclpy publish, which checks the message type)."""
    from oxygen_ros.nodes.action_publisher import ActionPublisher

    def make(inputs_fresh=None, engine_config: dict | None = None, **params):
        engine = engine_factory(**(engine_config or {}))
        node = ros.add(ActionPublisher(engine, inputs_fresh=inputs_fresh, context=ros.context,
                                       parameter_overrides=[Parameter(k, value=v) for k, v in params.items()]))
        node.clock = SimClock(100.0)
        node._now = node.clock
        node.sent, node.chunks = [], []
        publish, publish_chunk = node.pub.publish, node.chunk_pub.publish
        node.pub.publish = lambda msg: (node.sent.append(msg), publish(msg))
        node.chunk_pub.publish = lambda msg: (node.chunks.append(msg), publish_chunk(msg))
        return node

    return make


def chunk(stamp_s: float, frame: int, horizon: int = 10, dim: int = 7, start: float = 0.0) -> SimpleNamespace:
    """What the engine hands the publisher: row k = start + 0.01 * (k + 1) in every dimension."""
    rows = start + 0.01 * np.arange(1, horizon + 1)[:, None] * np.ones((1, dim))
    return SimpleNamespace(plan=ActionChunkPlan(rows, stamp_s, DT, frame), compute_s=0.01, rtc_delay_rows=None,
                           subtask="")


def tick_at(node, t: float):
    node.clock.t = t
    before = len(node.sent)
    node._tick()
    return node.sent[before:]


# ------------------------------------------------------------------------------------------ output types
def test_float64_array_plays_the_row_for_now_latency_aligned(publisher):
    node = publisher()
    node._on_chunk(chunk(100.0, 1))
    (msg,) = tick_at(node, 100.0 + 3 * DT)            # 3 rows after the observation: row 3
    assert isinstance(msg, Float64MultiArray) and msg.data.tolist() == pytest.approx([0.04] * 7)
    assert node.last_status == "ok"
    (c,) = node.chunks                                 # every new chunk once on /oxygen/action_chunk
    assert (c.frame_index, c.horizon, c.dim, c.header.stamp.sec, c.header.stamp.nanosec) == (1, 10, 7, 100, 0)
    assert c.actions.tolist()[::7] == pytest.approx([0.01 * (k + 1) for k in range(10)])
    assert c.step_period_s == pytest.approx(DT) and c.compute_latency_s == pytest.approx(0.01)
    tick_at(node, 100.0 + 4 * DT)
    assert len(node.chunks) == 1


def test_a_tick_before_the_chunk_stamp_plays_row_0_and_sends_the_whole_trajectory(publisher):
    # Clocks a hair apart: now is half a row before t0. The row for now is -1 (floor; int() would say 0 and
    # the trajectory would lose its first row), played as row 0.
    node = publisher()
    node._on_chunk(chunk(100.0, 1))
    (msg,) = tick_at(node, 100.0 - 0.5 * DT)
    assert msg.data.tolist() == pytest.approx([0.01] * 7)
    node = publisher(output_type="joint_trajectory", joint_names=NAMES, action_topic="/trajectory")
    node._on_chunk(chunk(100.0, 1))
    (msg,) = tick_at(node, 100.0 - 0.5 * DT)
    assert len(msg.points) == 10 and msg.points[0].positions[0] == pytest.approx(0.01)
    first = msg.points[0].time_from_start
    assert first.sec + first.nanosec * 1e-9 == pytest.approx(0.5 * DT, abs=1e-6)


@pytest.mark.parametrize("execution, blend_steps, statuses", [
    ("rtc", 0, ["ok", "ok", "ok"]), ("naive", 0, ["ok", "ok", "ok"]), ("blend", 2, ["blending", "blending", "ok"])])
def test_execution_decides_how_a_new_chunk_takes_over(publisher, execution, blend_steps, statuses):
    """rtc (like naive) plays a new chunk at its row for now from the tick it arrives, unblended; blend mixes
    the old chunk in over blend_steps ticks."""
    node = publisher(execution=execution, blend_steps=blend_steps, engine_config=dict(rtc=execution == "rtc"))
    assert node.follower.execution == execution
    node._on_chunk(chunk(100.0, 1))
    tick_at(node, 100.0 + 2 * DT)
    node._on_chunk(chunk(100.0 + DT, 2, start=1.0))       # computed from an observation a row later
    sent = [tick_at(node, 100.0 + (3 + k) * DT)[0].data[0] for k in range(3)]
    new_rows = [1.0 + 0.01 * (k + 3) for k in range(3)]  # rows 2, 3, 4 of the new chunk: 1 + 0.01 (k + 1)
    if execution == "blend":
        assert sent[0] == pytest.approx((2 / 3) * 0.04 + (1 / 3) * new_rows[0])
    else:
        assert sent == pytest.approx(new_rows)
    assert node.last_status == statuses[-1]


def test_real_time_chunking_continues_only_chunks_that_play(publisher, obs):
    """While the output is off nothing plays the chunks: the robot stays where it is (or an operator moves
    it), so chunks continuing them would lead from where it is not. Each is planned from the robot's state
    (plain); when the output is back on the next chunk continues the last of them, the one playing."""
    node = publisher(execution="rtc", engine_config=dict(rtc=True, rtc_delay_rows=1))

    def delay_of_next_chunk(i):
        observation = obs(i)
        observation.stamp_s = i * DT                   # a row after the last: the delivered chunk covers it
        node.engine.run_cycle(observation)
        return node.engine.latest_chunk().rtc_delay_rows
    assert [delay_of_next_chunk(i) for i in range(2)] == [None, 1]
    node.set_enabled(False)
    assert [delay_of_next_chunk(i) for i in (2, 3)] == [None, None]
    node.set_enabled(True)
    assert [delay_of_next_chunk(i) for i in (4, 5)] == [1, 1]
    node.set_enabled(True)                             # already on: nothing changes
    assert delay_of_next_chunk(6) == 1


def test_a_publisher_that_starts_disabled_gets_plain_chunks(publisher, obs):
    node = publisher(execution="rtc", start_enabled=False, engine_config=dict(rtc=True, rtc_delay_rows=1))
    delays = []
    for i in range(3):
        observation = obs(i)
        observation.stamp_s = i * DT
        node.engine.run_cycle(observation)
        delays.append(node.engine.latest_chunk().rtc_delay_rows)
    assert delays == [None, None, None]


def test_execution_settings_are_refused_together(ros, engine_factory):
    from oxygen_ros.nodes.action_publisher import ActionPublisher
    from oxygen_ros.nodes.params import ParameterError

    overrides = [Parameter("execution", value="rtc"), Parameter("blend_steps", value=3),
                 Parameter("replan_steps", value=2)]
    with pytest.raises(ParameterError) as refused:
        ActionPublisher(engine_factory(), context=ros.context, parameter_overrides=overrides)
    assert "blend_steps 3 applies to execution 'blend' only" in str(refused.value)
    assert "execution 'rtc' takes a chunk over when it arrives" in str(refused.value)
    with pytest.raises(ParameterError, match="execution 'rtc' plays chunks the engine guided: turn on"):
        ActionPublisher(engine_factory(), context=ros.context, parameter_overrides=[Parameter("execution", value="rtc")])
    bad = [Parameter("execution", value="smooth")]
    with pytest.raises(ParameterError, match=r"oxygen_action.execution = 'smooth': must be one of \['naive'"):
        ActionPublisher(engine_factory(), context=ros.context, parameter_overrides=bad)


def test_joint_state_output_names_every_joint(publisher):
    node = publisher(output_type="joint_state", joint_names=NAMES)
    node._on_chunk(chunk(100.0, 1))
    (msg,) = tick_at(node, 100.0 + 2 * DT)
    assert isinstance(msg, JointState) and list(msg.name) == NAMES
    assert msg.position.tolist() == pytest.approx([0.03] * 7)
    assert msg.header.stamp.sec == 100 and msg.header.stamp.nanosec == pytest.approx(2 * DT * 1e9, abs=10)


def test_twist_output_and_one_zero_twist_when_stopping(publisher):
    node = publisher(output_type="twist", frame_id="tool0")
    node._on_chunk(chunk(100.0, 1, start=0.1))
    (msg,) = tick_at(node, 100.0)
    assert isinstance(msg, TwistStamped) and msg.header.frame_id == "tool0"
    assert (msg.twist.linear.x, msg.twist.angular.z) == pytest.approx((0.11, 0.11))
    node.set_enabled(False)
    (stop,) = node.sent[-1:]
    assert isinstance(stop, TwistStamped) and stop.twist.linear.x == 0 and stop.twist.angular.z == 0
    assert tick_at(node, 100.0 + DT) == [] and node.last_status == "disabled"


def test_pose_output_converts_the_rotation(publisher):
    node = publisher(output_type="pose", rotation="euler_xyz")
    rows = np.zeros((10, 7))
    rows[:, :3] = [0.3, -0.2, 0.5]
    rows[:, 5] = math.pi / 2                                          # yaw 90 degrees
    node._on_chunk(SimpleNamespace(plan=ActionChunkPlan(rows, 100.0, DT, 1), compute_s=0.01, rtc_delay_rows=None,
                                   subtask=""))
    (msg,) = tick_at(node, 100.0)
    assert isinstance(msg, PoseStamped)
    p, q = msg.pose.position, msg.pose.orientation
    assert (p.x, p.y, p.z) == pytest.approx((0.3, -0.2, 0.5))
    assert (q.x, q.y, q.z, q.w) == pytest.approx((0, 0, math.sqrt(0.5), math.sqrt(0.5)))


def test_joint_trajectory_is_sent_once_per_chunk_and_stops_with_an_empty_one(publisher):
    node = publisher(output_type="joint_trajectory", joint_names=NAMES)
    node._on_chunk(chunk(100.0, 1))
    (msg,) = tick_at(node, 100.0 + 2 * DT)
    assert isinstance(msg, JointTrajectory) and list(msg.joint_names) == NAMES
    assert [round(pt.positions[0], 6) for pt in msg.points] == pytest.approx([0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1])
    assert tick_at(node, 100.0 + 3 * DT) == []                         # the controller plays the rest
    node._on_chunk(chunk(100.1, 2))
    (second,) = tick_at(node, 100.1)
    assert second.points[0].positions[0] == pytest.approx(0.02)
    node.set_enabled(False)
    assert isinstance(node.sent[-1], JointTrajectory) and len(node.sent[-1].points) == 0


# ------------------------------------------------------------------------------------------ safe behaviours
def test_on_exhausted_stop_stops_past_the_last_row(publisher):
    node = publisher(output_type="twist", on_exhausted="stop")
    node._on_chunk(chunk(100.0, 1, horizon=3))
    assert len(tick_at(node, 100.0 + 2 * DT)) == 1
    (stop,) = tick_at(node, 100.0 + 3 * DT)
    assert stop.twist.linear.x == 0 and node.last_status == "stopped"
    assert tick_at(node, 100.0 + 4 * DT) == []


def test_hold_then_hold_timeout_stops(publisher):
    node = publisher(on_exhausted="hold", hold_timeout_s=0.5)
    node._on_chunk(chunk(100.0, 1, horizon=3))
    end = 100.0 + 3 * DT
    for t in (end, end + 0.25, end + 0.5):
        (msg,) = tick_at(node, t)
        assert msg.data.tolist() == pytest.approx([0.03] * 7) and node.last_status == "hold"
    assert tick_at(node, end + 0.51) == [] and node.last_status == "hold_timeout"
    node._on_chunk(chunk(end + 0.5, 2, horizon=3))                   # a fresh chunk resumes at once
    (msg,) = tick_at(node, end + 0.52)
    assert msg.data.tolist() == pytest.approx([0.02] * 7) and node.last_status == "ok"


@pytest.mark.parametrize("on_stale, published", [("stop", 0), ("hold", 1)])
def test_on_stale(publisher, on_stale, published):
    fresh = [True]
    node = publisher(on_stale=on_stale, inputs_fresh=lambda: fresh[0])
    node._on_chunk(chunk(100.0, 1))
    assert len(tick_at(node, 100.0)) == 1
    fresh[0] = False
    assert len(tick_at(node, 100.0 + DT)) == published
    assert node.last_status == ("stale_stop" if on_stale == "stop" else "ok")
    fresh[0] = True
    assert len(tick_at(node, 100.0 + 2 * DT)) == 1


def test_no_command_follows_the_final_zero_twist(publisher):
    # Shutdown race: the main thread disables output while the timer thread is inside a tick. Before the
    # fix the tick (which had checked `enabled`) published its command after the zero twist: a velocity
    # robot kept moving.
    node = publisher(output_type="twist")
    node._on_chunk(chunk(100.0, 1, start=0.1))
    entered, release = threading.Event(), threading.Event()
    next_row = node.follower.next

    def slow_next(now):
        entered.set()
        release.wait(5)
        return next_row(now)

    node.follower.next = slow_next
    ticker = threading.Thread(target=tick_at, args=(node, 100.0))
    ticker.start()
    assert entered.wait(5)
    stopper = threading.Thread(target=node.set_enabled, args=(False,))
    stopper.start()
    time.sleep(0.2)
    release.set()
    ticker.join(5)
    stopper.join(5)
    node.follower.next = next_row
    last = node.sent[-1]
    assert isinstance(last, TwistStamped) and last.twist.linear.x == 0, "a command followed the zero twist"
    assert tick_at(node, 100.0 + DT) == []


# ------------------------------------------------------------------------------------------ inputs
@pytest.fixture
def observation(ros, engine_factory):
    from oxygen_ros.nodes.observation_node import ObservationNode

    def make(**params):
        engine = engine_factory()
        engine.observations = []
        engine.submit_observation = lambda obs, noise=None, robot="": engine.observations.append(obs)
        params = {"cameras.base_0_rgb.topic": "/cam", "cameras.base_0_rgb.compressed": True,
                  "cameras.base_0_rgb.required": True, "missing_after_s": 0.0, **params}
        return ros.add(ObservationNode(engine, context=ros.context,
                                       parameter_overrides=[Parameter(k, value=v) for k, v in params.items()]))

    return make


def _stamped(msg, t: float):
    msg.header.stamp.sec, msg.header.stamp.nanosec = int(t), int(round((t - int(t)) * 1e9))
    return msg


def test_a_compressed_camera_feeds_the_engine(observation):
    node = observation(prompt="stack the cups")
    rgb = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    ok, png = cv2.imencode(".png", rgb[..., ::-1])
    t = node._now()
    node._on_image("base_0_rgb", _stamped(CompressedImage(format="png", data=png.tobytes()), t))
    node._on_state(_stamped(JointState(name=NAMES, position=[0.1] * 7), t))
    (obs,) = node.engine.observations
    np.testing.assert_array_equal(obs.images["base_0_rgb"], rgb)
    assert obs.image_masks == {"base_0_rgb": True, "left_wrist_0_rgb": False, "right_wrist_0_rgb": False}
    assert obs.prompt == "stack the cups" and obs.state.tolist() == [0.1] * 7 and node.bad_inputs == 0


def test_an_oversized_compressed_image_is_refused_and_counted(observation):
    node = observation()
    ok, png = cv2.imencode(".png", np.zeros((10, 9000), np.uint8))
    node._on_image("base_0_rgb", _stamped(CompressedImage(format="png", data=png.tobytes()), node._now()))
    assert node.bad_inputs == 1 and "exceeds the limit of 8192 px per side" in node.last_error
    assert node.assembler.stats["images_received"] == 0


def test_a_state_longer_than_the_model_takes_is_refused_without_state_dim(observation, small_model):
    node = observation(state_type="float64_array", **{"cameras.base_0_rgb.compressed": False})
    node._on_state(Float64MultiArray(data=[0.0] * 200_000))
    assert node.bad_inputs == 1 and "more than the limit of 4096" in node.last_error
    node._on_state(Float64MultiArray(data=[0.0] * (small_model.cfg.action_dim + 1)))
    assert node.bad_inputs == 2 and f"more than the model's {small_model.cfg.action_dim}" in node.last_error
    img = Image(encoding="rgb8", width=4, height=4, step=12, data=bytes(48))
    node._on_image("base_0_rgb", _stamped(img, node._now()))
    node._on_state(Float64MultiArray(data=[0.0] * 8))
    assert len(node.engine.observations) == 1


# ------------------------------------------------------------------------------------------ conversation
def test_a_session_puts_its_earlier_turns_in_front_of_the_next_question(ros, engine_factory, obs):
    # Through the real service over DDS (the node spun by an executor), whatever thread records the turn.
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.node import Node

    from oxygen_interfaces.srv import Converse
    from oxygen_ros.nodes.conversation_service import ConversationService

    engine = engine_factory()
    asked = []
    submit = engine.submit
    engine.submit = lambda request: (asked.append(request.text), submit(request))[1]
    node = ros.add(ConversationService(engine, context=ros.context))
    client = ros.add(Node("session_client", context=ros.context))
    service = client.create_client(Converse, "/oxygen/converse")
    executor = MultiThreadedExecutor(num_threads=2, context=ros.context)
    executor.add_node(node)
    executor.add_node(client)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    engine.start()

    def ask(text, session_id, frame):
        future = service.call_async(Converse.Request(text=text, max_tokens=3, session_id=session_id))
        engine.submit_observation(obs(frame))                         # requests are admitted at a frame
        for i in range(600):
            if future.done():
                break
            time.sleep(0.1)
            engine.submit_observation(obs(frame * 1000 + i + 1))
        assert future.done() and future.result().success, future.result()
        return future.result().reply

    try:
        assert service.wait_for_service(20)
        first = ask("  what is red? ", "op", 1)
        ask("and blue?", "op", 2)
        ask("hello", "someone else", 3)
        assert asked == ["what is red?", f"what is red?\n{first}\nand blue?", "hello"]
    finally:
        engine.stop()
        executor.shutdown(timeout_sec=2.0)


def _run(coroutine):
    """Run a coroutine that never really waits (rclpy's goal handling with plain callbacks) to its end."""
    try:
        while True:
            coroutine.send(None)
    except StopIteration:
        pass


class _GoalResponseFails:
    """The action server's rcl handle, except that sending a goal response fails (the client went away)."""

    def __init__(self, handle):
        self._handle = handle

    def send_goal_response(self, *_):
        from rclpy._rclpy_pybind11 import RCLError

        raise RCLError("client gone")

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self._handle.__enter__()

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)


def test_goals_whose_response_cannot_be_sent_do_not_take_stream_slots(ros, engine_factory):
    # rclpy calls the goal callback, then sends the response; when that fails it drops the goal without
    # executing it. A slot taken in the goal callback was never given back: after max_streams such goals
    # every goal was refused.
    from unique_identifier_msgs.msg import UUID

    from oxygen_interfaces.action import Converse as ConverseAction
    from oxygen_ros.nodes.conversation_service import ConversationService

    node = ros.add(ConversationService(engine_factory(), context=ros.context,
                                       parameter_overrides=[Parameter("max_streams", value=2)]))
    server = node.action_server
    real = server._handle
    server._handle = _GoalResponseFails(real)
    try:
        for i in range(5):
            request = ConverseAction.Impl.SendGoalService.Request(goal=ConverseAction.Goal(text="hi"))
            request.goal_id = UUID(uuid=[i + 1] + [0] * 15)
            _run(server._execute_goal_request((None, request)))
    finally:
        server._handle = real
    from rclpy.action import GoalResponse

    assert node._on_goal(ConverseAction.Goal(text="hi")) == GoalResponse.ACCEPT
    assert node.counts["streams_rejected"] == 0


class _FakeGoal:
    """What rclpy hands the execute callback, recording how the goal ended."""

    def __init__(self, i: int, **goal):
        from unique_identifier_msgs.msg import UUID

        from oxygen_interfaces.action import Converse as ConverseAction

        self.goal_id = UUID(uuid=[i] + [0] * 15)
        self.request = ConverseAction.Goal(**goal)
        self.is_cancel_requested = False
        self.feedback, self.ended = [], None

    def publish_feedback(self, f):
        self.feedback.append(f.partial_reply)

    def succeed(self):
        self.ended = "succeeded"

    def abort(self):
        self.ended = "aborted"

    def canceled(self):
        self.ended = "canceled"


@pytest.mark.parametrize("timeout_s", [math.nan, math.inf, 1e300, -1.0])
def test_a_stream_with_any_timeout_ends_and_gives_its_slot_back(ros, engine_factory, obs, timeout_s):
    from oxygen_ros.nodes.conversation_service import ConversationService

    engine = engine_factory()
    node = ros.add(ConversationService(engine, context=ros.context,
                                       parameter_overrides=[Parameter("max_streams", value=1)]))
    engine.start()
    try:
        engine.submit_observation(obs(0))
        goal = _FakeGoal(1, text="hi", max_tokens=2, timeout_s=timeout_s)
        done = threading.Event()
        threading.Thread(target=lambda: (node._execute_stream(goal), done.set()), daemon=True).start()
        for i in range(1, 200):
            if done.wait(0.1):
                break
            engine.submit_observation(obs(i))
        assert done.is_set() and goal.ended in ("succeeded", "aborted")
        assert node._stream_slots == 0 and node._streams == {}
        assert engine.active_requests == 0 and engine.queued_requests == 0
    finally:
        engine.stop()


def test_a_goal_executed_beyond_max_streams_is_refused_as_busy(ros, engine_factory):
    from oxygen_ros.nodes.conversation_service import ConversationService

    node = ros.add(ConversationService(engine_factory(), context=ros.context,
                                       parameter_overrides=[Parameter("max_streams", value=1)]))
    node._stream_slots = 1                  # one stream running: goals accepted at the same moment
    goal = _FakeGoal(2, text="hi")
    result = node._execute_stream(goal)
    assert goal.ended == "aborted" and not result.success and result.error.startswith("busy: 1 streams")
    assert node._stream_slots == 1 and node.counts["streams_rejected"] == 1


def test_an_unexpected_error_in_a_tick_stops_the_robot_and_the_loop_survives(publisher):
    # An exception escaping a timer callback ends rclpy's spin: the 70 Hz loop would die without a stop.
    node = publisher(output_type="twist")
    node._on_chunk(chunk(100.0, 1, start=0.1))
    assert tick_at(node, 100.0)[0].twist.linear.x == pytest.approx(0.11)
    next_row = node.follower.next
    node.follower.next = lambda now: 1 / 0
    (stop,) = tick_at(node, 100.0 + DT)
    assert stop.twist.linear.x == 0 and node.last_status == "error" and node.tick_errors == 1
    assert "ZeroDivisionError" in node.diagnostics()[0].message
    node.follower.next = next_row
    assert tick_at(node, 100.0 + 2 * DT)[0].twist.linear.x == pytest.approx(0.13)


def test_an_unexpected_error_in_an_input_callback_is_counted_not_raised(observation, monkeypatch):
    import oxygen_ros.nodes.observation_node as module

    node = observation()
    monkeypatch.setattr(module, "image_from_msg", lambda msg, name=None: 1 / 0)
    node._on_image("base_0_rgb", _stamped(CompressedImage(format="png", data=b"x"), node._now()))
    assert node.bad_inputs == 1 and "ZeroDivisionError" in node.last_error


def test_a_request_the_engine_cannot_take_is_answered_with_the_reason(ros, engine_factory):
    # An exception from engine.submit escaped the service callback: the services executor stopped spinning.
    from oxygen_interfaces.srv import Converse

    from oxygen_ros.nodes.conversation_service import ConversationService

    engine = engine_factory()
    node = ros.add(ConversationService(engine, context=ros.context))
    engine.submit = lambda request: 1 / 0
    reply = node._submit(Converse.Request(text="hi")).result(timeout=0)
    assert not reply.success and reply.finish_reason == "refused"
    assert reply.error == "engine error: ZeroDivisionError: division by zero"


def test_a_state_dim_beyond_the_model_refuses_the_start(observation, small_model):
    from oxygen_ros.nodes.params import ParameterError

    with pytest.raises(ParameterError, match=f"state of 40 values .* exceeds the model's {small_model.cfg.action_dim}"):
        observation(state_dim=40)


def test_after_shut_down_output_cannot_be_enabled_again(publisher):
    # A /oxygen/enable true arriving during shutdown re-enabled the output while the engine stopped.
    from std_srvs.srv import SetBool

    node = publisher(output_type="twist")
    node._on_chunk(chunk(100.0, 1, start=0.1))
    assert len(tick_at(node, 100.0)) == 1
    node.shut_down()
    assert isinstance(node.sent[-1], TwistStamped) and node.sent[-1].twist.linear.x == 0
    response = node._on_enable(SetBool.Request(data=True), SetBool.Response())
    assert not response.success and response.message == "shutting down: action output stays disabled"
    assert tick_at(node, 100.0 + DT) == [] and not node.enabled


def test_enabling_output_does_not_clear_the_engines_safe_stop(publisher):
    """A safe stop is cleared on purpose (oxygen_engine's clear_safe_stop), not in passing by /oxygen/enable
    (issue #21: enabling used to clear it)."""
    from std_srvs.srv import SetBool

    node = publisher(output_type="twist")
    node.set_enabled(False)
    node.engine.faulted = "5 consecutive faulty frames, last: injected"
    response = node._on_enable(SetBool.Request(data=True), SetBool.Response())
    assert not response.success and not node.enabled and node.engine.faulted
    assert response.message == ("engine safe stop (5 consecutive faulty frames, last: injected): call "
                                "/oxygen_engine/clear_safe_stop first")
    node.engine.reset_fault()
    assert node._on_enable(SetBool.Request(data=True), SetBool.Response()).success and node.enabled


def test_the_stale_watch_is_refreshed_by_observations_not_by_polls(observation):
    """On a simulated clock: the node's 0.1 s timer polls the assembler; only an observation handed to the
    engine counts as fresh input. (A watch refreshed by every poll never went stale: issue #21.)"""
    node = observation(stale_after_s=0.5, prompt="touch the red cube", **{"cameras.base_0_rgb.compressed": False})
    clock = SimClock(100.0)
    node._now = clock
    img = Image(encoding="rgb8", width=4, height=4, step=12, data=bytes(48))

    def inputs():
        node._on_image("base_0_rgb", _stamped(img, clock.t))
        node._on_state(_stamped(JointState(name=NAMES, position=[0.1] * 7), clock.t))

    node._poll()                                           # the timer's first poll: nothing seen yet
    assert not node.inputs_fresh()
    clock.advance(0.1)                                     # the cameras without a topic now count as missing
    inputs()
    assert len(node.engine.observations) == 1 and node.inputs_fresh()
    fresh = []
    for _ in range(10):                                    # 1 s of timer polls without input
        clock.advance(0.1)
        node._poll()
        fresh.append(node.inputs_fresh())
    assert fresh == [True] * 5 + [False] * 5, fresh        # stale once more than 0.5 s old
    assert node.watch.transitions == 1
    inputs()
    assert node.inputs_fresh() and len(node.engine.observations) == 2


def test_a_task_prompt_is_logged_once_per_change(observation):
    """The simulated robot repeats its task every 5 s: one log line per new task, not per message."""
    node = observation(prompt="touch the red cube")
    lines = []
    node.get_logger().info = lambda line, **kw: lines.append(line)
    for text in ("touch the red cube", "touch the blue cube", "touch the blue cube", " touch the blue cube\n",
                 "touch the red cube", "touch the red cube"):
        node._on_prompt(String(data=text))
    assert lines == ["task prompt: 'touch the blue cube'", "task prompt: 'touch the red cube'"], lines
    assert node.prompt == "touch the red cube"


# ------------------------------------------------------------------------------------------ demo client
def test_the_demo_client_judges_a_reply_against_the_frame_it_names(ros):
    """Asked in an episode with two cubes, answered from a frame of the next episode (three cubes): the
    truth is that frame's, and a question naming a cube that frame lacks is not judged (issue #21)."""
    from builtin_interfaces.msg import Time

    from oxygen_ros.nodes.demo_client import DemoClient, SceneQuestions
    from oxygen_ros.sim.scene import COLOUR_NAMES, Layout

    rng = np.random.default_rng(5)
    two, three = Layout.random(rng, n_cubes=2), Layout.random(rng, n_cubes=3)
    tip = np.array([0.3, 0.0, 0.2])
    shown = {1_000_000_000: (two, tip), 2_000_000_000: (three, tip)}
    questions = SceneQuestions(lambda: (two, tip), shown.get)
    lines = []
    client = ros.add(DemoClient(printer=lines.append, context=ros.context))

    def reply(text: str, stamp_s: int):
        return SimpleNamespace(success=True, reply=text, frame_stamp=Time(sec=stamp_s), frame_index=stamp_s,
                               tokens=1, latency_s=0.01)

    text, judge = questions()
    assert text == "How many cubes are there?"
    assert judge(1_000_000_000) == "two" and judge(2_000_000_000) == "three" and judge(5) is None
    client._on_reply(text, judge, reply("three", 2))         # the next episode's frame: right
    assert lines[-1].startswith("[converse] 'How many cubes are there?' -> 'three' [right; 1/1 right]"), lines
    client._on_reply(text, judge, reply("two", 2))
    assert "[wrong, truth: 'three'; 1/2 right]" in lines[-1]
    client._on_reply(text, judge, reply("two", 9))            # a frame whose scene is unknown
    assert "[not judged" in lines[-1] and client.checked == 2 and client.unjudged == 1
    for _ in range(6):                                        # the other kinds, in turn
        text, judge = questions()
        assert judge(1_000_000_000) is not None, text         # on the scene it was asked about: always known
        named = [c for c in COLOUR_NAMES if f"the {c} cube" in text]
        if any(c not in three.colours for c in named):
            assert judge(2_000_000_000) is None, text         # names a cube the other frame's scene lacks


def test_an_entity_destroyed_under_a_spinning_executor_neither_stops_it_nor_reads_as_a_fault(ros, capfd):
    """The engine node's cleanup and shutdown destroy nodes while the bringup's executors spin. An entity
    destroyed between an executor's snapshot of its node and the wait makes rclpy 9.1's wait raise
    InvalidHandle (it skips a waitable it cannot enter but still adds it to the wait set): made
    deterministic here with a publisher's event handler destroyed while its node stays listed. The executor
    thread goes on (the other node's timer ticks once the leaving node is removed) and prints no
    'callback raised' traceback (seen in CI at a lifecycle shutdown before this was handled)."""
    from rclpy.event_handler import EventHandler
    from rclpy.node import Node

    from oxygen_ros.bringup import Executors
    from ros_harness import wait_until

    leaving = ros.add(Node("leaving", context=ros.context))
    leaving.create_publisher(String, "probe", 10)
    next(w for w in leaving.waitables if isinstance(w, EventHandler)).destroy()
    staying = ros.add(Node("staying", context=ros.context))
    ticks = []
    staying.create_timer(0.01, lambda: ticks.append(1))
    executors = Executors(1, context=ros.context)
    executors.other.add_node(leaving)
    executors.other.add_node(staying)
    executors.start()
    try:
        time.sleep(0.3)                      # every wait meets the destroyed entity and raises
        assert not ticks
        executors.other.remove_node(leaving)     # as RobotNodes.destroy does before destroying
        assert wait_until(lambda: len(ticks) >= 3, 5.0), "the executor thread stopped spinning"
    finally:
        executors.shutdown()
    assert "raised" not in capfd.readouterr().err
