"""The ROS package end to end, across processes: oxygen_bringup --demo (engine + nodes + simulated robot)
in one process, this test process as the robot's other software (subscriber, service and action client).

Checked here: the command stream stays alive while the engine computes (no stall; the rate itself and its
jitter are printed, and are benchmark figures: docs/demo_eval_ros.json); the conversation service and streaming action (with cancel); captions; diagnostics; bad input
of every kind is logged precisely while the loop keeps its rate; the enable service stops output at once.
"""
import math
import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.action import ActionClient
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray, String
from std_srvs.srv import SetBool

from oxygen_interfaces.action import Converse as ConverseAction
from oxygen_interfaces.msg import ActionChunk, Caption
from oxygen_interfaces.srv import Converse
from ros_harness import private_domain, running_bringup, wait_until

RATE_HZ = 70.0
# Liveness, not speed: the timer holds 70 Hz to ~0.3% on a quiet machine, but a loaded 2-core machine slows
# any timer without anything being wrong. A stream that stopped, or ticks once per chunk, fails these.
# The longest gap allowed: one that a loaded machine's scheduling can make (616 ms was seen in a clean-clone
# suite run, right after the bad-input burst) and that a stopped stream always exceeds.
MIN_RATE_HZ = RATE_HZ / 4
MAX_GAP_S = 1.0
LOWER = np.array([-1.6, -0.6, 0.0])     # config/demo.yaml: the MuJoCo arm's 3 joints
UPPER = np.array([1.6, 1.7, 2.6])


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    overrides = tmp_path_factory.mktemp("params") / "test.yaml"
    # The trained demo model ends its replies with EOS within ~12 tokens: one token per frame leaves the
    # streaming test time to cancel a reply before it ends.
    # The simulated robot leaves the action output on through its resets: these tests measure the command
    # stream and switch the output themselves.
    overrides.write_text("oxygen_engine:\n  ros__parameters:\n    memory_period_s: 1.5\n"
                         "    decode_budget: fixed\n    tokens_per_frame: 1\n"
                         "oxygen_sim_robot:\n  ros__parameters:\n    enable_service: ''\n")
    domain = private_domain(11)
    with running_bringup(["--demo", "--params-file", str(overrides), "--status-period", "2"], domain) as (bringup, client):
        actions = client.collect(Float64MultiArray, "/oxygen/action")
        assert wait_until(lambda: len(actions) > 20, 60), "no actions published:\n" + bringup.output()
        yield bringup, client


def rate_over(client, seconds: float):
    msgs = client.collect(Float64MultiArray, "/oxygen/action")
    time.sleep(seconds)
    t = np.array([m[0] for m in list(msgs)])
    periods = np.diff(t)
    return msgs, (len(t) - 1) / (t[-1] - t[0]), periods


def assert_alive(rate, periods, what):
    assert rate > MIN_RATE_HZ and periods.max() < MAX_GAP_S, \
        f"{what}: {rate:.1f} Hz, longest gap {periods.max() * 1e3:.0f} ms"


def test_actions_flow_while_the_engine_computes(system):
    bringup, client = system
    chunks = client.collect(ActionChunk, "/oxygen/action_chunk")
    msgs, rate, periods = rate_over(client, 6.0)
    print(f"action rate {rate:.2f} Hz over 6 s; period mean {periods.mean() * 1e3:.2f} ms, "
          f"std {periods.std() * 1e3:.2f} ms, p99 {np.percentile(periods, 99) * 1e3:.2f} ms, "
          f"max {periods.max() * 1e3:.2f} ms; {len(chunks)} chunks")
    assert_alive(rate, periods, "the command stream while the engine computes")
    assert len(chunks) >= 6, "the engine produced chunks while the rate was measured"
    for _, m in msgs:
        a = np.array(m.data)
        assert a.shape == (3,) and np.all(np.isfinite(a))
        assert np.all(a >= LOWER - 1e-9) and np.all(a <= UPPER + 1e-9), "commands are clamped to the limits"
    c = chunks[-1][1]
    assert (c.horizon, c.dim, len(c.actions)) == (20, 3, 60)      # config/demo.yaml: horizon 20
    assert c.step_period_s == pytest.approx(1 / RATE_HZ) and c.compute_latency_s > 0
    assert list(c.names) == ["joint_1", "joint_2", "joint_3"]


def test_conversation_service_answers_from_the_engine(system):
    bringup, client = system
    cli = client.node.create_client(Converse, "/oxygen/converse")
    assert cli.wait_for_service(20)
    future = cli.call_async(Converse.Request(text="What is on the table?", max_tokens=8))
    assert wait_until(future.done, 60)
    r = future.result()
    assert r.success and r.finish_reason in ("length", "eos", "stop") and r.error == ""
    assert 1 <= r.tokens <= 8 and r.latency_s > 0 and r.frame_stamp.sec > 0
    bad = cli.call_async(Converse.Request(text="   "))
    assert wait_until(bad.done, 20)
    assert not bad.result().success and bad.result().error == "question is empty"
    assert bad.result().finish_reason == "refused"


def test_streaming_conversation_gives_partials_and_can_be_cancelled(system):
    bringup, client = system
    ac = ActionClient(client.node, ConverseAction, "/oxygen/converse_stream")
    assert ac.wait_for_server(20)
    feedback = []
    send = ac.send_goal_async(ConverseAction.Goal(text="Describe the scene.", max_tokens=10),
                              feedback_callback=lambda f: feedback.append(f.feedback.partial_reply))
    assert wait_until(send.done, 20) and send.result().accepted
    result = send.result().get_result_async()
    assert wait_until(result.done, 60)
    r = result.result().result
    # Feedback (a topic) and the result (a service) travel separately: the last partial may land after it.
    assert r.success and wait_until(lambda: feedback and feedback[-1] == r.reply, 5), (feedback[-3:], r.reply)

    feedback2 = []
    send = ac.send_goal_async(ConverseAction.Goal(text="Describe the scene.", max_tokens=200, timeout_s=60.0),
                              feedback_callback=lambda f: feedback2.append(f.feedback.partial_reply))
    assert wait_until(send.done, 20) and send.result().accepted
    goal = send.result()
    assert wait_until(lambda: feedback2, 30)
    cancel = goal.cancel_goal_async()
    assert wait_until(cancel.done, 20)
    result = goal.get_result_async()
    assert wait_until(result.done, 30)
    r = result.result().result
    assert r.finish_reason == "cancelled" and not r.success and r.tokens < 200


@pytest.mark.timing
def test_captions_and_diagnostics(system):
    bringup, client = system
    captions = client.collect(Caption, "/oxygen/memory")
    diags = client.collect(DiagnosticArray, "/diagnostics")
    assert wait_until(lambda: len(captions) >= 1 and len(diags) >= 2, 20)
    c = captions[0][1]
    assert c.prompt == "Describe the scene." and c.text and c.header.stamp.sec > 0
    names = {s.name: s for _, d in diags for s in d.status}
    assert {"oxygen_ros: engine", "oxygen_ros: actions", "oxygen_ros: inputs", "oxygen_ros: conversation"} <= set(names)
    values = {name: {kv.key: kv.value for kv in s.values} for name, s in names.items()}
    engine, actions, inputs = (values[f"oxygen_ros: {n}"] for n in ("engine", "actions", "inputs"))
    assert {"frame_ms_mean", "deadline_misses", "dropped_frames", "pool_occupancy", "tokens_per_s"} <= set(engine)
    assert names["oxygen_ros: engine"].level == DiagnosticStatus.OK and engine["faults"] == "0"
    assert 0 <= int(engine["pool_blocks_used"]) < int(engine["pool_blocks_total"])
    assert names["oxygen_ros: inputs"].level == DiagnosticStatus.OK and inputs["bad_inputs"] == "0"
    assert actions["enabled"] == "True" and actions["status"] in ("ok", "blending", "hold")
    assert int(actions["commands"]) > 70 and float(actions["rate_hz"]) > MIN_RATE_HZ


@pytest.mark.timing
def test_bad_input_is_reported_precisely_and_the_loop_keeps_running(system):
    bringup, client = system
    node = client.node
    img_pub = node.create_publisher(Image, "/sim/camera/base/image_raw", 10)
    js_pub = node.create_publisher(JointState, "/sim/joint_states", 10)
    prompt_pub = node.create_publisher(String, "/oxygen/prompt", 10)
    time.sleep(1.0)   # discovery
    now = node.get_clock().now().to_msg()

    def image(encoding, width, height, step, nbytes):
        m = Image(encoding=encoding, width=width, height=height, step=step, data=bytes(nbytes))
        m.header.stamp = now
        return m

    def joints(names, positions):
        m = JointState(name=names, position=positions)
        m.header.stamp = now
        return m

    names = ["joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6", "gripper"]
    cases = [
        (lambda: img_pub.publish(image("yuv422_yuy2", 224, 224, 448, 448 * 224)), "unsupported encoding"),
        (lambda: img_pub.publish(image("rgb8", 224, 224, 672, 1000)), "data has 1000 bytes, expected at least 150528"),
        (lambda: img_pub.publish(image("rgb8", 224, 224, 100, 100 * 224)), "step 100"),
        (lambda: js_pub.publish(joints(names, [0.0, math.nan, 0, 0, 0, 0, math.inf])), "non-finite"),
        (lambda: js_pub.publish(joints(["elbow", "wrist"], [0.0, 1.0])), "missing"),
        (lambda: prompt_pub.publish(String(data="   ")), "prompt is empty"),
    ]
    for publish, _ in cases:
        publish()
        time.sleep(1.2)   # the node throttles its warning to one a second
    out = bringup.output()
    for _, expected in cases:
        assert expected in out, f"no log line containing {expected!r}"
    _, rate, periods = rate_over(client, 3.0)
    assert_alive(rate, periods, "the command stream after the bad input")


@pytest.mark.timing
def test_enable_service_stops_output_at_once_and_resumes(system):
    bringup, client = system
    cli = client.node.create_client(SetBool, "/oxygen/enable")
    assert cli.wait_for_service(20)
    msgs = client.collect(Float64MultiArray, "/oxygen/action")
    off = cli.call_async(SetBool.Request(data=False))
    assert wait_until(off.done, 10) and off.result().success
    t_off = time.monotonic()
    time.sleep(1.0)
    late = [t for t, _ in list(msgs) if t > t_off + 0.05]
    assert late == [], f"{len(late)} commands after disabling"
    on = cli.call_async(SetBool.Request(data=True))
    assert wait_until(on.done, 10) and on.result().success
    assert wait_until(lambda: any(t > time.monotonic() - 0.5 for t, _ in list(msgs)), 5)
