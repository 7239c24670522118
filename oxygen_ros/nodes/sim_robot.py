"""The demo's simulated robot: publishes camera images and joint states of a `SimArm` and follows the
joint position commands it receives, closing the loop with the policy nodes without hardware.

Topics (names are parameters):
  publishes  /sim/camera/base/image_raw, /sim/camera/wrist/image_raw  sensor_msgs/Image (rgb8), camera_rate_hz
             /sim/joint_states                                       sensor_msgs/JointState, state_rate_hz
  subscribes /oxygen/action   std_msgs/Float64MultiArray (7 target positions, command_type "float64_array")
                              or sensor_msgs/JointState (targets by joint name, command_type "joint_state")

Images and states use the sensor-data QoS (best effort, keep last 5); commands a reliable keep-last-10
subscription. All callbacks are in the node's default (mutually exclusive) callback group, so the arm is
never touched by two callbacks at once, whatever the executor. The arm's motion is integrated in wall
time (monotonic clock) whenever a command arrives or a state or image is published.
"""

from __future__ import annotations

import array
import time

import numpy as np
import rclpy
import rclpy.executors
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.node import Node
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray

from ..robot.errors import InputError
from ..robot.sim_arm import CAMERAS, SimArm

COMMAND_TYPES = ("float64_array", "joint_state")
_WARN_THROTTLE_S = 2.0


def rgb_to_image_msg(rgb: np.ndarray, stamp, frame_id: str) -> Image:
    """HxWx3 uint8 RGB -> sensor_msgs/Image (rgb8, step = 3 * width, no padding).

    `data` is set as an array.array('B') built from the bytes: ~10 us for 224x224 and the setter's fast
    path whether or not ROS_PYTHON_CHECK_FIELDS is set (assigning the bytes object itself costs the same
    without the checks but ~14 ms with them, and assigning an ndarray ~16 ms: element-wise conversion).
    """
    msg = Image()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.height, msg.width = int(rgb.shape[0]), int(rgb.shape[1])
    msg.encoding = "rgb8"
    msg.is_bigendian = 0
    msg.step = 3 * msg.width
    msg.data = array.array("B", np.ascontiguousarray(rgb, dtype=np.uint8).tobytes())
    return msg


class SimRobotNode(Node):
    """ROS 2 wrapper of SimArm. `arm` is the simulated arm; `command_count` counts accepted commands,
    `rejected_count` ignored ones; `last_command_time` is the node-clock time (seconds) of the last
    accepted command, None before the first."""

    def __init__(self, arm: SimArm | None = None, **node_kwargs):
        super().__init__("oxygen_sim_robot", **node_kwargs)

        def declare(name, default, description):
            return self.declare_parameter(name, default, ParameterDescriptor(description=description)).value

        camera_rate = float(declare("camera_rate_hz", 15.0, "Rate of the camera images, Hz."))
        state_rate = float(declare("state_rate_hz", 50.0, "Rate of the joint states, Hz."))
        self.image_size = int(declare("image_size", 224, "Side of the square camera images, pixels."))
        cameras = list(declare("cameras", ["base", "wrist"], "Cameras to publish: any of 'base', 'wrist'."))
        topics = {
            "base": declare("base_topic", "/sim/camera/base/image_raw", "Topic of the base (third-person) camera."),
            "wrist": declare("wrist_topic", "/sim/camera/wrist/image_raw", "Topic of the wrist camera."),
        }
        state_topic = declare("joint_states_topic", "/sim/joint_states", "Topic of the joint states.")
        command_topic = declare("command_topic", "/oxygen/action", "Topic of the joint position commands.")
        self.command_type = declare(
            "command_type", "float64_array",
            "'float64_array': std_msgs/Float64MultiArray with the 7 target positions (joint_1..joint_6, "
            "gripper); 'joint_state': sensor_msgs/JointState with target positions by joint name.")
        seed = int(declare("seed", 0, "Seed of the scene (object positions)."))
        max_speed = float(declare("max_joint_speed", 2.0, "Max joint speed, rad/s (gripper: opening per s)."))

        problem = None
        for name, rate in (("camera_rate_hz", camera_rate), ("state_rate_hz", state_rate)):
            if not rate > 0.0:
                problem = f"{name} must be positive, got {rate}"
        if not 8 <= self.image_size <= 4096:
            problem = f"image_size {self.image_size} is out of range (8..4096)"
        if any(c not in CAMERAS for c in cameras) or len(set(cameras)) != len(cameras):
            problem = f"cameras {cameras}: each must be one of {list(CAMERAS)}, listed once"
        if self.command_type not in COMMAND_TYPES:
            problem = f"command_type {self.command_type!r} must be one of {list(COMMAND_TYPES)}"
        if problem is None and not max_speed > 0.0:
            problem = f"max_joint_speed must be positive, got {max_speed}"
        if problem is not None:
            self.get_logger().error(problem)
            self.destroy_node()  # no half-made node left in the context
            raise ValueError(problem)

        self.arm = arm if arm is not None else SimArm(seed=seed, max_speed=max_speed)
        self.command_count = 0
        self.rejected_count = 0
        self.last_command_time: float | None = None
        self.images_published = 0
        self.states_published = 0
        self._last_advance = time.monotonic()

        self._image_pubs = {c: self.create_publisher(Image, topics[c], qos_profile_sensor_data) for c in cameras}
        self._state_pub = self.create_publisher(JointState, state_topic, qos_profile_sensor_data)
        command_qos = QoSProfile(depth=10, history=HistoryPolicy.KEEP_LAST, reliability=ReliabilityPolicy.RELIABLE)
        if self.command_type == "float64_array":
            self._command_sub = self.create_subscription(
                Float64MultiArray, command_topic, self._on_array_command, command_qos)
        else:
            self._command_sub = self.create_subscription(
                JointState, command_topic, self._on_joint_state_command, command_qos)
        self._camera_timer = self.create_timer(1.0 / camera_rate, self._publish_images)
        self._state_timer = self.create_timer(1.0 / state_rate, self._publish_state)
        self.get_logger().info(
            f"sim robot: cameras {cameras} at {camera_rate:g} Hz ({self.image_size} px), joint states at "
            f"{state_rate:g} Hz on {state_topic}, commands ({self.command_type}) on {command_topic}")

    # ------------------------------------------------------------------ callbacks (thin)

    def _advance(self) -> None:
        now = time.monotonic()
        self.arm.step(now - self._last_advance)
        self._last_advance = now

    def _on_array_command(self, msg: Float64MultiArray) -> None:
        self._accept(lambda: self.arm.set_target(msg.data))

    def _on_joint_state_command(self, msg: JointState) -> None:
        self._accept(lambda: self.arm.set_target_by_name(msg.name, msg.position))

    def _accept(self, set_target) -> None:
        self._advance()  # the previous target applies up to now
        try:
            set_target()
        except InputError as e:
            self.rejected_count += 1
            self.get_logger().warning(f"ignored command ({self.rejected_count} so far): {e}",
                                      throttle_duration_sec=_WARN_THROTTLE_S)
            return
        self.command_count += 1
        self.last_command_time = self.get_clock().now().nanoseconds * 1e-9

    def _publish_state(self) -> None:
        self._advance()
        msg = JointState()
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.name = list(self.arm.joint_names)
        msg.position = self.arm.positions.tolist()
        msg.velocity = self.arm.velocities.tolist()
        self._state_pub.publish(msg)
        self.states_published += 1

    def _publish_images(self) -> None:
        self._advance()
        stamp = self.get_clock().now().to_msg()
        for camera, pub in self._image_pubs.items():
            pub.publish(rgb_to_image_msg(self.arm.render(camera, self.image_size), stamp, camera))
        self.images_published += 1


def main(args=None) -> None:
    rclpy.init(args=args)
    node = SimRobotNode()
    try:
        rclpy.spin(node)
    except (KeyboardInterrupt, rclpy.executors.ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
