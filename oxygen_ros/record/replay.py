"""Replay a recording through the engine and check that it computes the same thing: a regression tool
for anyone changing the model or the engine.

    oxygen_replay DIR_OR_FILES... [--json report.json]        (or python -m oxygen_ros.record.replay ...)

The engine is built from the recorded parameters (the metadata of the MCAP files: model, checkpoint,
seed...) exactly as the engine node builds it. Each recorded frame's observation (lossless PNG images,
state, task prompt) goes through the engine with that frame's noise (a function of the recorded seed and
the frame index, Engine.frame_noise), and the chunk must equal the recorded one bit for bit (float64
robot actions). Every recorded greedy reply is asked again on the frame it was answered from and must
match token count and text exactly, captions likewise. Same machine and dtype: identical; another
machine or dtype: the report shows how far apart. Exit code 0 when all identical, 1 otherwise, 2 when the
recording cannot be replayed (one line says why).

Real-time chunking (`rtc`, docs/rtc.md): each chunk continued the chunk delivered before it, with a delay
predicted from that run's timing; the chunk message records the delay (`rtc_delay_rows`) and, in a
recording, the chunk as the model output it (`model_actions`). Replay restores the recorded chunk before
each guided chunk as the one playing and computes the chunk with the recorded delay: every chunk is
checked on its own, from what was recorded. A guided chunk whose predecessor is not in the recording (the
first one after files rotated away) is skipped (`rtc_continues_unrecorded`).

Replies come from the conversation service's and the streaming action's introspection events.
Not replayed: sampled replies (temperature > 0: the service's per-request seed is not recorded),
replies that were cancelled, timed out or refused (they depend on timing).

A recording is data from elsewhere, read as such (record/reader.py): each topic replay uses has a fixed
message type here and a file whose schema says otherwise is refused (the schema name used to decide which
module was imported); a file cut short (the recording process was killed) is read up to its last whole
record; a file that does not parse is skipped with a line saying why, the others are replayed; wrong
shapes, undecodable or oversized images and parameters the engine node refuses (a pool larger than the
memory) end the replay with one line. Run with `python -m` from a directory you do not trust, Python
puts that directory first on the import path: this module drops it before importing anything else, but
the `oxygen_replay` command (or `python -P -m`) never adds it.
"""
import os
import sys

if __name__ == "__main__":
    # `python -m` put the working directory first on sys.path: a numpy.py shipped next to the recording
    # would run on the next import. Only the standard library's built-ins are imported above.
    sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]

import argparse  # noqa: E402
import json  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from rclpy.serialization import deserialize_message  # noqa: E402

from oxygen_ros.progress import LongTask  # noqa: E402
from oxygen_ros.robot.trajectory import NS_PER_S, stamp_to_seconds  # noqa: E402

from .bag import METADATA  # noqa: E402
from .msgdef import type_name  # noqa: E402
from .reader import McapFileError, read_file  # noqa: E402
from .recorder import LANGUAGE_TOPICS, OBSERVATION  # noqa: E402

COMPARABLE = ("eos", "length", "stop")        # finish reasons that do not depend on timing
REPLAYED_KINDS = ("subtask", "memory")        # the hierarchy's texts replay computes again (not interjections)
METADATA_KEYS = ("engine_params", "conversation_params", "camera_slots")


class RecordingError(ValueError):
    """The recording cannot be replayed: one line saying why."""


@dataclass
class Frame:
    index: int
    stamp_ns: int
    actions: np.ndarray                       # recorded chunk, robot units
    state: np.ndarray | None = None
    images: dict = field(default_factory=dict)
    prompt: str = ""
    questions: list = field(default_factory=list)    # (request msg, response msg) answered from this frame
    captions: list = field(default_factory=list)     # recorded caption texts of this frame
    subtask: str = ""                                # the subtask that conditioned the recorded chunk
    language: list = field(default_factory=list)     # (kind, text) the engine decoded from this frame
    rtc_delay_rows: int | None = None                # the delay RTC made the chunk with (None: plain)
    continues: "RecordedChunk | None" = None         # RTC: the recorded chunk it continued


@dataclass(frozen=True)
class RecordedChunk:
    """A chunk as recorded, with its observation's state: what the next chunk, guided, continued."""
    index: int
    stamp_ns: int
    step_period_s: float
    actions: np.ndarray                       # robot units
    model_actions: np.ndarray                 # float32, the model's normalised action space
    state: np.ndarray


@dataclass
class Recording:
    metadata: dict
    frames: list[Frame]
    skipped: dict
    streamed: int = 0                          # of the replies, how many were streaming goals
    files: dict = field(default_factory=dict)   # file name -> "read", "unfinished: ..." or "skipped: ..."


def message_type(topic: str):
    """The type replay reads `topic` as (the recorder's topics), or None: not needed for replay. Fixed here:
    nothing a file says decides which code runs."""
    from oxygen_interfaces.action import Converse as ConverseAction
    from oxygen_interfaces.msg import ActionChunk, Caption, LanguageUpdate
    from oxygen_interfaces.srv import Converse, Interject
    from sensor_msgs.msg import CompressedImage, JointState
    from std_msgs.msg import String

    if topic == f"{OBSERVATION}/state":
        return JointState
    if topic == f"{OBSERVATION}/prompt":
        return String
    if topic.startswith(f"{OBSERVATION}/") and topic.endswith("/compressed"):
        return CompressedImage
    if topic == "/oxygen/action_chunk":
        return ActionChunk
    if topic == "/oxygen/memory":
        return Caption
    if topic in LANGUAGE_TOPICS.values():
        return LanguageUpdate
    if topic.endswith("/interject/_service_event"):
        return Interject.Event
    if topic.endswith("/_action/send_goal/_service_event"):
        return ConverseAction.Impl.SendGoalService.Event
    if topic.endswith("/_action/get_result/_service_event"):
        return ConverseAction.Impl.GetResultService.Event
    if topic.endswith("/_action/cancel_goal/_service_event"):
        return None
    if topic.endswith("/_service_event"):
        return Converse.Event
    return None


def _stamp_ns(header) -> int:
    return header.stamp.sec * NS_PER_S + header.stamp.nanosec


def _files(paths: list[str]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.mcap"), key=_file_order)
        elif p.exists():
            files.append(p)
        else:
            raise RecordingError(f"{p}: no such file or directory")
    if not files:
        raise RecordingError(f"no .mcap file in {', '.join(paths)}")
    return files


def _file_order(path: Path):
    """oxygen_<start>_<n>.mcap in the order written (n numerically: _10 after _9)."""
    stem, _, n = path.stem.rpartition("_")
    return (stem, int(n)) if n.isdigit() else (path.stem, -1)


def _decoded(path: Path, contents) -> list[tuple[str, np.ndarray | None, object]]:
    """(topic, chunk actions or None, message) of the topics replay reads, each as its fixed type.
    RecordingError when a schema is not that type's, a message does not decode as it, or a chunk's
    shape does not match its values."""
    decoded = []
    for topic, schema, data in contents.messages:
        cls = message_type(topic)
        if cls is None:
            continue
        if schema != type_name(cls):
            raise RecordingError(f"{path}: topic {topic} has schema {schema!r}, the recorder writes "
                                 f"{type_name(cls)!r}: not an oxygen_ros recording's file")
        try:
            msg = deserialize_message(data, cls)
        except Exception as e:  # noqa: BLE001 - whatever the CDR decoder raises on bad bytes: one line
            raise RecordingError(f"{path}: a {topic} message does not decode as {type_name(cls)}: "
                                 f"{type(e).__name__}: {e}") from None
        decoded.append((topic, _actions(path, msg) if topic == "/oxygen/action_chunk" else None, msg))
    return decoded


def _actions(path: Path, msg) -> tuple[np.ndarray, np.ndarray | None]:
    """(robot actions, model actions or None) of a chunk message."""
    if msg.horizon * msg.dim != len(msg.actions) or msg.horizon == 0:
        raise RecordingError(f"{path}: /oxygen/action_chunk of frame {msg.frame_index} has {len(msg.actions)} "
                             f"values for horizon {msg.horizon} x dim {msg.dim}")
    if len(msg.model_actions) % msg.horizon:
        raise RecordingError(f"{path}: /oxygen/action_chunk of frame {msg.frame_index} has {len(msg.model_actions)} "
                             f"model action values, not a multiple of its horizon {msg.horizon}")
    model = np.array(msg.model_actions, dtype=np.float32).reshape(msg.horizon, -1) if len(msg.model_actions) else None
    return np.array(msg.actions, dtype=np.float64).reshape(msg.horizon, msg.dim), model


def _metadata(path: Path, record: dict[str, str]) -> dict:
    try:
        metadata = {k: json.loads(v) for k, v in record.items()}
    except ValueError as e:
        raise RecordingError(f"{path}: metadata '{METADATA}' is not JSON: {e}") from None
    missing = [k for k in METADATA_KEYS if k not in metadata]
    if missing or not isinstance(metadata["engine_params"], dict) or not isinstance(
            metadata["conversation_params"], dict) or not isinstance(metadata["camera_slots"], list):
        raise RecordingError(f"{path}: metadata '{METADATA}' lacks or mistypes {', '.join(missing or METADATA_KEYS)}")
    return metadata


def read_recording(paths: list[str], say=print) -> Recording:
    """Every readable file of `paths` (directories: their .mcap files in the order written). A file that
    does not parse is skipped and said so; one that ends early (the recorder was killed) is read up to
    its last whole record."""
    metadata: dict = {}
    chunks: dict[int, object] = {}           # frame index -> ActionChunk message
    states: dict[int, tuple[np.ndarray, str]] = {}
    images: dict[int, dict[str, object]] = {}
    requests: dict[tuple, object] = {}
    responses: list[tuple[tuple, object]] = []
    goals: dict[bytes, object] = {}                # streaming goals by goal id
    result_requests: dict[tuple, bytes] = {}       # get_result call -> goal id
    results: list[tuple[tuple, object]] = []
    captions: list = []
    language: list = []                             # (kind, LanguageUpdate)
    interjections = 0
    prompt = ""
    files: dict[str, str] = {}
    for path in _files(paths):
        try:
            contents = read_file(path)
            decoded = _decoded(path, contents)
            file_metadata = _metadata(path, contents.metadata[METADATA]) if METADATA in contents.metadata else None
        except (McapFileError, RecordingError) as e:
            files[path.name] = f"skipped: {e}"
            say(f"oxygen_replay: skipped {e}")
            continue
        files[path.name] = f"unfinished: {contents.unfinished}" if contents.unfinished else "read"
        if contents.unfinished:
            say(f"oxygen_replay: {path} is unfinished (its recorder was stopped abruptly): {contents.unfinished}; "
                f"read {len(contents.messages)} messages")
        if file_metadata is not None and not metadata:
            metadata = file_metadata
        for topic, actions, msg in decoded:
            if topic == f"{OBSERVATION}/prompt":
                prompt = msg.data
            elif topic == f"{OBSERVATION}/state":
                states[_stamp_ns(msg.header)] = (np.array(msg.position, dtype=np.float64), prompt)
            elif topic.startswith(OBSERVATION):
                images.setdefault(_stamp_ns(msg.header), {})[msg.header.frame_id] = msg
            elif topic == "/oxygen/action_chunk":
                chunks[msg.frame_index] = (msg, *actions)
            elif topic == "/oxygen/memory":
                captions.append(msg)
            elif topic in LANGUAGE_TOPICS.values():
                language.append((next(k for k, t in LANGUAGE_TOPICS.items() if t == topic), msg))
            elif topic.endswith("/interject/_service_event"):
                interjections += bool(msg.response)
            else:   # service event: request received / response sent, paired by client and sequence
                key = (bytes(msg.info.client_gid), msg.info.sequence_number)
                if topic.endswith("/_action/send_goal/_service_event"):
                    if msg.request:
                        goals[bytes(msg.request[0].goal_id.uuid)] = msg.request[0].goal
                elif topic.endswith("/_action/get_result/_service_event"):
                    if msg.request:
                        result_requests[key] = bytes(msg.request[0].goal_id.uuid)
                    if msg.response:
                        results.append((key, msg.response[0].result))
                else:
                    if msg.request:
                        requests[key] = msg.request[0]
                    if msg.response:
                        responses.append((key, msg.response[0]))
    if not metadata:
        raise RecordingError(f"{', '.join(paths)}: no readable file with '{METADATA}' metadata: not an oxygen_ros "
                             "recording" + "".join(f"; {name} {how}" for name, how in files.items() if how != "read"))
    # Streaming goals are the same question and answer (their goal and result have the service's fields).
    replied_goals = set()
    for key, result in results:
        goal_id = result_requests.get(key)
        if goal_id is not None and goal_id not in replied_goals:   # a client may ask for a result twice
            replied_goals.add(goal_id)
            requests[("goal", goal_id)] = goals.get(goal_id)
            responses.append((("goal", goal_id), result))
    frames, skipped = {}, {"no_observation": 0, "rtc_continues_unrecorded": 0, "reply_not_comparable": 0,
                           "reply_without_request": 0,
                           "reply_frame_not_recorded": 0, "caption_frame_not_recorded": 0,
                           "language_frame_not_recorded": 0, "interjections_not_replayed": interjections,
                           "unreadable_files": sum(how.startswith("skipped") for how in files.values()),
                           "unfinished_files": sum(how.startswith("unfinished") for how in files.values())}
    previous = None                                 # the chunk recorded before this one (RTC continued it)
    for index, (msg, actions, model_actions) in sorted(chunks.items()):
        stamp, delay, before = _stamp_ns(msg.header), msg.rtc_delay_rows or None, previous
        previous = (RecordedChunk(index, stamp, msg.step_period_s, actions, model_actions, states[stamp][0])
                    if stamp in states and model_actions is not None else None)
        if stamp not in states:
            skipped["no_observation"] += 1          # its observation was in a file rotated away
            continue
        if delay is not None and before is None:
            skipped["rtc_continues_unrecorded"] += 1    # it continued a chunk (or its observation) not recorded
            continue
        state, frame_prompt = states[stamp]
        frames[index] = Frame(index, stamp, actions, state, images.get(stamp, {}), frame_prompt,
                              rtc_delay_rows=delay, continues=before if delay is not None else None,
                              subtask=msg.subtask)
    streamed = 0
    for key, response in responses:
        request = requests.get(key)
        if request is None:         # its request was in a deleted file (or before the recording)
            skipped["reply_without_request"] += 1
        elif not (response.success and response.finish_reason in COMPARABLE and request.temperature == 0):
            skipped["reply_not_comparable"] += 1
        elif response.frame_index not in frames:
            skipped["reply_frame_not_recorded"] += 1
        else:
            frames[response.frame_index].questions.append((request, response))
            streamed += key[0] == "goal"
    for caption in captions:
        if caption.frame_index in frames:
            frames[caption.frame_index].captions.append(caption.text)
        else:
            skipped["caption_frame_not_recorded"] += 1
    for kind, update in language:
        if update.frame_index in frames:
            frames[update.frame_index].language.append((kind, update.text))
        else:
            skipped["language_frame_not_recorded"] += 1
    return Recording(metadata, [frames[i] for i in sorted(frames)], skipped, streamed, files)


def _seconds(stamp_ns: int) -> float:
    """A recorded stamp as the observation node reads a header (stamp_to_seconds): RTC aligns chunks by stamps."""
    return stamp_to_seconds(*divmod(stamp_ns, NS_PER_S))


def _chunk_result(chunk: RecordedChunk):
    from oxygen_ros.engine.engine import ChunkResult
    from oxygen_ros.robot.chunks import ActionChunkPlan

    return ChunkResult(ActionChunkPlan(chunk.actions, _seconds(chunk.stamp_ns), chunk.step_period_s, chunk.index),
                       chunk.model_actions, 0.0, 0)


def build_engine(engine_params: dict):
    """The engine exactly as the engine node builds it, from the recorded parameters (memory captions
    off: replay asks for the recorded ones itself)."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from oxygen_ros.nodes.engine_node import PARAMS, EngineNode

    params = dict(engine_params, memory_every_frames=0, memory_period_s=0.0)
    known = {p.name for p in PARAMS}
    try:      # the engine node's own parameters only, of types ROS can hold; the node checks their values
        overrides = [Parameter(k, value=v) for k, v in params.items() if k in known and v != []]
    except (TypeError, ValueError) as e:
        raise RecordingError(f"recorded engine parameters: {e}") from None
    context = Context()
    rclpy.init(context=context, args=["oxygen_replay"])
    node = EngineNode(context=context, parameter_overrides=overrides)
    try:
        node.trigger_configure()
        if node.engine is None:
            raise RecordingError("cannot build the recorded engine: " + "; ".join(node.failure.splitlines()))
        return node.engine
    finally:
        node.destroy_node()
        rclpy.shutdown(context=context)


def _conversation_params(recorded: dict) -> dict:
    """The recorded conversation settings replay uses, checked against the conversation node's bounds."""
    from oxygen_ros.nodes.conversation_service import PARAMS
    from oxygen_ros.nodes.params import problem

    specs = {p.name: p for p in PARAMS}
    values, problems = {}, []
    for name in ("session_turns", "max_sessions", "default_max_tokens"):
        value = recorded.get(name, specs[name].default)
        wrong = f"must be an integer, got {type(value).__name__}" if type(value) is not int else problem(specs[name], value)
        if wrong:
            problems.append(f"conversation_params.{name} = {value!r:.50}: {wrong}")
        values[name] = value
    if problems:
        raise RecordingError("recorded " + "; ".join(problems))
    return values


def replay(recording: Recording, engine=None, say=print) -> dict:
    from oxygen_ros.engine.requests import Sampling, TextRequest
    from oxygen_ros.engine.sessions import Sessions
    from oxygen_ros.robot.images import decode_compressed
    from oxygen_ros.robot.sync import Observation

    meta = recording.metadata
    conv = _conversation_params(meta["conversation_params"])
    slots = list(meta["camera_slots"])
    if not all(isinstance(slot, str) for slot in slots):
        raise RecordingError(f"recorded camera_slots {slots!r:.200}: a list of slot names")
    engine = engine or build_engine(meta["engine_params"])
    sessions = Sessions(conv["session_turns"], conv["max_sessions"], engine.info.max_question_chars)
    report = {"frames": len(recording.frames), "chunks_identical": 0, "chunks_different": [],
              "max_abs_action_diff": 0.0, "replies": 0, "replies_identical": 0, "replies_different": [],
              "streamed_replies": recording.streamed,
              "captions": 0, "captions_identical": 0, "captions_different": [],
              "language": 0, "language_identical": 0, "language_different": [], "skipped": recording.skipped}
    pending = []                                   # (kind, recorded, handle)
    replayed_language: dict[int, list] = {}        # the replay engine's frame index -> [(kind, text)]
    recorded_index: dict[int, int] = {}            # the replay engine's frame index -> the recorded frame's
    engine.add_language_listener(lambda u: u.kind in REPLAYED_KINDS and u.robot == ""
                                 and replayed_language.setdefault(u.frame_index, []).append((u.kind, u.text)))

    def ask(kind, text, max_tokens, recorded, session_id="", stop=()):
        question = sessions.question(session_id, text) if kind == "conversation" else text
        handle = engine.submit(TextRequest(question, max_tokens=max_tokens, sampling=Sampling(), stop=tuple(stop),
                                           timeout_s=engine.config.max_timeout_s, kind=kind, session_id=session_id))
        if session_id:
            handle.add_done_callback(lambda r: r.success and sessions.record(session_id, text, r.text))
        pending.append((kind, recorded, handle))

    with LongTask(f"replaying {len(recording.frames)} frames", say):
        for frame in recording.frames:
            for request, response in frame.questions:
                ask("conversation", request.text, request.max_tokens or conv["default_max_tokens"], response,
                    request.session_id, [s for s in request.stop if s])
            for text in frame.captions:
                ask("memory", engine.config.memory_prompt, engine.config.memory_max_tokens, text)
            images = {s: decode_compressed(m.format, m.data, name=s) if (m := frame.images.get(s)) else None
                      for s in slots}
            obs = Observation(_seconds(frame.stamp_ns), images, {s: images[s] is not None for s in slots},
                              frame.state, frame.prompt)
            before = engine.latest_chunk()
            engine.actions.replayed_delay = frame.rtc_delay_rows or 0       # as recorded; 0: plain
            if frame.continues is not None:                               # the recorded chunk it continued
                engine.actions.resume("", _chunk_result(frame.continues), frame.continues.state, engine.preparer)
            engine.run_cycle(obs, noise=engine.frame_noise(frame.index))
            chunk = engine.latest_chunk()
            if chunk is not None and chunk is not before:
                recorded_index[chunk.plan.frame_index] = frame.index
            got = chunk.plan.actions if chunk is not None and chunk is not before else None
            same_subtask = got is not None and chunk.subtask == frame.subtask      # what conditioned it
            if got is not None and got.shape == frame.actions.shape and np.array_equal(got, frame.actions) \
                    and same_subtask:
                report["chunks_identical"] += 1
            else:
                diff = float(np.max(np.abs(got - frame.actions))) if got is not None and \
                    got.shape == frame.actions.shape else float("inf")
                report["max_abs_action_diff"] = max(report["max_abs_action_diff"], diff)
                report["chunks_different"].append({"frame": frame.index, "max_abs_diff": diff} if same_subtask else {
                    "frame": frame.index, "max_abs_diff": diff, "subtask": frame.subtask,
                    "replayed_subtask": chunk.subtask if got is not None else None})
        for _ in range(100_000):     # decode what is still being generated (the hierarchy's own texts too)
            if all(h.done() for _, _, h in pending) and not engine.active_requests and not engine.queued_requests:
                break
            engine.run_cycle(None)
    for kind, recorded, handle in pending:
        reply = handle.result(timeout=0)
        if kind == "conversation":
            report["replies"] += 1
            same = reply.text == recorded.reply and len(reply.tokens) == recorded.tokens
            key, entry = "replies", {"frame": recorded.frame_index, "recorded": recorded.reply, "replayed": reply.text}
        else:
            report["captions"] += 1
            same = reply.text == recorded
            key, entry = "captions", {"recorded": recorded, "replayed": reply.text}
        if same:
            report[f"{key}_identical"] += 1
        else:
            report[f"{key}_different"].append(entry)
    # The hierarchy's own texts (subtask, progress memory), each on the frame it was decoded from.
    replayed = {recorded_index.get(i, -1 - i): texts for i, texts in replayed_language.items()}
    for frame in recording.frames:
        recorded = [(kind, text) for kind, text in frame.language if kind in REPLAYED_KINDS]
        again = replayed.pop(frame.index, [])
        report["language"] += len(recorded)
        if recorded == again:
            report["language_identical"] += len(recorded)
        else:
            report["language_different"].append({"frame": frame.index, "recorded": recorded, "replayed": again})
    report["language_different"] += [{"frame": i, "recorded": [], "replayed": again}
                                     for i, again in replayed.items() if i >= 0]
    report["identical"] = (not report["chunks_different"] and not report["replies_different"]
                           and not report["captions_different"] and not report["language_different"]
                           and report["frames"] > 0)
    return report


def summary(report: dict) -> str:
    verdict = "IDENTICAL" if report["identical"] else "DIFFERENT"
    skipped = ", ".join(f"{k} {v}" for k, v in report["skipped"].items() if v) or "none"
    return (f"replay {verdict}: chunks {report['chunks_identical']}/{report['frames']} bitwise identical "
            f"(max |diff| {report['max_abs_action_diff']:.3g}), replies {report['replies_identical']}/"
            f"{report['replies']}, captions {report['captions_identical']}/{report['captions']}, subtasks and "
            f"progress {report['language_identical']}/{report['language']}; skipped: {skipped}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oxygen_replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="recording directories or .mcap files")
    parser.add_argument("--json", help="write the full report here")
    args = parser.parse_args(argv)
    from oxygen_ros.robot.errors import InputError

    try:
        recording = read_recording(args.paths)
        report = replay(recording)
    except (RecordingError, McapFileError, InputError) as e:   # InputError: an image or state the engine refuses
        print(f"oxygen_replay: cannot replay: {e}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(summary(report), flush=True)
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
