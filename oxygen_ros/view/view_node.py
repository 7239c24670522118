"""ViewNode (`oxygen_view`): publishes the debug picture (/oxygen/debug_image, sensor_msgs/Image, a few
times a second) and, where the actions are end-effector poses, the chunk in 3D (/oxygen/chunk_markers,
visualization_msgs/MarkerArray). Drawing lives in overlay.py; this node only gathers the newest chunk of
its robot, the frame it was computed from and the latest reply (engine-thread listeners store references
and return) and renders on its timer. The newest picture is also kept as JPEG for the web console. With a
fleet there is one per robot, in its namespace."""
from __future__ import annotations

import collections
import threading
import time

import cv2
import numpy as np
from builtin_interfaces.msg import Duration
from diagnostic_msgs.msg import DiagnosticStatus
from geometry_msgs.msg import Point
from rclpy.node import Node
from sensor_msgs.msg import Image
from std_msgs.msg import ColorRGBA
from visualization_msgs.msg import Marker, MarkerArray

from oxygen_ros.nodes.action_output import ros_time
from oxygen_ros.nodes.engine_node import status, status_name
from oxygen_ros.nodes.params import Param, ParameterError, declare_all

from .overlay import Camera, _gradient, render

PARAMS = [
    Param("rate_hz", 2.0, "Debug pictures per second (0: none).", minimum=0.0, maximum=30.0),
    Param("camera_slot", "", "Camera slot drawn on (empty: the first with an image)."),
    Param("ee_path", "auto", "Draw the end-effector path (rows start with x, y, z in base_frame): auto = when "
                             "oxygen_action publishes poses; otherwise joint targets as a strip.",
          choices=("auto", "on", "off")),
    Param("camera_intrinsics", [], "fx, fy, cx, cy of camera_slot (pixels of its image), to project the path.",
          item=float),
    Param("camera_pose", [], "x, y, z, qx, qy, qz, qw of camera_slot's optical frame in base_frame.",
          item=float),
    Param("base_frame", "base_link", "Frame of the end-effector path and the markers."),
    Param("debug_topic", "oxygen/debug_image", "Debug picture topic (sensor_msgs/Image, rgb8)."),
    Param("marker_topic", "oxygen/chunk_markers", "Chunk markers (visualization_msgs/MarkerArray)."),
]


class ViewNode(Node):
    def __init__(self, engine, observation, action, conversation, robot: str = "", **node_kwargs):
        """robot: whose chunks and frames to draw (a fleet's robot name; "" for the single robot)."""
        super().__init__("oxygen_view", **node_kwargs)
        self.robot = robot
        self.p, problems = declare_all(self, PARAMS)
        p = self.p
        self.camera = None
        if p["camera_intrinsics"] or p["camera_pose"]:
            try:
                self.camera = Camera.from_params([float(v) for v in p["camera_intrinsics"]],
                                                 [float(v) for v in p["camera_pose"]])
            except (ValueError, TypeError) as e:
                problems.append(f"oxygen_view: {e}")
        slots = observation.slots
        if p["camera_slot"] and p["camera_slot"] not in slots:
            problems.append(f"oxygen_view.camera_slot {p['camera_slot']!r} is not one of {slots}")
        if problems:
            raise ParameterError("\n".join(problems))
        self.ee_path = p["ee_path"] == "on" or (p["ee_path"] == "auto" and action.p["output_type"] == "pose")
        self.names = list(action.names)
        self.lower = np.asarray(action.p["lower_limits"], dtype=np.float64) if action.p["lower_limits"] else None
        self.upper = np.asarray(action.p["upper_limits"], dtype=np.float64) if action.p["upper_limits"] else None
        self._lock = threading.Lock()
        # Recent frames by index: the engine's frame listeners get every robot's frames, and a robot's chunk
        # names the frame it was computed from. Bounded: a few cycles of every robot's frames.
        self._frames: collections.OrderedDict = collections.OrderedDict()
        self._max_frames = 4 * len(engine.robots)
        self._chunk = None
        self._rendered_chunk = None
        self.reply = ""
        self.jpeg: bytes = b""              # the newest picture, for the console
        self._wanted_until = 0.0            # the console asked for pictures recently (monotonic time)
        self.pictures = 0
        engine.add_frame_listener(self._on_frame)
        engine.add_chunk_listener(lambda c: c.robot == robot and self._on_chunk(c))
        engine.add_caption_listener(lambda c: c.robot == robot and self.set_reply(f"[caption of frame {c.frame_index}] {c.text}"))
        from oxygen_interfaces.srv import Converse

        self._questions: dict = {}
        self.create_subscription(Converse.Event, f"{conversation.p['service_name']}/_service_event",
                                 self._on_service_event, 10)
        self.image_pub = self.create_publisher(Image, p["debug_topic"], 2)
        self.marker_pub = self.create_publisher(MarkerArray, p["marker_topic"], 2) if self.ee_path else None
        if p["rate_hz"] > 0:
            self.create_timer(1.0 / p["rate_hz"], self.render_now)

    # engine thread: keep references only
    def _on_frame(self, index, obs) -> None:
        with self._lock:
            self._frames[index] = obs
            while len(self._frames) > self._max_frames:
                self._frames.popitem(last=False)

    def _on_chunk(self, chunk) -> None:
        self._chunk = chunk

    def set_reply(self, text: str) -> None:
        self.reply = text

    def _on_service_event(self, event) -> None:
        """The conversation service's introspection events: question on arrival, reply when sent."""
        key = (bytes(event.info.client_gid), event.info.sequence_number)
        if event.request:
            self._questions[key] = event.request[0].text
            while len(self._questions) > 100:
                self._questions.pop(next(iter(self._questions)))
        if event.response:
            r = event.response[0]
            answer = r.reply if r.success else f"({r.finish_reason}: {r.error})"
            self.set_reply(f"Q: {self._questions.pop(key, '?')}  A: {answer}")

    def _image(self, obs) -> np.ndarray | None:
        if self.p["camera_slot"]:
            return obs.images.get(self.p["camera_slot"])
        return next((img for img in obs.images.values() if img is not None), None)

    def _watched(self) -> bool:
        """Render only for someone: a subscriber, or the console within the last few seconds."""
        return (self.image_pub.get_subscription_count() > 0 or time.monotonic() < self._wanted_until
                or (self.marker_pub is not None and self.marker_pub.get_subscription_count() > 0))

    def render_now(self) -> None:
        chunk = self._chunk
        with self._lock:
            obs = self._frames.get(chunk.plan.frame_index) if chunk is not None else None
        if obs is None or chunk is self._rendered_chunk or not self._watched():
            return
        image = self._image(obs)
        if image is None:
            return
        self._rendered_chunk = chunk
        plan = chunk.plan
        picture = render(image, plan.actions, names=self.names, lower=self.lower, upper=self.upper,
                         camera=self.camera, ee_path=self.ee_path, prompt=obs.prompt, reply=self.reply,
                         header=f"frame {plan.frame_index}  chunk {1e3 * chunk.compute_s:.0f} ms")
        ok, jpeg = cv2.imencode(".jpg", cv2.cvtColor(picture, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 80])
        with self._lock:
            self.jpeg = jpeg.tobytes()
        self.pictures += 1
        msg = Image(height=picture.shape[0], width=picture.shape[1], encoding="rgb8", step=picture.shape[1] * 3,
                    data=picture.tobytes())
        msg.header.stamp = ros_time(plan.stamp_s)
        msg.header.frame_id = self.p["camera_slot"] or "camera"
        self.image_pub.publish(msg)
        if self.marker_pub is not None:
            self.marker_pub.publish(chunk_markers(plan.actions, plan.stamp_s, self.p["base_frame"]))

    def latest_jpeg(self) -> bytes:
        self._wanted_until = time.monotonic() + 3.0
        with self._lock:
            return self.jpeg

    def diagnostics(self) -> list[DiagnosticStatus]:
        return [status(status_name("view", self.robot), DiagnosticStatus.OK, "ee path" if self.ee_path else "joint strip",
                       {"pictures": self.pictures})]


def chunk_markers(actions: np.ndarray, stamp_s: float, frame_id: str) -> MarkerArray:
    """The chunk's end-effector positions (rows' x, y, z) as a line strip and a sphere per row, first row
    green to last row red; each replaces the previous chunk's (same ids) and expires after 2 s."""
    points = [Point(x=float(x), y=float(y), z=float(z)) for x, y, z in actions[:, :3]]
    colors = [ColorRGBA(r=r / 255, g=g / 255, b=b / 255, a=1.0)
              for r, g, b in (_gradient(k, len(points)) for k in range(len(points)))]
    markers = []
    for marker_id, kind, size in ((0, Marker.LINE_STRIP, 0.005), (1, Marker.SPHERE_LIST, 0.015)):
        m = Marker(ns="oxygen_chunk", id=marker_id, type=kind, action=Marker.ADD, points=points, colors=colors,
                   lifetime=Duration(sec=2))
        m.header.frame_id, m.header.stamp = frame_id, ros_time(stamp_s)
        m.pose.orientation.w = 1.0
        m.scale.x = m.scale.y = m.scale.z = size
        markers.append(m)
    return MarkerArray(markers=markers)
