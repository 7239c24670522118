"""Recording and replay: oxygen_bringup --demo --record DIR writes ROS 2 MCAP that a standard ROS 2 MCAP
decoder reads (mcap-ros2-support, as Foxglove does), bounded by rotation (small files here, the oldest
deleted); replaying what is left through the engine gives bitwise identical chunks and identical replies
and captions, and the replay notices a change (another noise seed, a different recorded reply)."""
import collections
import json
import time

import numpy as np
import pytest
from mcap.reader import make_reader
from mcap_ros2.decoder import DecoderFactory
from rclpy.action import ActionClient
from rclpy.qos import QoSProfile
from rclpy.serialization import deserialize_message, serialize_message
from std_msgs.msg import String

from oxygen_ros.record.bag import METADATA, RotatingBag
from oxygen_ros.record.msgdef import resolve
from oxygen_ros.record.reader import read_file
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
    """A demo run recorded into 0.3 MB files (3 kept) while this process asks a question a second (every
    other one streamed). It runs until the recording has rotated (its first file deleted) and, after that,
    3 calls and 3 streams were answered and 6 s passed (the simulated robot repeats its task every 5 s):
    event-driven, so a loaded machine makes it longer, not different (bound: 150 s)."""
    out = tmp_path_factory.mktemp("bag")
    params = tmp_path_factory.mktemp("params") / "fast.yaml"
    params.write_text("oxygen_engine:\n  ros__parameters:\n    memory_period_s: 1.0\n"
                      "oxygen_recorder:\n  ros__parameters:\n    max_file_mb: 0.3\n    max_files: 3\n")
    domain = private_domain(31)
    bringup = Bringup(["--demo", "--record", str(out), "--params-file", str(params), "--status-period", "0"],
                      domain, timeout_s=200)
    client = RosClient(domain, "record_test")
    answered = collections.Counter()          # (kind, after the rotation) -> replies
    try:
        assert bringup.wait_for_line("oxygen_bringup: running", 90), bringup.output()
        cli = client.node.create_client(Converse, "/oxygen/converse", qos_profile=QoSProfile(depth=100))
        assert cli.wait_for_service(timeout_sec=30)
        stream = ActionClient(client.node, ConverseAction, "/oxygen/converse_stream")
        assert stream.wait_for_server(timeout_sec=30)
        rotated_at = None
        deadline = time.monotonic() + 150
        for asked in range(10_000):
            if rotated_at is None and any(out.glob("*.mcap")) and not any(out.glob("*_0.mcap")):
                rotated_at = time.monotonic()
            after = rotated_at is not None
            if after and answered["call", True] >= 3 and answered["stream", True] >= 3 \
                    and time.monotonic() - rotated_at > 6.0:
                break
            assert time.monotonic() < deadline and bringup.proc.poll() is None, (answered, bringup.output()[-3000:])
            if asked % 2:                         # every other one as a streaming goal (and its result asked for)
                goal = stream.send_goal_async(ConverseAction.Goal(text=f"streamed question {asked}?", max_tokens=8))
                goal.add_done_callback(lambda f, a=after: f.result().accepted and f.result().get_result_async()
                                       .add_done_callback(lambda _: answered.update([("stream", a)])))
            else:
                cli.call_async(Converse.Request(text=f"question {asked}?", max_tokens=8)).add_done_callback(
                    lambda _, a=after: answered.update([("call", a)]))
            time.sleep(1.0)
    finally:
        client.close()
        code = bringup.stop()
    assert code == 0, bringup.output()
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


# ------------------------------------------------------------------ the recorder under a stalled or full disk
def test_the_queue_is_bounded_in_bytes(engine_factory, tmp_path):
    """The disk stalls while frames of three 1280x720 cameras (8.3 MB each) arrive: the queue holds at most
    queue_mb of them, the rest are dropped and counted exactly; when the disk is back, what was queued is
    written, and the summary says what was dropped."""
    import threading

    import numpy as np
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from conftest import make_observation
    from oxygen_ros.record.recorder import Recorder

    context = Context()
    rclpy.init(context=context)
    engine = engine_factory()
    recorder = Recorder(engine, {"engine_params": {}}, {}, [f"j{i}" for i in range(8)], context=context,
                        parameter_overrides=[Parameter("path", value=str(tmp_path)),
                                             Parameter("queue_mb", value=20.0)])
    lines = []
    recorder.get_logger().info = lambda line, **kw: lines.append(line)
    disk = threading.Event()
    write = recorder.bag.write
    recorder.bag.write = lambda *a, **k: (disk.wait(), write(*a, **k))[1]     # the disk stalls
    frame_bytes = 3 * 1280 * 720 * 3
    try:
        for i in range(10):
            obs = make_observation(i)
            obs.images = {slot: np.full((720, 1280, 3), i, np.uint8) for slot in obs.images}
            obs.image_masks = dict.fromkeys(obs.images, True)
            engine.run_cycle(obs)
        # 20 MiB hold two frames; one more may be in the writer's hands (taken, waiting for the disk).
        assert recorder._queue.bytes <= 20 * (1 << 20)
        dropped = recorder.queue_full
        assert 10 - 3 <= dropped <= 10 - 20 * (1 << 20) // frame_bytes, dropped
    finally:
        disk.set()
        recorder.close()
        recorder.destroy_node()
        rclpy.shutdown(context=context)
    states = sum(1 for topic, _, _ in read_file(recorder.bag.files[0]).messages if topic.endswith("/state"))
    assert states == 10 - dropped, (states, dropped)      # every frame not dropped is in the file
    assert any(f"{dropped} dropped ({dropped} queue full, 0 write errors" in line for line in lines), lines


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real full disk (ENOSPC) without filling the machine's. Needs root (as CI runs)."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("a full disk is simulated with a tmpfs mount: needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(directory):
    """A file taking every free byte of the file system of `directory`; delete it to free the space."""
    blocker = directory / "blocker"
    with open(blocker, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return blocker


def indices(files) -> list[int]:
    """The message numbers (first 6 characters of each String) in `files`, read as replay reads them."""
    out = []
    for path in files:
        for _, _, data in read_file(path).messages:
            out.append(int(deserialize_message(data, String).data[:6]))
    return out


def test_a_full_disk_during_a_file_change_recovers_with_an_exact_dropped_count(small_disk):
    """The disk fills while the file in progress is being finished (its last chunk and summary cannot be
    written): the file is cut back to its last flush (readable), what was not flushed is counted dropped,
    and once space returns the recording goes on in a new file; nothing counted as written is lost."""
    import random

    from conftest import SimClock

    clock, logged = SimClock(), []
    bag = RotatingBag(small_disk, max_file_bytes=100_000, max_files=50, metadata={"engine_params": "{}"},
                      retry_s=1.0, clock=clock, log=lambda is_error, line: logged.append(line))
    rng = random.Random(0)
    written = 0

    def write(n):
        nonlocal written
        for _ in range(n):
            text = f"{written:06d}" + "".join(rng.choice("0123456789abcdef") for _ in range(4000))
            bag.write("/t", String, serialize_message(String(data=text)))
            written += 1
            if written % 10 == 0:
                bag.flush()                          # as the recorder does every flush_period_s

    while bag._file_bytes < bag.max_file_bytes:      # the next message starts a new file
        write(1)
    bag.flush()
    write(7)                                         # pending in the writer, not flushed
    blocker = fill(small_disk)
    write(30)                                        # the file change fails, then no file can be opened
    assert bag.failing and bag.write_errors >= 1 and "No space left" in bag.last_error
    assert bag.dropped >= 30 and any("dropped" in line for line in logged)
    blocker.unlink()                                  # space returns
    clock.advance(1.0)
    before = written
    write(200)
    assert not bag.failing
    bag.close()
    read = indices(bag.files)
    assert len(read) == bag.messages and len(set(read)) == len(read)
    assert bag.messages + bag.dropped == written, (bag.messages, bag.dropped, written)
    assert set(range(before, written)) <= set(read)               # 200 of 200 after space returned
    assert any("recording again" in line for line in logged), logged


def test_close_on_a_full_disk_is_logged_and_summarised(engine_factory, small_disk):
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from conftest import make_observation
    from oxygen_ros.record.recorder import Recorder

    context = Context()
    rclpy.init(context=context)
    engine = engine_factory()
    recorder = Recorder(engine, {"engine_params": {}}, {}, [f"j{i}" for i in range(8)], context=context,
                        parameter_overrides=[Parameter("path", value=str(small_disk))])
    lines = []
    recorder.get_logger().info = lambda line, **kw: lines.append(("info", line))
    recorder.get_logger().error = lambda line, **kw: lines.append(("error", line))
    try:
        for i in range(5):
            engine.run_cycle(make_observation(i))
        assert wait_until(lambda: not len(recorder._queue), 10)
        fill(small_disk)
        recorder.close()                    # must not raise: it runs inside the lifecycle's cleanup
    finally:
        recorder.destroy_node()
        rclpy.shutdown(context=context)
    errors = [line for level, line in lines if level == "error"]
    assert any("closing failed" in line and "No space left" in line for line in errors), lines
    summary_line = [line for level, line in lines if line.startswith("recording closed")]
    assert summary_line and "write errors" in summary_line[0], lines
    read = read_file(recorder.bag.files[-1])
    assert read.unfinished and recorder.bag.messages == len(read.messages)


def test_a_flush_bounds_what_a_crash_loses(tmp_path):
    """What a SIGKILL leaves: the file as the OS has it. Everything up to the last flush is readable."""
    bag = RotatingBag(tmp_path, max_file_bytes=10**9, max_files=3, metadata={"engine_params": "{}"})
    for i in range(50):
        bag.write("/t", String, serialize_message(String(data=f"{i:06d}" + "x" * 500)))
    bag.flush()
    for i in range(50, 60):
        bag.write("/t", String, serialize_message(String(data=f"{i:06d}" + "x" * 500)))
    killed = tmp_path / "killed.mcap"
    killed.write_bytes(bag.files[0].read_bytes())        # the process dies here: no close, no flush
    read = read_file(killed)
    assert read.unfinished and [int(deserialize_message(d, String).data[:6]) for _, _, d in read.messages] == \
        list(range(50))
    bag.close()


# ------------------------------------------------------------------ replay with real-time chunking
def test_a_recording_with_real_time_chunking_replays_bitwise(tmp_path):
    """With `rtc` on, each chunk continues the chunk delivered before it, with a delay predicted from the
    run's timing: the chunk message records that delay and the model's chunk, and replay recomputes each
    chunk with the recorded delay after restoring the recorded chunk before it, bit for bit. A wrong
    recorded delay gives another chunk, that one only (each chunk is checked from what was recorded); a
    recording whose first file rotated away skips only the chunk that continued an unrecorded one."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from conftest import make_observation
    from oxygen_interfaces.msg import ActionChunk
    from oxygen_ros.record.recorder import Recorder
    from oxygen_ros.record.replay import build_engine
    from oxygen_ros.robot.trajectory import stamp_to_seconds

    params = {"model": "tiny", "torch_threads": 1, "rtc": True, "max_active_requests": 1}
    engine = build_engine(params)                    # as the engine node builds it (and replay will)
    context = Context()
    rclpy.init(context=context)
    metadata = dict(TINY, engine_params=params)
    recorder = Recorder(engine, metadata, {}, [f"j{i}" for i in range(7)], context=context,
                        parameter_overrides=[Parameter("path", value=str(tmp_path)),
                                             Parameter("max_file_mb", value=0.1)])   # ~2 frames a file
    try:
        for i in range(12):
            obs = make_observation(i)
            ns = round(i * 2e9 / 70)                 # two rows of the 70 Hz chunk apart: each continues the last
            obs.stamp_s = stamp_to_seconds(*divmod(ns, 10**9))   # as the observation node reads a header
            if i == 8:
                engine.actions.forget()              # the safe stop: nothing to continue, a plain chunk
            engine.run_cycle(obs)
    finally:
        recorder.close()
        recorder.destroy_node()
        rclpy.shutdown(context=context)
    rec = read_recording([str(tmp_path)])
    delays = [f.rtc_delay_rows for f in rec.frames]
    assert len(delays) == 12 and delays[0] is None and delays[8] is None
    assert all(d is not None and d >= 1 for d in delays[1:8] + delays[9:]), delays
    assert [f.continues.index if f.continues else None for f in rec.frames] == [
        None, 0, 1, 2, 3, 4, 5, 6, None, 8, 9, 10]
    assert all(f.continues.model_actions.dtype == np.float32 for f in rec.frames if f.continues)
    report = replay(rec)
    assert report["identical"] and report["chunks_identical"] == 12, summary(report)

    rec = read_recording([str(tmp_path)])
    d = rec.frames[3].rtc_delay_rows                 # recorded with another delay: another chunk, that one only
    rec.frames[3].rtc_delay_rows = 1 if d > 2 else d + 2     # (a delay past the playing chunk's rows pins them all)
    report = replay(rec)
    assert [d["frame"] for d in report["chunks_different"]] == [rec.frames[3].index], summary(report)
    rec = read_recording([str(tmp_path)])
    rec.frames[3].continues.model_actions[:] += 0.1     # it continued another chunk: another chunk
    assert [d["frame"] for d in replay(rec)["chunks_different"]] == [rec.frames[3].index]

    files = sorted(tmp_path.glob("*.mcap"), key=lambda f: int(f.stem.rsplit("_", 1)[1]))
    first_file_frames = {i for topic, _, data in read_file(files[0]).messages if topic == "/oxygen/action_chunk"
                         for i in [deserialize_message(data, ActionChunk).frame_index]}
    assert len(files) > 2 and 0 < max(first_file_frames) < 5, (files, first_file_frames)
    files[0].unlink()                                # rotated away: the next chunk continued an unrecorded one
    rec = read_recording([str(tmp_path)])
    first = rec.frames[0].index                      # the first whose predecessor (chunk and observation) is there
    lost = rec.skipped["rtc_continues_unrecorded"] + rec.skipped["no_observation"]
    assert rec.skipped["rtc_continues_unrecorded"] == 1 and lost <= 2, rec.skipped
    assert first == max(first_file_frames) + 1 + lost and first < 8, (first, rec.skipped)
    assert [f.index for f in rec.frames] == list(range(first, 12)) and rec.frames[0].rtc_delay_rows is not None
    report = replay(rec)
    assert report["identical"] and report["chunks_identical"] == 12 - first, summary(report)


# ------------------------------------------------------------------ replay of killed, broken and hostile files
def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture(scope="module")
def killed_recording(tmp_path_factory):
    """A demo recording whose process was killed (SIGKILL) mid-run: its last file has no summary."""
    import signal

    out = tmp_path_factory.mktemp("killed")
    domain = private_domain(32)
    bringup = Bringup(["--demo", "--record", str(out), "--status-period", "0"], domain, timeout_s=60)
    assert bringup.wait_for_line("oxygen_bringup: running", 90), bringup.output()
    assert bringup.wait_for_line("[converse]", 60), bringup.output()       # a question answered, recorded
    time.sleep(3.0)
    killed_at = time.time_ns()
    bringup.proc.send_signal(signal.SIGKILL)
    bringup.proc.wait(10)
    bringup.stop()
    return out, killed_at


def test_replay_reads_a_recording_whose_process_was_killed(killed_recording):
    directory, _ = killed_recording
    (directory / "garbage.mcap").write_bytes(b"\x89MCAP0\r\n" + bytes(range(256)) * 40)   # one bad file
    said = []
    rec = read_recording([str(directory)], say=said.append)
    assert rec.skipped["unfinished_files"] == 1 and rec.skipped["unreadable_files"] == 1, rec.files
    assert any("unfinished" in line for line in said) and any("skipped" in line and "garbage" in line for line in said)
    report = replay(rec)
    print(summary(report))
    assert report["identical"] and report["frames"] > 10, summary(report)
    assert report["replies"] >= 1


@pytest.mark.timing
def test_a_killed_recording_loses_at_most_the_flush_period(killed_recording):
    """flush_period_s (2 s) + slack for the writer thread on a loaded machine."""
    from sensor_msgs.msg import JointState

    directory, killed_at = killed_recording
    (path,) = [p for p in directory.glob("oxygen_*.mcap")]
    stamps = []
    for topic, _, data in read_file(path).messages:
        if topic == "/oxygen/observation/state":
            msg = deserialize_message(data, JointState)
            stamps.append(msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec)
    lost_s = (killed_at - max(stamps)) / 1e9
    print(f"the last recorded observation is {lost_s:.2f} s older than the kill")
    assert lost_s < 2.0 + 2.0, lost_s


TINY = {"engine_params": {"model": "tiny", "torch_threads": 1},
        "conversation_params": {"session_turns": 4, "max_sessions": 100, "default_max_tokens": 8},
        "camera_slots": ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]}


def hostile(path, messages=(), metadata=TINY, schema_names=None):
    """An MCAP file written as an attacker would: `messages` are (topic, message); `schema_names` may give
    a topic another schema name than its type's."""
    from mcap.well_known import MessageEncoding, Profile, SchemaEncoding
    from mcap.writer import Writer

    from oxygen_ros.record.msgdef import message_definition, type_name

    with open(path, "wb") as f:
        writer = Writer(f)
        writer.start(profile=Profile.ROS2)
        writer.add_metadata(METADATA, {k: json.dumps(v) for k, v in metadata.items()})
        channels = {}
        for i, (topic, msg) in enumerate(messages):
            if topic not in channels:
                name = (schema_names or {}).get(topic, type_name(type(msg)))
                schema = writer.register_schema(name, SchemaEncoding.ROS2, message_definition(type(msg)).encode())
                channels[topic] = writer.register_channel(topic, MessageEncoding.CDR, schema)
            writer.add_message(channels[topic], log_time=i, publish_time=i, data=serialize_message(msg))
        writer.finish()
    return path


def frame_messages(image_data=None, horizon=5, dim=7, values=None, model_values=()):
    """One frame as the recorder writes it: a camera image, the state, the chunk."""
    import cv2
    import numpy as np
    from sensor_msgs.msg import CompressedImage, JointState

    from oxygen_interfaces.msg import ActionChunk

    if image_data is None:
        image_data = cv2.imencode(".png", np.zeros((224, 224, 3), np.uint8))[1].tobytes()
    image = CompressedImage(format="rgb8; png compressed bgr8", data=image_data)
    image.header.stamp.sec, image.header.frame_id = 100, "base_0_rgb"
    state = JointState(position=[0.0] * 8)
    state.header.stamp.sec = 100
    chunk = ActionChunk(frame_index=1, horizon=horizon, dim=dim,
                        actions=values if values is not None else [0.0] * (horizon * dim), model_actions=model_values)
    chunk.header.stamp.sec = 100
    return [("/oxygen/observation/prompt", String(data="pick up the cup")),
            ("/oxygen/observation/base_0_rgb/compressed", image), ("/oxygen/observation/state", state),
            ("/oxygen/action_chunk", chunk)]


def run_replay(capsys, *paths) -> tuple[int, str]:
    from oxygen_ros.record.replay import main

    code = main([str(p) for p in paths])
    return code, capsys.readouterr().err


def huge_png_header() -> bytes:
    """A PNG whose header says 12,000 x 12,000 pixels (432 MB decoded), with no pixels at all."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 12_000, 12_000, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 100))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("case", ["truncated", "wrong_shape", "wrong_model_shape", "huge_image", "huge_pool", "huge_record",
                                  "chunk_bomb", "bad_metadata", "not_mcap"])
def test_a_hostile_recording_gives_one_line(case, tmp_path, capsys):
    import struct

    path = tmp_path / "hostile.mcap"
    expected = {
        "truncated": "not an oxygen_ros recording",
        "wrong_shape": "has 5 values for horizon 1000 x dim 1000",
        "wrong_model_shape": "has 7 model action values, not a multiple of its horizon 5",
        "huge_image": "size 12000x12000 exceeds the limit",
        "huge_pool": "kv_budget_mb = 102400: more than the cpu memory free now",
        "huge_record": "not an oxygen_ros recording",
        "chunk_bomb": "a chunk says it holds 107374182400 bytes",
        "bad_metadata": "conversation_params.session_turns = -3",
        "not_mcap": "not an MCAP file",
    }[case]
    if case == "truncated":                      # cut inside its first records: no metadata survives
        data = hostile(tmp_path / "whole.mcap", frame_messages()).read_bytes()
        path.write_bytes(data[:40])
    elif case == "wrong_shape":
        hostile(path, frame_messages(horizon=1000, dim=1000, values=[0.0] * 5))
    elif case == "wrong_model_shape":
        hostile(path, frame_messages(model_values=[0.0] * 7))
    elif case == "huge_image":
        hostile(path, frame_messages(image_data=huge_png_header()))
    elif case == "huge_pool":
        hostile(path, frame_messages(), metadata=dict(TINY, engine_params={"model": "tiny", "kv_budget_mb": 102400.0}))
    elif case in ("huge_record", "chunk_bomb"):  # a header, then a record of 1 TB or a chunk of 100 GB
        from mcap.data_stream import RecordBuilder
        from mcap.records import Chunk, Header

        builder = RecordBuilder()
        Header(profile="ros2", library="attacker").write(builder)
        if case == "chunk_bomb":
            Chunk(compression="zstd", data=b"\0" * 64, message_start_time=0, message_end_time=0, uncompressed_crc=0,
                  uncompressed_size=100 << 30).write(builder)
        tail = struct.pack("<BQ", 6, 1 << 40) + b"\0" * 100 if case == "huge_record" else b""
        path.write_bytes(b"\x89MCAP0\r\n" + builder.end() + tail)
    elif case == "bad_metadata":
        hostile(path, frame_messages(), metadata=dict(TINY, conversation_params={"session_turns": -3}))
    else:
        path.write_bytes(b"#!/bin/sh\necho not a recording\n")
    code, err = run_replay(capsys, path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert expected in err, err


def test_replay_never_imports_what_a_file_names(tmp_path, capsys, monkeypatch):
    """The schema name used to choose the module replay imported (`import this` ran)."""
    package = tmp_path / "site" / "evilpkg"
    (package / "msg").mkdir(parents=True)
    marker = tmp_path / "imported"
    for module in (package / "__init__.py", package / "msg" / "__init__.py"):
        module.write_text(f"open({str(marker)!r}, 'w').write('ran')\nclass String: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    path = hostile(tmp_path / "r.mcap", frame_messages(),
                   schema_names={"/oxygen/observation/prompt": "evilpkg/msg/String"})
    code, err = run_replay(capsys, path)
    assert not marker.exists(), "replay imported a module a file named"
    assert code == 2 and "schema 'evilpkg/msg/String'" in err and "'std_msgs/msg/String'" in err, err


def test_replay_from_a_directory_of_untrusted_files_runs_none_of_them(tmp_path):
    """`python -m` puts the working directory first on the import path: .py files shipped next to a
    recording must not run, whichever way replay is started."""
    import subprocess
    import sys
    from pathlib import Path

    marker = tmp_path / "ran"
    for name in ("numpy", "json", "mcap", "argparse", "rclpy", "yaml"):
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + ' ')\n")
    hostile(tmp_path / "r.mcap", frame_messages(horizon=1000, dim=1000, values=[0.0] * 5))
    replay_cmd = Path(sys.executable).parent / "oxygen_replay"
    for command in ([sys.executable, "-m", "oxygen_ros.record.replay", "."], [str(replay_cmd), "."]):
        r = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert not marker.exists(), f"{command}: ran {marker.read_text()}"
        assert r.returncode == 2 and "has 5 values for horizon 1000 x dim 1000" in r.stderr, r.stderr[-2000:]


def test_a_hierarchical_recording_replays_its_subtasks_and_progress(tmp_path):
    """The hierarchy on (joint format, each subtask decoded on its frame, serially: a run replay can repeat):
    the recording holds every subtask and progress memory on its topic with the frame it came from, and each
    chunk the subtask it was conditioned on; replay computes them again, identical, and notices a recorded
    subtask or progress memory that differs."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from conftest import make_observation
    from oxygen_interfaces.msg import LanguageUpdate
    from oxygen_ros.record.recorder import Recorder
    from oxygen_ros.record.replay import build_engine

    params = {"model": "tiny", "torch_threads": 1, "hierarchy": "joint", "subtask_sync": True,
              "subtask_period_s": 0.0, "subtask_every_chunks": 2, "progress_memory": True}
    engine = build_engine(params)
    context = Context()
    rclpy.init(context=context)
    recorder = Recorder(engine, dict(TINY, engine_params=params), {}, [f"j{i}" for i in range(7)], context=context,
                        parameter_overrides=[Parameter("path", value=str(tmp_path))])
    try:
        for i in range(5):
            engine.run_cycle(make_observation(i, prompt="stack the cups"))
        for _ in range(400):                          # the progress memory asked on the last change: decoded
            if not engine.active_requests and not engine.queued_requests:
                break
            engine.run_cycle(None)
    finally:
        recorder.close()
        recorder.destroy_node()
        rclpy.shutdown(context=context)
    topics = collections.Counter(topic for path in tmp_path.glob("*.mcap") for topic, _, _ in read_file(path).messages)
    assert topics["/oxygen/subtask"] >= 1 and topics["/oxygen/action_chunk"] == 5, topics
    rec = read_recording([str(tmp_path)])
    subtasks = [(f.index, text) for f in rec.frames for kind, text in f.language if kind == "subtask"]
    assert subtasks and subtasks[0][0] == rec.frames[0].index         # due at once: decoded on the first frame
    assert rec.frames[0].subtask == subtasks[0][1]                     # and its chunk was conditioned on it
    memories = [text for f in rec.frames for kind, text in f.language if kind == "memory"]
    report = replay(rec)
    assert report["identical"], (summary(report), report["language_different"])
    assert report["chunks_identical"] == 5 and report["language"] == len(subtasks) + len(memories)
    assert report["language_identical"] == report["language"]

    rec = read_recording([str(tmp_path)])
    frame = next(f for f in rec.frames if f.language)
    frame.language[0] = (frame.language[0][0], frame.language[0][1] + " again")
    rec.frames[1].subtask += " (not what conditioned it)"
    report = replay(rec)
    assert not report["identical"]
    assert [d["frame"] for d in report["language_different"]] == [frame.index], summary(report)
    assert [d["frame"] for d in report["chunks_different"]] == [rec.frames[1].index]
    assert report["chunks_different"][0]["max_abs_diff"] == 0.0       # the actions are the same: the subtask is not
