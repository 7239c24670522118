"""Recorder: the run as ROS 2 MCAP (bag.py), on with `oxygen_bringup --record DIR` or the `path` parameter.

What it stores:
  from the engine, in-process (exactly what was computed, every frame, even when no subscriber was fast
  enough): the observation of each frame (`/oxygen/observation/<slot>/compressed`, lossless PNG;
  `/oxygen/observation/state`, JointState with the observation stamp; `/oxygen/observation/prompt` when
  it changes), each action chunk (`/oxygen/action_chunk`, with the subtask that conditioned it) and each
  text of the hierarchical policy as the engine made it (`/oxygen/subtask`, `/oxygen/progress`,
  `/oxygen/plan`, `/oxygen/speech`: LanguageUpdate, the same messages the conversation service publishes);
  from DDS, raw (the serialised bytes as published): the commands, captions, task prompt, /diagnostics,
  the conversation and interjection services' requests and replies (service introspection events, as
  `ros2 bag record --all-services` stores them) and the streaming action's feedback and status.
Engine-thread callbacks only enqueue; PNG encoding and writing run on the recorder's own thread. The
queue is bounded in bytes (`queue_mb`; a frame counts its raw images): when the disk stalls, memory grows
by at most that much, then new messages are dropped and counted, and the engine is never blocked. (It was
bounded in messages: 2,000 frames of three 1280x720 cameras would have been 16 GB.) The file is flushed
every `flush_period_s`, so a crash of the process loses at most that much of what was written, plus what
was still queued. Write errors (a full disk) are survived: see bag.py. `close` never raises: what went
wrong is logged, and the summary line ("recording closed: ... dropped") is always written.
"""
from __future__ import annotations

import collections
import json
import threading
import time

import cv2
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rclpy.serialization import serialize_message
from sensor_msgs.msg import CompressedImage, JointState
from std_msgs.msg import String

from oxygen_ros.nodes.action_output import chunk_message, ros_time
from oxygen_ros.nodes.engine_node import status
from oxygen_ros.nodes.params import Param, ParameterError, declare_all

from .bag import RotatingBag

PARAMS = [
    Param("path", "", "Directory the recording goes to (MCAP files). Empty: no recording."),
    Param("max_file_mb", 512.0, "A new file starts when the current one reaches this size (MB).", minimum=0.1),
    Param("max_files", 20, "Files kept; the oldest is deleted beyond this (bounds the disk used).", minimum=1),
    Param("queue_mb", 256.0, "Memory the messages waiting to be written may take (MiB; a frame counts its raw "
                             "camera images); beyond it new ones are dropped and counted.", minimum=1.0, maximum=65536.0),
    Param("flush_period_s", 2.0, "Seconds between flushes to the file: the most a crash of the process loses of "
                                 "what was written (compression works per flushed chunk).", minimum=0.1, maximum=60.0),
]
OBSERVATION = "/oxygen/observation"
# The single robot's language topics (the conversation service's defaults), by LanguageUpdate kind.
LANGUAGE_TOPICS = {"subtask": "/oxygen/subtask", "memory": "/oxygen/progress", "plan": "/oxygen/plan",
                   "speech": "/oxygen/speech"}
PNG_FORMAT = "rgb8; png compressed bgr8"


class ByteQueue:
    """A FIFO bounded in bytes; `put` never blocks (False: it would pass the bound, the item is not taken)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: collections.deque = collections.deque()
        self._ready = threading.Condition()

    def put(self, item, size: int) -> bool:
        with self._ready:
            if self.bytes + size > self.max_bytes:
                return False
            self._items.append((item, size))
            self.bytes += size
            self._ready.notify()
            return True

    def get(self, timeout: float):
        """The oldest item, or None after `timeout` seconds without one."""
        with self._ready:
            if not self._items and not self._ready.wait_for(lambda: self._items, timeout):
                return None
            item, size = self._items.popleft()
            self.bytes -= size
            return item

    def __len__(self) -> int:
        return len(self._items)


def item_bytes(item) -> int:
    """What a queued item keeps in memory (its payload; a frame: its raw images and state)."""
    kind = item[0]
    if kind == "raw":
        return len(item[3])
    if kind == "chunk":
        return item[1].plan.actions.nbytes
    if kind == "language":
        return len(item[1].text)
    obs = item[2]
    return sum(image.nbytes for image in obs.images.values() if image is not None) + obs.state.nbytes


class Recorder(Node):
    def __init__(self, engine, metadata: dict, raw_topics: dict, joint_names: list[str], **node_kwargs):
        super().__init__("oxygen_recorder", **node_kwargs)
        self.p, problems = declare_all(self, PARAMS)
        if problems:
            raise ParameterError("\n".join(problems))
        self.enabled = bool(self.p["path"])
        self.bag: RotatingBag | None = None
        self.queue_full = 0                 # dropped: the queue held queue_mb
        self.failed = 0                     # dropped: could not be converted (a bug's, not the disk's)
        if not self.enabled:
            return
        self.joint_names = list(joint_names)
        self._with_model_actions = engine.config.rtc    # what replay restores for the next chunk to continue
        self._prompt = None
        self._queue = ByteQueue(int(self.p["queue_mb"] * (1 << 20)))
        self._closed = False
        try:
            self.bag = RotatingBag(self.p["path"], int(self.p["max_file_mb"] * 1e6), self.p["max_files"],
                                   {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()},
                                   on_new_file=self._rewrite_latched, log=self._log_bag)
        except OSError as e:
            raise ParameterError(f"oxygen_recorder.path {self.p['path']!r}: cannot record there: {e}") from None
        qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        for topic, msg_type in raw_topics.items():
            self.create_subscription(msg_type, topic, lambda data, t=topic, m=msg_type: self._put(("raw", t, m, data)),
                                     qos, raw=True)
        engine.add_frame_listener(lambda index, obs: self._put(("frame", index, obs)))
        engine.add_chunk_listener(lambda chunk: self._put(("chunk", chunk)))
        engine.add_language_listener(lambda update: update.robot == "" and self._put(("language", update)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="oxygen-recorder", daemon=True)
        self._thread.start()
        self.get_logger().info(f"recording to {self.p['path']} (files of {self.p['max_file_mb']:g} MB, "
                               f"at most {self.p['max_files']}; flushed every {self.p['flush_period_s']:g} s)")

    @property
    def dropped(self) -> int:
        """Messages that are in no file: the queue was full, a write failed, or conversion failed."""
        return self.queue_full + self.failed + (self.bag.dropped if self.bag else 0)

    def _log_bag(self, is_error: bool, line: str) -> None:
        if is_error:
            self.get_logger().error(line, throttle_duration_sec=5.0)
        else:
            self.get_logger().warning(line)

    # any thread: never blocks
    def _put(self, item) -> None:
        if not self._queue.put(item, item_bytes(item)):
            self.queue_full += 1

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        period = self.p["flush_period_s"]
        next_flush = time.monotonic() + period
        while not (self._stop.is_set() and not len(self._queue)):
            item = self._queue.get(timeout=max(min(0.1, next_flush - time.monotonic()), 0.0))
            if item is not None:
                try:
                    self._write(item)
                except Exception as e:  # noqa: BLE001 - a message that cannot be converted must not end the recording
                    self.failed += 1
                    self.get_logger().error(f"recording: {type(e).__name__}: {e}", throttle_duration_sec=5.0)
            if time.monotonic() >= next_flush:
                self.bag.flush()
                next_flush = time.monotonic() + period

    def _write(self, item) -> None:
        kind = item[0]
        if kind == "raw":
            _, topic, msg_type, data = item
            self.bag.write(topic, msg_type, data)
        elif kind == "chunk":
            chunk = item[1]
            msg = chunk_message(chunk.plan, self.joint_names, chunk.compute_s, chunk.rtc_delay_rows,
                                chunk.model_actions if self._with_model_actions else None)
            msg.subtask = chunk.subtask
            self.bag.write("/oxygen/action_chunk", type(msg), serialize_message(msg))
        elif kind == "language":
            self._write_language(item[1])
        else:
            self._write_observation(item[2])

    def _write_observation(self, obs) -> None:
        stamp = ros_time(obs.stamp_s)
        if obs.prompt != self._prompt:
            self._prompt = obs.prompt
            self._rewrite_latched()
        first = True                              # only the frame's first part may start a new file
        for slot, image in obs.images.items():
            if image is None:
                continue                          # a masked slot: no message for this frame
            ok, png = cv2.imencode(".png", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
            msg = CompressedImage(format=PNG_FORMAT, data=png.tobytes())
            msg.header.stamp, msg.header.frame_id = stamp, slot
            self.bag.write(f"{OBSERVATION}/{slot}/compressed", CompressedImage, serialize_message(msg), rotate=first)
            first = False
        state = JointState(name=self.joint_names if len(self.joint_names) == len(obs.state) else [],
                           position=[float(v) for v in obs.state])
        state.header.stamp = stamp
        self.bag.write(f"{OBSERVATION}/state", JointState, serialize_message(state), rotate=first)

    def _write_language(self, update) -> None:
        from oxygen_interfaces.msg import LanguageUpdate

        msg = LanguageUpdate(robot=update.robot, frame_index=max(update.frame_index, 0), text=update.text)
        msg.header.stamp = ros_time(update.stamp)
        self.bag.write(LANGUAGE_TOPICS[update.kind], LanguageUpdate, serialize_message(msg))

    def _rewrite_latched(self) -> None:
        if self._prompt is not None:
            self.bag.write(f"{OBSERVATION}/prompt", String, serialize_message(String(data=self._prompt)))

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Write what is queued, then finish the file (its summary makes it seekable). Never raises (it runs
        inside the engine node's cleanup and shutdown): a failure is logged, and the summary always comes."""
        bag = self.bag
        if bag is None or self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=30.0)
        if self._thread.is_alive():
            self.get_logger().error(f"recording: the writer thread is still busy after 30 s; "
                                    f"{len(self._queue)} queued messages not written")
        try:
            bag.close()
        except Exception as e:  # noqa: BLE001
            self.get_logger().error(f"recording: closing failed, the last file is kept as of its last flush "
                                    f"(replay reads it): {type(e).__name__}: {e}")
        self.get_logger().info(
            f"recording closed: {bag.messages} messages in {len(bag.files)} file(s), {self.dropped} dropped "
            f"({self.queue_full} queue full, {bag.dropped} write errors, {self.failed} not convertible)")

    def diagnostics(self) -> list[DiagnosticStatus]:
        if not self.enabled:
            return []
        bag = self.bag
        level = DiagnosticStatus.WARN if self.dropped else DiagnosticStatus.OK
        message = "closed" if self._closed else "recording"
        if bag.failing:
            level, message = DiagnosticStatus.ERROR, f"not recording: {bag.last_error} (trying a new file)"
        values = dict(path=self.p["path"], files=len(bag.files), messages=bag.messages, dropped=self.dropped,
                      queue_full=self.queue_full, write_errors=bag.write_errors, last_error=bag.last_error,
                      queued=len(self._queue), queued_mb=self._queue.bytes / (1 << 20))
        return [status("oxygen_ros: recorder", level, message, values)]


def raw_topics(action, conversation, observation) -> dict:
    """The DDS topics recorded as published, with their types (names from the nodes' parameters, resolved in
    each node's namespace as ROS resolves them: the recording names the topics absolutely)."""
    from action_msgs.msg import GoalStatusArray

    from oxygen_interfaces.action import Converse as ConverseAction
    from oxygen_interfaces.msg import Caption
    from oxygen_interfaces.srv import Converse, Interject

    action_name = conversation.resolve_topic_name(conversation.p["action_name"])
    service_name = conversation.resolve_service_name(conversation.p["service_name"])
    interject_name = conversation.resolve_service_name(conversation.p["interject_service"])
    return {
        action.resolve_topic_name(action.p["action_topic"]): action.pub.msg_type,
        "/diagnostics": DiagnosticArray,
        conversation.resolve_topic_name(conversation.p["memory_topic"]): Caption,
        observation.resolve_topic_name(observation.p["prompt_topic"]): String,
        f"{service_name}/_service_event": Converse.Event,
        f"{interject_name}/_service_event": Interject.Event,
        f"{action_name}/_action/feedback": ConverseAction.Impl.FeedbackMessage,
        f"{action_name}/_action/send_goal/_service_event": ConverseAction.Impl.SendGoalService.Event,
        f"{action_name}/_action/get_result/_service_event": ConverseAction.Impl.GetResultService.Event,
        f"{action_name}/_action/status": GoalStatusArray,
    }
