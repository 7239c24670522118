"""The demo's simulated robot: the MuJoCo reach scene (oxygen_ros/sim/) behind the topics a real robot
has. It publishes camera images and joint states, follows the joint position commands it receives, and
runs episodes of the reach task: each new episode's task ("touch the red cube"; with `multistep`, "touch the
red cube, then the blue one") goes out on the prompt topic, success is judged from the simulator's state,
and each outcome is logged ("episode 3: 'touch the red cube': touched in 1.21 s"; `python -m oxygen_ros.eval
--ros` reads these lines).

Topics (names are parameters):
  publishes  /sim/camera/base/image_raw, /sim/camera/wrist/image_raw  sensor_msgs/Image (rgb8), camera_rate_hz
             /sim/joint_states                                       sensor_msgs/JointState, state_rate_hz
             /oxygen/prompt                                          std_msgs/String, each new task
  subscribes /oxygen/action   std_msgs/Float64MultiArray (3 target positions, command_type "float64_array")
                              or sensor_msgs/JointState (targets by joint name, command_type "joint_state")
  calls      /oxygen/enable   std_srvs/SetBool: the action output off while the scene is reset, on when the
                              episode starts (ResetSwitch: only an output it switched off)

Images and states use the sensor-data QoS (best effort, keep last 5); commands a reliable keep-last-10
subscription, the prompt a reliable publisher. All callbacks are in the node's default (mutually
exclusive) callback group, so the scene is never touched by two callbacks at once. The simulation is
advanced in wall time (monotonic clock) whenever a callback runs (ReachEpisodes.advance).
"""

from __future__ import annotations

import array
import collections
import time
from typing import TYPE_CHECKING

import numpy as np
import rclpy
import rclpy.executors
from rclpy.node import Node
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray, String
from std_srvs.srv import SetBool

from ..robot.errors import InputError
from .params import Param, declare_all

if TYPE_CHECKING:       # the simulation (mujoco, triton: seconds) is imported when the node is built: the
    from ..sim.episodes import ReachEpisodes      # parameter checker (oxygen_ros/param_files.py) reads PARAMS without it

CAMERAS = ("base", "wrist")
COMMAND_TYPES = ("float64_array", "joint_state")
PARAMS = [
    Param("camera_rate_hz", 15.0, "Rate of the camera images, Hz."),
    Param("state_rate_hz", 50.0, "Rate of the joint states, Hz."),
    Param("image_size", 64, "Side of the square camera images, pixels (the demo model was trained on 64x64 renders)."),
    Param("cameras", list(CAMERAS), "Cameras to publish: any of 'base', 'wrist'."),
    Param("base_topic", "sim/camera/base/image_raw", "Topic of the base (third-person) camera."),
    Param("wrist_topic", "sim/camera/wrist/image_raw", "Topic of the wrist camera."),
    Param("joint_states_topic", "sim/joint_states", "Topic of the joint states."),
    Param("command_topic", "oxygen/action", "Topic of the joint position commands."),
    Param("prompt_topic", "oxygen/prompt", "Topic the task of each episode goes to."),
    Param("command_type", "float64_array",
          "'float64_array': std_msgs/Float64MultiArray with the 3 target positions (joint_1..joint_3); "
          "'joint_state': sensor_msgs/JointState with target positions by joint name."),
    Param("seed", 0, "Seed of the episodes (cube colours, places, named cube)."),
    Param("enable_service", "oxygen/enable",
          "SetBool service of the action output: switched off while the scene is reset and on again when "
          "the episode starts, as an operator would (real-time chunking then continues no chunk across a "
          "reset); empty: never switched."),
    Param("episode_s", 4.0, "Time limit of an episode, s (of each step of a multi-step task)."),
    Param("multistep", False,
          "Multi-step tasks ('touch the red cube, then the blue one', 'touch every cube from left to right'; 2-3 "
          "steps, a touched cube darkens): the hierarchical demo model's. False: one cube per episode."),
]
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
    """ROS 2 wrapper of ReachEpisodes. `world` is the simulation; `command_count` counts accepted
    commands, `rejected_count` ignored ones; `last_command_time` is the node-clock time (seconds) of the
    last accepted command, None before the first."""

    def __init__(self, world: ReachEpisodes | None = None, **node_kwargs):
        super().__init__("oxygen_sim_robot", **node_kwargs)
        from ..sim.episodes import ReachEpisodes, ResetSwitch
        from ..sim.scene import JOINT_NAMES

        self._joint_names = list(JOINT_NAMES)

        p, problems = declare_all(self, PARAMS, read_only=False)
        camera_rate, state_rate = float(p["camera_rate_hz"]), float(p["state_rate_hz"])
        self.image_size = int(p["image_size"])
        cameras = list(p["cameras"])
        topics = {"base": p["base_topic"], "wrist": p["wrist_topic"]}
        state_topic, command_topic, prompt_topic = p["joint_states_topic"], p["command_topic"], p["prompt_topic"]
        self.command_type = p["command_type"]
        seed, enable_service, episode_s = int(p["seed"]), p["enable_service"], float(p["episode_s"])

        for name, value in (("camera_rate_hz", camera_rate), ("state_rate_hz", state_rate),
                            ("episode_s", episode_s)):
            if not value > 0.0:
                problems.append(f"{name} must be positive, got {value}")
        if not 8 <= self.image_size <= 1024:
            problems.append(f"image_size {self.image_size} is out of range (8..1024)")
        if any(c not in CAMERAS for c in cameras) or len(set(cameras)) != len(cameras):
            problems.append(f"cameras {cameras}: each must be one of {list(CAMERAS)}, listed once")
        if self.command_type not in COMMAND_TYPES:
            problems.append(f"command_type {self.command_type!r} must be one of {list(COMMAND_TYPES)}")
        if problems:
            for problem in problems:
                self.get_logger().error(problem)
            self.destroy_node()  # no half-made node left in the context
            raise ValueError("; ".join(problems))

        self.world = world if world is not None else ReachEpisodes(seed, self.image_size, episode_s,
                                                                   multistep=bool(p["multistep"]))
        self.command_count = 0
        self.rejected_count = 0
        self.last_command_time: float | None = None
        self.images_published = 0
        self.states_published = 0
        # What each published camera image showed (stamp ns, layout, gripper tip), for judging a reply
        # against the frame it was computed from (DemoClient); 40 s at 15 Hz.
        self._shown: collections.deque = collections.deque(maxlen=600)

        # The first render creates the GL context and the renderer (0.2-0.6 s measured): done here, before the
        # camera timer starts, or the first image went out that much after its stamp and the observation
        # node rightly rejected it as stale (a warning at every start).
        for camera in cameras:
            self.world.render(camera)
        self._image_pubs = {c: self.create_publisher(Image, topics[c], qos_profile_sensor_data) for c in cameras}
        self._state_pub = self.create_publisher(JointState, state_topic, qos_profile_sensor_data)
        self._prompt_pub = self.create_publisher(String, prompt_topic, 10)
        command_qos = QoSProfile(depth=10, history=HistoryPolicy.KEEP_LAST, reliability=ReliabilityPolicy.RELIABLE)
        if self.command_type == "float64_array":
            self._command_sub = self.create_subscription(
                Float64MultiArray, command_topic, self._on_array_command, command_qos)
        else:
            self._command_sub = self.create_subscription(
                JointState, command_topic, self._on_joint_state_command, command_qos)
        self._reset_switch = ResetSwitch()
        self._enable_client = self.create_client(SetBool, enable_service) if enable_service else None
        self._camera_timer = self.create_timer(1.0 / camera_rate, self._publish_images)
        self._state_timer = self.create_timer(1.0 / state_rate, self._publish_state)
        # The task is an event; repeated every 5 s so a subscriber that joins late still gets it.
        self._prompt_timer = self.create_timer(5.0, self._publish_prompt)
        self.get_logger().info(
            f"sim robot: cameras {cameras} at {camera_rate:g} Hz ({self.image_size} px), joint states at "
            f"{state_rate:g} Hz on {state_topic}, commands ({self.command_type}) on {command_topic}, "
            f"tasks on {prompt_topic}")

    def status(self) -> str:
        return self.world.status()

    # ------------------------------------------------------------------ callbacks (thin)

    def _advance(self) -> None:
        finished, running = len(self.world.outcomes), self.world.running
        if self.world.advance(time.monotonic()):
            self._publish_prompt()
        for outcome in self.world.outcomes[finished:]:      # the ROS-path evaluation reads these lines
            self.get_logger().info(outcome.line())
        if self.world.running != running and self._enable_client is not None:
            self._switch_output()

    def _switch_output(self) -> None:
        """The reset began or ended: switch the action output as ResetSwitch says (never waiting)."""
        reachable = self._enable_client.service_is_ready()
        on = self._reset_switch.on_phase_change(self.world.running, self.get_clock().now().nanoseconds * 1e-9,
                                                self.last_command_time, reachable)
        if on is None:
            return
        if not reachable:
            self.get_logger().warning(f"no {self._enable_client.srv_name} service: the action output is not "
                                      f"switched {'on' if on else 'off'}", throttle_duration_sec=_WARN_THROTTLE_S)
            return
        future = self._enable_client.call_async(SetBool.Request(data=on))

        def answered(f):
            response = f.result()
            if response is None or not response.success:
                self.get_logger().warning(f"action output not switched {'on' if on else 'off'}: "
                                          f"{response.message if response else f.exception()}")
        future.add_done_callback(answered)

    def _on_array_command(self, msg: Float64MultiArray) -> None:
        self._accept(lambda: self.world.set_command(msg.data))

    def _on_joint_state_command(self, msg: JointState) -> None:
        self._accept(lambda: self.world.set_command_by_name(msg.name, msg.position))

    def _accept(self, set_command) -> None:
        self._advance()  # the previous command applies up to now
        try:
            set_command()
        except InputError as e:
            self.rejected_count += 1
            self.get_logger().warning(f"ignored command ({self.rejected_count} so far): {e}",
                                      throttle_duration_sec=_WARN_THROTTLE_S)
            return
        self.command_count += 1
        self.last_command_time = self.get_clock().now().nanoseconds * 1e-9

    def _publish_prompt(self) -> None:
        self._prompt_pub.publish(String(data=self.world.prompt))

    def _publish_state(self) -> None:
        self._advance()
        msg = JointState()
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.name = self._joint_names
        msg.position = self.world.joints().tolist()
        self._state_pub.publish(msg)
        self.states_published += 1

    def _publish_images(self) -> None:
        self._advance()
        stamp = self.get_clock().now().to_msg()
        for camera, pub in self._image_pubs.items():
            pub.publish(rgb_to_image_msg(self.world.render(camera), stamp, camera))
        self.images_published += 1
        self._shown.append((stamp.sec * 1_000_000_000 + stamp.nanosec, self.world.layout, self.world.scene.tip()))

    def scene_shown(self, stamp_ns: int, slop_ns: int = 50_000_000):
        """(layout, tip) of the camera image nearest `stamp_ns` (an observation pairs its state with the
        nearest image within its slop), or None when no image is that close."""
        shown = list(self._shown)
        if not shown:
            return None
        stamp, layout, tip = min(shown, key=lambda s: abs(s[0] - stamp_ns))
        return (layout, tip) if abs(stamp - stamp_ns) <= slop_ns else None

    def destroy_node(self):
        if hasattr(self, "world"):
            self.world.close()
        return super().destroy_node()


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
