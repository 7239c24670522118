"""Recorder: the run as ROS 2 MCAP (bag.py), on with `oxygen_bringup --record DIR` or the `path` parameter.

What it stores:
  from the engine, in-process (exactly what was computed, every frame, even when no subscriber was fast
  enough): the observation of each frame (`/oxygen/observation/<slot>/compressed`, lossless PNG;
  `/oxygen/observation/state`, JointState with the observation stamp; `/oxygen/observation/prompt` when
  it changes) and each action chunk (`/oxygen/action_chunk`);
  from DDS, raw (the serialised bytes as published): the commands, captions, task prompt, /diagnostics,
  the conversation service's requests and replies (service introspection events, as `ros2 bag record
  --all-services` stores them) and the streaming action's feedback and status.
Engine-thread callbacks only enqueue; PNG encoding and writing run on the recorder's own thread. A full
queue drops (and counts) rather than ever blocking the engine.
"""
from __future__ import annotations

import json
import queue
import threading

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
    Param("queue_size", 2000, "Messages waiting to be written; beyond it new ones are dropped and counted.",
          minimum=10),
]
OBSERVATION = "/oxygen/observation"
PNG_FORMAT = "rgb8; png compressed bgr8"


class Recorder(Node):
    def __init__(self, engine, metadata: dict, raw_topics: dict, joint_names: list[str], **node_kwargs):
        super().__init__("oxygen_recorder", **node_kwargs)
        self.p, problems = declare_all(self, PARAMS)
        if problems:
            raise ParameterError("\n".join(problems))
        self.enabled = bool(self.p["path"])
        self.bag: RotatingBag | None = None
        self.dropped = 0
        if not self.enabled:
            return
        self.joint_names = list(joint_names)
        self._prompt = None
        self._queue: queue.Queue = queue.Queue(maxsize=self.p["queue_size"])
        try:
            self.bag = RotatingBag(self.p["path"], int(self.p["max_file_mb"] * 1e6), self.p["max_files"],
                                   {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()},
                                   on_new_file=self._rewrite_latched)
        except OSError as e:
            raise ParameterError(f"oxygen_recorder.path {self.p['path']!r}: cannot record there: {e}") from None
        qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        for topic, msg_type in raw_topics.items():
            self.create_subscription(msg_type, topic, lambda data, t=topic, m=msg_type: self._put(("raw", t, m, data)),
                                     qos, raw=True)
        engine.add_frame_listener(lambda index, obs: self._put(("frame", index, obs)))
        engine.add_chunk_listener(lambda chunk: self._put(("chunk", chunk)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="oxygen-recorder", daemon=True)
        self._thread.start()
        self.get_logger().info(f"recording to {self.p['path']} (files of {self.p['max_file_mb']:g} MB, "
                               f"at most {self.p['max_files']})")

    # any thread: never blocks
    def _put(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._write(item)
            except Exception as e:  # noqa: BLE001 - a write failure (disk full...) must not end the recording
                self.dropped += 1
                self.get_logger().error(f"recording: {type(e).__name__}: {e}", throttle_duration_sec=5.0)

    def _write(self, item) -> None:
        kind = item[0]
        if kind == "raw":
            _, topic, msg_type, data = item
            self.bag.write(topic, msg_type, data)
        elif kind == "chunk":
            chunk = item[1]
            msg = chunk_message(chunk.plan, self.joint_names, chunk.compute_s)
            self.bag.write("/oxygen/action_chunk", type(msg), serialize_message(msg))
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

    def _rewrite_latched(self) -> None:
        if self._prompt is not None:
            self.bag.write(f"{OBSERVATION}/prompt", String, serialize_message(String(data=self._prompt)))

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Write what is queued, then finish the file (its index makes it readable)."""
        if self.bag is None:
            return
        self._stop.set()
        self._thread.join(timeout=30.0)
        self.bag.close()
        self.get_logger().info(f"recording closed: {self.bag.messages} messages in {len(self.bag.files)} "
                               f"file(s), {self.dropped} dropped")
        self.bag = None

    def diagnostics(self) -> list[DiagnosticStatus]:
        if not self.enabled:
            return []
        bag = self.bag
        level = DiagnosticStatus.WARN if self.dropped else DiagnosticStatus.OK
        values = dict(path=self.p["path"], files=len(bag.files) if bag else 0, messages=bag.messages if bag else 0,
                      dropped=self.dropped, queued=self._queue.qsize())
        return [status("oxygen_ros: recorder", level, "recording" if bag else "closed", values)]


def raw_topics(action, conversation, observation) -> dict:
    """The DDS topics recorded as published, with their types (names from the nodes' parameters, resolved in
    each node's namespace as ROS resolves them: the recording names the topics absolutely)."""
    from action_msgs.msg import GoalStatusArray

    from oxygen_interfaces.action import Converse as ConverseAction
    from oxygen_interfaces.msg import Caption
    from oxygen_interfaces.srv import Converse

    action_name = conversation.resolve_topic_name(conversation.p["action_name"])
    service_name = conversation.resolve_service_name(conversation.p["service_name"])
    return {
        action.resolve_topic_name(action.p["action_topic"]): action.pub.msg_type,
        "/diagnostics": DiagnosticArray,
        conversation.resolve_topic_name(conversation.p["memory_topic"]): Caption,
        observation.resolve_topic_name(observation.p["prompt_topic"]): String,
        f"{service_name}/_service_event": Converse.Event,
        f"{action_name}/_action/feedback": ConverseAction.Impl.FeedbackMessage,
        f"{action_name}/_action/send_goal/_service_event": ConverseAction.Impl.SendGoalService.Event,
        f"{action_name}/_action/get_result/_service_event": ConverseAction.Impl.GetResultService.Event,
        f"{action_name}/_action/status": GoalStatusArray,
    }
