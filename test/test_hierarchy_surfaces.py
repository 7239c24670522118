"""The hierarchical policy's surfaces: spatial answers in camera pixels (hand-computed), the language topics
(the right robot, frame and stamp on the right topic when the engine's listener fires; latched where they
are state), the interjection service, the subtask a chunk carries."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from oxygen_ros.model.pi052 import Located, parse_loc_answer
from oxygen_ros.nodes.language import LATCHED, TOPICS, LanguageOutbox, in_pixels


# ------------------------------------------------------------------------------------------ pixels
def test_a_point_maps_to_the_camera_image_not_to_the_padded_model_input():
    # 640 x 480 camera: the model's 224 px input has 28 px bars top and bottom, which are not part of the frame
    # the coordinates are normalised over. <loc0511> = 511/1023, <loc0767> = 767/1023.
    (item,) = in_pixels(parse_loc_answer("red cup <loc0511><loc0767>"), 640, 480)
    assert (item.label, item.kind) == ("red cup", "point")
    assert item.normalized == pytest.approx((767 / 1023, 511 / 1023))
    assert item.pixels == pytest.approx((479.8436, 239.7654), abs=1e-4)     # (767/1023*640, 511/1023*480)


def test_a_box_keeps_its_corner_order_and_a_rotated_camera_is_turned_back():
    box = Located("bowl", "box", (0.25, 0.1, 0.5, 0.4))
    (plain,) = in_pixels([box], 200, 100)
    assert plain.pixels == pytest.approx((50.0, 10.0, 100.0, 40.0))
    # The model saw the image turned 180°: its (x, y) is the camera's (W - x, H - y); x1 <= x2 kept.
    (turned,) = in_pixels([box], 200, 100, rotated_180=True)
    assert turned.pixels == pytest.approx((100.0, 60.0, 150.0, 90.0))
    assert turned.normalized == box.xy                                    # what the model wrote, unchanged
    (point,) = in_pixels([Located("p", "point", (0.25, 0.1))], 200, 100, rotated_180=True)
    assert point.pixels == pytest.approx((150.0, 90.0))


def test_an_unknown_image_size_gives_normalised_coordinates_only():
    (item,) = in_pixels([Located("cup", "point", (0.5, 0.5))], 0, 0)
    assert item.pixels == () and item.normalized == (0.5, 0.5)
    assert in_pixels([], 640, 480) == []


# ------------------------------------------------------------------------------------------ language plumbing
class Update:
    def __init__(self, robot, kind, text, frame_index=3, stamp=12.5):
        self.robot, self.kind, self.text, self.frame_index, self.stamp = robot, kind, text, frame_index, stamp


def test_the_outbox_keeps_its_robots_updates_in_order_and_wakes_the_executor():
    woken = []
    box = LanguageOutbox("arm_a", lambda: woken.append(1))
    for update in (Update("arm_b", "subtask", "other robot"), Update("arm_a", "subtask", "pick"),
                   Update("arm_a", "memory", "picked"), Update("arm_a", "unknown", "?")):
        box.put(update)
    assert [(u.kind, u.text) for u in box.take()] == [("subtask", "pick"), ("memory", "picked")]
    assert len(woken) == 2 and box.take() == []


def test_state_topics_are_latched_and_speech_is_not():
    from rclpy.qos import DurabilityPolicy

    from oxygen_ros.nodes.language import qos_for

    assert set(TOPICS) == {"subtask", "memory", "plan", "speech"}
    for kind in TOPICS:
        qos = qos_for(kind)
        assert (qos.durability == DurabilityPolicy.TRANSIENT_LOCAL) == (kind in LATCHED)
    assert "speech" not in LATCHED and qos_for("subtask").depth == 1
    assert TOPICS["memory"][1] == "oxygen/progress"          # apart from the scene captions on oxygen/memory


# ------------------------------------------------------------------------------------------ the nodes
def conversation(ros, engine, **params):
    from rclpy.parameter import Parameter

    from oxygen_ros.nodes.conversation_service import ConversationService

    return ros.add(ConversationService(engine, context=ros.context,
                                       parameter_overrides=[Parameter(k, value=v) for k, v in params.items()]))


def test_a_spatial_answer_comes_back_in_the_configured_cameras_pixels(ros, engine_factory):
    from oxygen_ros.engine.requests import Reply
    from oxygen_interfaces.srv import Converse

    engine = engine_factory()
    node = conversation(ros, engine, loc_camera="left_wrist_0_rgb", loc_image_size=[640, 480])
    reply = Reply(True, "cup <loc0100><loc0200><loc0300><loc0400> ; bowl <loc0000><loc1023><loc1023><loc0000>",
                  [1, 2], "eos", frame_index=7, frame_stamp=3.0)
    response = node._fill(Converse.Response(), reply)
    assert response.reply == reply.text                       # the text stays as the model wrote it
    cup, bowl = response.located
    assert (cup.label, cup.kind, cup.camera, cup.image_width, cup.image_height) == (
        "cup", "box", "left_wrist_0_rgb", 640, 480)
    # <locY1><locX1><locY2><locX2>: x1 = 200/1023 * 640, y1 = 100/1023 * 480, x2 = 400/1023 * 640, y2 = 300/1023 * 480
    assert list(cup.pixels) == pytest.approx([125.1222, 46.9208, 250.2444, 140.7625], abs=1e-4)
    assert list(cup.normalized) == pytest.approx([200 / 1023, 100 / 1023, 400 / 1023, 300 / 1023])
    assert list(bowl.pixels) == pytest.approx([640.0, 0.0, 0.0, 480.0])   # as written (x1 > x2 here)
    # No size configured: the normalised coordinates only; the first camera slot by default.
    plain = conversation(ros, engine, service_name="other/converse", action_name="other/stream",
                         interject_service="other/interject", memory_topic="other/memory",
                         subtask_topic="other/subtask", progress_topic="other/progress", plan_topic="other/plan",
                         speech_topic="other/speech")
    (item, _) = plain._fill(Converse.Response(), reply).located
    assert item.camera == engine.info.camera_slots[0] and list(item.pixels) == [] and item.image_width == 0
    assert plain._fill(Converse.Response(), Reply(True, "a red cup", [1], "eos")).located == []


def test_a_wrong_loc_camera_or_size_refuses_the_node_with_each_problem(ros, engine_factory):
    from oxygen_ros.nodes.params import ParameterError

    with pytest.raises(ParameterError) as e:
        conversation(ros, engine_factory(), loc_camera="top", loc_image_size=[640])
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and "loc_camera 'top' is not a camera slot" in lines[0] and "loc_image_size [640]" in lines[1]


def test_language_and_interjection_through_dds(ros, engine_factory, obs):
    """The engine thread running the joint format on the tiny model: every subtask the engine's listener
    reports is published on /oxygen/subtask with its robot, frame and stamp; an interjection over the
    service gets the plan and speech of its raw reply, also published; a subscriber that comes later gets
    the newest subtask (latched); another robot's update is not published here."""
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.node import Node

    from oxygen_interfaces.msg import LanguageUpdate
    from oxygen_interfaces.srv import Interject
    from oxygen_ros.model.pi052 import split_plan_and_say
    from oxygen_ros.nodes.language import qos_for

    engine = engine_factory(hierarchy="joint", subtask_period_s=0.0, subtask_every_chunks=2, progress_memory=False)
    updates = []
    engine.add_language_listener(updates.append)
    node = conversation(ros, engine)
    client = ros.add(Node("language_client", context=ros.context))
    got = {kind: [] for kind in ("subtask", "plan", "speech")}
    for kind in got:
        client.create_subscription(LanguageUpdate, f"/oxygen/{kind}", got[kind].append, qos_for(kind))
    service = client.create_client(Interject, "/oxygen/interject")
    executor = MultiThreadedExecutor(num_threads=2, context=ros.context)
    executor.add_node(node)
    executor.add_node(client)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    engine.start()

    def until(done, what):
        for i in range(600):
            if done():
                return
            engine.submit_observation(obs(len(updates) * 1000 + i + 1))
            time.sleep(0.05)
        pytest.fail(f"no {what} in 30 s")

    try:
        until(lambda: len(got["subtask"]) >= 2, "two subtasks on /oxygen/subtask")
        subtasks = [u for u in updates if u.kind == "subtask"]
        for msg in got["subtask"][:2]:
            match = [u for u in subtasks if u.frame_index == msg.frame_index]
            assert len(match) == 1 and (msg.robot, msg.text) == ("", match[0].text)
            assert msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9 == pytest.approx(match[0].stamp, abs=1e-6)
        assert got["subtask"][0].frame_index < got["subtask"][1].frame_index

        assert service.wait_for_service(20)
        future = service.call_async(Interject.Request(text="put the cup away first"))
        until(future.done, "interjection reply")
        r = future.result()
        assert r.success and r.finish_reason in ("eos", "length"), r
        assert (r.plan, r.speech) == split_plan_and_say(r.reply)
        until(lambda: got["plan"], "plan on /oxygen/plan")
        assert (got["plan"][-1].text, got["plan"][-1].frame_index) == (r.plan, r.frame_index)
        state = engine.language_state("")
        assert (state["plan"], state["plan_frame"]) == (r.plan, r.frame_index)

        wrong = service.call_async(Interject.Request(text="stop", robot="arm_b"))
        until(wrong.done, "refusal")
        assert not wrong.result().success and "arm_b" in wrong.result().error

        node.language.put(SimpleNamespace(robot="arm_b", kind="subtask", text="not mine", frame_index=1, stamp=1.0))
        late = []
        client.create_subscription(LanguageUpdate, "/oxygen/subtask", late.append, qos_for("subtask"))
        engine.stop()
        newest = [u for u in updates if u.kind == "subtask"][-1]
        for _ in range(200):
            if late:
                break
            time.sleep(0.05)
        assert [(m.text, m.frame_index) for m in late] == [(newest.text, newest.frame_index)]
        assert all(m.text != "not mine" for m in got["subtask"])
    finally:
        engine.stop()
        executor.shutdown(timeout_sec=2.0)


def test_each_fleet_robot_publishes_its_own_language_in_its_namespace(ros, small_model, obs):
    """Two robots on one engine (joint format, each subtask decoded on its frame: deterministic): each robot's
    conversation node publishes that robot's updates only, on its own /<namespace>/oxygen/... topics, with
    the frame and stamp the engine's state gives; a robot whose camera is turned 180° gets its spatial
    answers turned back."""
    from rclpy.parameter import Parameter

    from oxygen_ros.engine.config import EngineConfig
    from oxygen_ros.engine.factory import build_engine
    from oxygen_ros.nodes.conversation_service import ConversationService
    from oxygen_ros.robot.policy_io import RobotIOConfig

    engine = build_engine(built_model=small_model, kv_budget_mb=8.0,
                          engine=EngineConfig(hierarchy="joint", subtask_sync=True, subtask_period_s=0.0,
                                              subtask_every_chunks=1, progress_memory=False),
                          robots={"arm_a": RobotIOConfig(robot_action_dim=7),
                                  "arm_b": RobotIOConfig(robot_action_dim=7, rotate_180=("base_0_rgb",))})
    nodes, sent = {}, {}
    for robot in ("arm_a", "arm_b"):
        params = [Parameter("loc_image_size", value=[200, 100])] if robot == "arm_b" else []
        node = nodes[robot] = ros.add(ConversationService(engine, robot=robot, namespace=f"/{robot}",
                                                          context=ros.context, parameter_overrides=params))
        for kind, pub in node.language_pubs.items():
            pub.publish = lambda msg, topic=pub.topic_name: sent.setdefault(topic, []).append(msg)
    for i in range(2):
        engine.run_frames({"arm_a": obs(10 + i, prompt="stack the cups"), "arm_b": obs(20 + i, prompt="open the door")})
        for node in nodes.values():
            node._publish_language()                  # what the guard condition runs on the executor
    assert set(sent) == {"/arm_a/oxygen/subtask", "/arm_b/oxygen/subtask"}, sorted(sent)
    for robot in ("arm_a", "arm_b"):
        msgs = sent[f"/{robot}/oxygen/subtask"]
        assert msgs and all(m.robot == robot for m in msgs)
        state = engine.language_state(robot)
        newest = msgs[-1]
        assert (newest.text, newest.frame_index) == (state["subtask"], state["subtask_frame"])
        assert newest.header.stamp.sec + newest.header.stamp.nanosec * 1e-9 == pytest.approx(state["subtask_stamp"])
    assert {m.frame_index for m in sent["/arm_a/oxygen/subtask"]}.isdisjoint(
        m.frame_index for m in sent["/arm_b/oxygen/subtask"])           # each robot's own frames
    (a,) = nodes["arm_a"].located("cup <loc0000><loc0000>")
    (b,) = nodes["arm_b"].located("cup <loc0000><loc0000>")
    assert list(a.pixels) == [] and list(b.pixels) == pytest.approx([200.0, 100.0])   # (0, 0) of a turned image


def test_the_openpi_reply_carries_the_subtask_that_conditioned_its_actions():
    import numpy as np

    from test_openpi_serve import base_engine, client, libero_obs, served

    base = base_engine("libero", hierarchy="joint", subtask_sync=True, subtask_period_s=0.0, subtask_every_chunks=1,
                       progress_memory=False)
    chunks = {}
    base.add_chunk_listener(lambda c: chunks.setdefault(c.plan.frame_index, c))
    rng = np.random.default_rng(0)
    with served("libero", base=base) as server:
        policy = client(server)
        replies = [policy.infer(libero_obs(rng)) for _ in range(2)]
        for reply in replies:                     # (the client's robot leaves the engine when it disconnects)
            chunk = chunks[reply["policy_timing"]["frame_index"]]
            assert reply["subtask"] == chunk.subtask and np.array_equal(reply["actions"], chunk.plan.actions)
        state = base.language_state(chunk.robot)
        assert replies[-1]["subtask"] == state["subtask"]              # sync: decoded on that very frame
    assert replies[0]["subtask"]                                          # joint + sync: the frame's own subtask


@pytest.mark.parametrize("hierarchy, request_fields, error", [
    ("off", dict(text="stop"), "interjections need hierarchical language"),
    ("joint", dict(text="   "), "interjection"),
    ("joint", dict(text="stop", timeout_s=float("nan")), "timeout_s"),
    ("joint", dict(text="stop", robot="arm_b"), "not 'arm_b'"),
])
def test_an_interjection_that_cannot_be_one_is_refused_with_why(ros, engine_factory, hierarchy, request_fields, error):
    from oxygen_interfaces.srv import Interject

    node = conversation(ros, engine_factory(hierarchy=hierarchy))
    reply = node._interject(Interject.Request(**request_fields)).result(timeout=5)
    response = node._fill_interjection(reply, "")
    assert not response.success and response.finish_reason == "refused" and error in response.error, response
    assert (response.plan, response.speech) == ("", "")
