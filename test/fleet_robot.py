"""A robot's drivers on another host, for test_fleet_netns.py (test-only, not a driver): two cameras as
JPEG CompressedImage at 15 Hz and a JointState at 50 Hz, published best effort as over a lossy link; the
commands from /oxygen/action and the chunks from /oxygen/action_chunk received best effort; one
/oxygen/converse call once actions flow; the engine's inputs diagnostic. Two phases: `synced` (stamps from
this host's clock), optionally a link outage (--outage-veth: the interface down, then up), then `skewed`
(stamps --skew-s ahead, as from a robot whose clock is not synchronised with the engine's). Writes what it
saw as JSON.

    python test/fleet_robot.py --json OUT.json [--min-window-s 6] [--outage-veth IF] [--skewed-s 4] [--skew-s 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time

import cv2
import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import qos_profile_sensor_data
from rclpy.time import Time
from sensor_msgs.msg import CompressedImage, JointState
from std_msgs.msg import Float64MultiArray

from oxygen_interfaces.msg import ActionChunk
from oxygen_interfaces.srv import Converse

CAMERAS = {"base": "/robot/cam_base/image/compressed", "wrist": "/robot/cam_wrist/image/compressed"}
STATE_TOPIC = "/robot/joint_states"
JOINTS = ["joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6", "gripper"]


def _micros(stamp) -> int:
    return round((stamp.sec * 10**9 + stamp.nanosec) / 1000)


class Robot:
    def __init__(self, node):
        self.node = node
        self.skew_s = 0.0
        self.phase = "synced"
        self.lock = threading.RLock()
        self.state_sent: dict[int, float] = {}            # stamp in microseconds (the engine keeps float s) -> sent at
        self.actions: list[tuple[float, str, bool]] = []  # (arrival, phase, all finite)
        self.chunks: list[dict] = []
        self.inputs: dict[str, dict] = {}                 # phase -> last inputs diagnostic
        self.cams = {c: node.create_publisher(CompressedImage, t, qos_profile_sensor_data) for c, t in CAMERAS.items()}
        self.joints = node.create_publisher(JointState, STATE_TOPIC, qos_profile_sensor_data)
        node.create_subscription(Float64MultiArray, "/oxygen/action", self._on_action, qos_profile_sensor_data)
        node.create_subscription(ActionChunk, "/oxygen/action_chunk", self._on_chunk, 10)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 10)
        rng = np.random.default_rng(0)
        self.jpeg = {c: cv2.imencode(".jpg", rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
                                     [cv2.IMWRITE_JPEG_QUALITY, 80])[1].tobytes() for c in CAMERAS}
        self.t = 0.0
        node.create_timer(1 / 15, self._publish_cameras)
        node.create_timer(1 / 50, self._publish_state)

    def _stamp(self):
        return Time(nanoseconds=self.node.get_clock().now().nanoseconds + int(self.skew_s * 1e9)).to_msg()

    def _publish_cameras(self):
        stamp = self._stamp()
        for cam, pub in self.cams.items():
            msg = CompressedImage(format="jpeg", data=self.jpeg[cam])
            msg.header.stamp, msg.header.frame_id = stamp, cam
            pub.publish(msg)

    def _publish_state(self):
        self.t += 0.02
        msg = JointState(name=JOINTS, position=[0.3 * np.sin(self.t + i) for i in range(6)] + [0.5])
        msg.header.stamp = self._stamp()
        with self.lock:
            self.state_sent[_micros(msg.header.stamp)] = time.monotonic()
        self.joints.publish(msg)

    def sent_state(self, stamp) -> float | None:
        """When this robot sent the state stamped `stamp` (to float rounding of the stamp); None: not ours."""
        us = _micros(stamp)
        with self.lock:
            return next((self.state_sent[us + d] for d in (-1, 0, 1) if us + d in self.state_sent), None)

    def _on_action(self, msg):
        with self.lock:
            self.actions.append((time.monotonic(), self.phase, bool(np.all(np.isfinite(msg.data)))))

    def _on_chunk(self, msg):
        with self.lock:
            self.chunks.append({"phase": self.phase, "arrived": time.monotonic(),
                                "state_sent": self.sent_state(msg.header.stamp),
                                "horizon": msg.horizon, "dim": msg.dim,
                                "compute_latency_s": msg.compute_latency_s})

    def _on_diagnostics(self, msg):
        for st in msg.status:
            if st.name == "oxygen_ros: inputs":
                with self.lock:
                    level = st.level[0] if isinstance(st.level, bytes) else int(st.level)
                    self.inputs[self.phase] = {"message": st.message, "level": level,
                                               **{kv.key: kv.value for kv in st.values}}


def link_outage(robot: Robot, veth: str, seconds: float, timeout_s: float) -> dict:
    """The link down for `seconds`, then up: how long until commands, and a chunk computed from a fresh
    observation, arrive again, and what the engine's inputs diagnostic says then."""
    with robot.lock:
        robot.phase = "outage"
    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
    time.sleep(seconds)
    with robot.lock:
        robot.phase = "recovered"
    up = time.monotonic()
    subprocess.run(["ip", "link", "set", veth, "up"], check=True)


    def fresh_chunks():   # computed from a state sent after the link came back (older ones may be re-sent)
        return [c for c in robot.chunks if c["state_sent"] is not None and c["state_sent"] >= up]

    while time.monotonic() - up < timeout_s and not fresh_chunks():
        time.sleep(0.02)
    time.sleep(1.5)    # one diagnostics period after the resumption
    with robot.lock:
        resumed = [t for t, phase, _ in robot.actions if phase == "recovered"]
        fresh = fresh_chunks()
        return {"seconds": seconds, "actions_during": sum(phase == "outage" for _, phase, _ in robot.actions),
                "commands_after_s": resumed[0] - up if resumed else None,
                "fresh_chunk_after_s": fresh[0]["arrived"] - up if fresh else None,
                "inputs_after": robot.inputs.get("recovered")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True)
    p.add_argument("--min-window-s", type=float, default=6.0, help="seconds of actions the rate is measured over")
    p.add_argument("--skewed-s", type=float, default=4.0, help="length of the skewed phase")
    p.add_argument("--skew-s", type=float, default=2.0, help="how far ahead the skewed stamps are")
    p.add_argument("--outage-veth", default=None, help="take this interface down for --outage-s after the synced phase")
    p.add_argument("--outage-s", type=float, default=2.0)
    p.add_argument("--timeout-s", type=float, default=90.0)
    a = p.parse_args()
    rclpy.init()
    node = rclpy.create_node("fleet_robot")
    robot = Robot(node)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    result: dict = {"ok": False}
    start = time.monotonic()
    try:
        client = node.create_client(Converse, "/oxygen/converse")
        result["service_found_s"] = client.wait_for_service(timeout_sec=a.timeout_s) and time.monotonic() - start
        while not robot.actions and time.monotonic() - start < a.timeout_s:
            time.sleep(0.05)
        first_action = robot.actions[0][0] if robot.actions else None
        result["first_action_s"] = first_action and first_action - start
        asked = time.monotonic()
        future = client.call_async(Converse.Request(text="What is on the table?", max_tokens=8))
        while time.monotonic() - start < a.timeout_s and not (
                future.done() and first_action is not None and time.monotonic() - first_action >= a.min_window_s + 1):
            time.sleep(0.05)
        if future.done():
            r = future.result()
            result["converse"] = {"success": r.success, "reply": r.reply, "error": r.error, "tokens": r.tokens,
                                  "frame_index": r.frame_index, "answered_after_s": time.monotonic() - asked,
                                  "frame_stamped_by_us": robot.sent_state(r.frame_stamp) is not None}
        if a.outage_veth:
            result["outage"] = link_outage(robot, a.outage_veth, a.outage_s, a.timeout_s)
        with robot.lock:
            robot.phase, robot.skew_s = "skewed", a.skew_s
        skew_start = time.monotonic()
        time.sleep(a.skewed_s)
        with robot.lock:
            synced = [t for t, phase, _ in robot.actions if phase == "synced"]
            window = [t for t in synced if t >= synced[-1] - a.min_window_s] if synced else []
            result.update(
                ok=True,
                rate_hz=(len(window) - 1) / (window[-1] - window[0]) if len(window) > 1 else 0.0,
                rate_window_s=window[-1] - window[0] if len(window) > 1 else 0.0,
                max_gap_s=max((b - a_ for a_, b in zip(window, window[1:])), default=0.0),
                actions_synced=len(synced), actions_finite=all(f for _, _, f in robot.actions),
                skewed_actions_after_s=[round(t - skew_start, 3) for t, phase, _ in robot.actions if phase == "skewed"],
                skewed_s=a.skewed_s,
                chunks_synced=[c for c in robot.chunks if c["phase"] == "synced"][-5:],
                chunks_stamped_by_us=sum(c["state_sent"] is not None for c in robot.chunks if c["phase"] == "synced"),
                chunks_total_synced=sum(c["phase"] == "synced" for c in robot.chunks),
                inputs=robot.inputs)
    finally:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        executor.shutdown(timeout_sec=2.0)
        spinner.join(timeout=5.0)
        node.destroy_node()
        rclpy.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
