"""Recording and replay: oxygen_bringup --demo --record DIR writes ROS 2 MCAP that a standard ROS 2 MCAP
decoder reads (mcap-ros2-support, as Foxglove does), bounded by rotation (small files here, the oldest
deleted); replaying what is left through the engine gives bitwise identical chunks and identical replies
and captions, and the replay notices a change (another noise seed, a different recorded reply)."""
import collections
import json
import time

import pytest
from mcap.reader import make_reader
from mcap_ros2.decoder import DecoderFactory
from rclpy.action import ActionClient
from rclpy.qos import QoSProfile
from rclpy.serialization import deserialize_message, serialize_message
from std_msgs.msg import String

from oxygen_ros.record.bag import METADATA, RotatingBag
from oxygen_ros.record.msgdef import resolve
from oxygen_ros.record.replay import read_recording, replay, summary
from oxygen_interfaces.action import Converse as ConverseAction
from oxygen_interfaces.srv import Converse
from ros_harness import Bringup, RosClient, private_domain

RECORDED = ["/diagnostics", "/oxygen/action", "/oxygen/action_chunk", "/oxygen/converse/_service_event",
            "/oxygen/converse_stream/_action/feedback", "/oxygen/converse_stream/_action/get_result/_service_event",
            "/oxygen/converse_stream/_action/send_goal/_service_event", "/oxygen/converse_stream/_action/status",
            "/oxygen/memory", "/oxygen/observation/base_0_rgb/compressed",   # the demo robot's one camera
            "/oxygen/observation/prompt", "/oxygen/observation/state",
            "/oxygen/prompt"]                                                 # the sim announces each task


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    out = tmp_path_factory.mktemp("bag")
    params = tmp_path_factory.mktemp("params") / "fast.yaml"
    params.write_text("oxygen_engine:\n  ros__parameters:\n    memory_period_s: 1.0\n"
                      "oxygen_recorder:\n  ros__parameters:\n    max_file_mb: 0.3\n    max_files: 3\n")
    domain = private_domain(31)
    bringup = Bringup(["--demo", "--record", str(out), "--params-file", str(params), "--status-period", "0"],
                      domain, timeout_s=16)
    client = RosClient(domain, "record_test")
    try:
        assert bringup.wait_for_line("oxygen_bringup: running", 90), bringup.output()
        cli = client.node.create_client(Converse, "/oxygen/converse", qos_profile=QoSProfile(depth=100))
        assert cli.wait_for_service(timeout_sec=30)
        stream = ActionClient(client.node, ConverseAction, "/oxygen/converse_stream")
        assert stream.wait_for_server(timeout_sec=30)
        asked = 0
        while bringup.proc.poll() is None:       # a question a second until the recording run ends
            if asked % 2:                         # every other one as a streaming goal (and its result asked for)
                goal = stream.send_goal_async(ConverseAction.Goal(text=f"streamed question {asked}?", max_tokens=8))
                goal.add_done_callback(lambda f: f.result().accepted and f.result().get_result_async())
            else:
                cli.call_async(Converse.Request(text=f"question {asked}?", max_tokens=8))
            asked += 1
            time.sleep(1.0)
    finally:
        client.close()
    assert bringup.proc.wait(90) == 0, bringup.output()
    bringup.stop()
    assert "recording closed" in bringup.output(), bringup.output()
    return out


def test_every_stream_is_recorded_and_decodes_as_ros2(recording):
    files = sorted(recording.glob("*.mcap"), key=lambda f: int(f.stem.rsplit("_", 1)[1]))
    assert len(files) == 3 and not files[0].stem.endswith("_0"), files      # rotated, the oldest deleted
    counts = collections.Counter()
    for path in files:
        decoders = DecoderFactory()        # per file: it caches decoders by schema id, and ids restart per file
        with open(path, "rb") as f:
            reader = make_reader(f)
            assert reader.get_header().profile == "ros2"
            meta = {m.name: m.metadata for m in reader.iter_metadata()}
            assert json.loads(meta[METADATA]["engine_params"])["model"] == "demo"   # every file stands alone
            topics = set()
            for schema, channel, message in reader.iter_messages():
                assert schema.encoding == "ros2msg" and channel.message_encoding == "cdr"
                counts[channel.topic] += 1
                topics.add(channel.topic)
                if "_" in schema.name.rsplit("/", 1)[1]:   # service events, action internals: the vendored
                    deserialize_message(message.data, resolve(schema.name))   # parser rejects '_' in type names
                else:
                    decoded = decoders.decoder_for("cdr", schema)(message.data)
                    if channel.topic == "/oxygen/observation/base_0_rgb/compressed":
                        assert decoded.format.endswith("png compressed bgr8") and decoded.data[1:4] == b"PNG"
            assert "/oxygen/observation/prompt" in topics                # the prompt is repeated in each file
    assert sorted(counts) == RECORDED, counts
    # A frame per chunk (the first kept chunk's observation may be in the deleted file).
    assert abs(counts["/oxygen/action_chunk"] - counts["/oxygen/observation/state"]) <= 1
    assert counts["/oxygen/observation/state"] > 10
    assert counts["/oxygen/converse/_service_event"] >= 2          # request and reply of a question
    assert counts["/oxygen/converse_stream/_action/send_goal/_service_event"] >= 2   # and of a streaming goal


def test_replay_is_bitwise_identical(recording):
    rec = read_recording([str(recording)])
    report = replay(rec)
    print(summary(report))
    assert report["identical"], summary(report)
    assert report["chunks_identical"] == report["frames"] > 10
    assert report["replies"] >= 2 and report["replies_identical"] == report["replies"]
    assert report["streamed_replies"] >= 1
    assert report["captions"] >= 2 and report["captions_identical"] == report["captions"]
    assert report["max_abs_action_diff"] == 0.0


def test_replay_notices_a_different_seed_or_reply(recording):
    rec = read_recording([str(recording)])
    rec.metadata["engine_params"]["seed"] += 1
    frame = next(f for f in rec.frames if f.questions)
    request, response = frame.questions[0]
    response.reply = response.reply + "!"
    rec.frames = rec.frames[: rec.frames.index(frame) + 1]
    report = replay(rec)
    assert not report["identical"]
    assert report["chunks_identical"] == 0 and report["max_abs_action_diff"] > 0
    assert len(report["replies_different"]) == 1


def test_rotation_bounds_the_recording(tmp_path):
    bag = RotatingBag(tmp_path, max_file_bytes=20_000, max_files=3, metadata={"engine_params": "{}"})
    payload = serialize_message(String(data="x" * 1000))
    for _ in range(200):
        bag.write("/t", String, payload)
    bag.close()
    files = sorted(tmp_path.glob("*.mcap"))
    assert len(files) == 3 and bag.deleted > 0
    assert all(f.stat().st_size < 20_000 + 4_000 for f in files)  # + the file's own records
    for f in files:                          # every file stands alone: readable, with the run's metadata
        with open(f, "rb") as stream:
            reader = make_reader(stream)
            assert [m.name for m in reader.iter_metadata()] == [METADATA]
            assert sum(1 for _ in reader.iter_messages()) > 0
