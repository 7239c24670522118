"""ObservationNode: cameras per slot + robot state + task prompt -> the engine's newest observation.

Callbacks only convert and hand over: decoding lives in oxygen_ros.robot.images, state picking in
robot.state, synchronisation in robot.sync. Bad input is logged with the exact reason (throttled),
counted for /diagnostics, and never stops the node.
"""
from __future__ import annotations

from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Float64MultiArray, String

from oxygen_ros.engine.engine import Engine
from oxygen_ros.robot.errors import InputError
from oxygen_ros.robot.images import image_from_msg
from oxygen_ros.robot.stamps import StampCheck
from oxygen_ros.robot.state import StateReader
from oxygen_ros.robot.sync import ObservationAssembler
from oxygen_ros.robot.text import validate_text
from oxygen_ros.robot.trajectory import stamp_to_seconds
from oxygen_ros.robot.watchdog import StaleWatch

from .engine_node import status, status_name
from .params import Param, ParameterError, declare_all


def _stamp_s(header) -> float:
    return stamp_to_seconds(header.stamp.sec, header.stamp.nanosec)


def params_for(slots) -> list[Param]:
    specs = []
    for slot in slots:
        specs += [
            Param(f"cameras.{slot}.topic", "", f"Image topic of camera slot {slot} (empty: slot absent, masked)."),
            Param(f"cameras.{slot}.compressed", False, f"{slot} publishes sensor_msgs/CompressedImage."),
            Param(f"cameras.{slot}.required", False, f"No observation without an image from {slot}."),
        ]
    return specs + [
        Param("state_topic", "joint_states", "Robot state topic (relative: in the nodes' namespace)."),
        Param("state_type", "joint_state", "sensor_msgs/JointState or std_msgs/Float64MultiArray.",
              choices=("joint_state", "float64_array")),
        Param("joint_names", [], "State joints in the model's order (JointState only; empty: as received).",
              item=str),
        Param("state_dim", 0, "Expected state length (0: any).", minimum=0),
        Param("prompt_topic", "oxygen/prompt", "std_msgs/String topic that changes the task prompt."),
        Param("prompt", "", "Task prompt until one arrives on prompt_topic."),
        Param("max_prompt_chars", 500, "Longest prompt accepted.", minimum=1),
        Param("slop_s", 0.05, "Largest |image stamp - state stamp| that pairs them.", minimum=0.0),
        Param("missing_after_s", 0.5, "An optional camera silent this long is masked.", minimum=0.0),
        Param("buffer", 32, "Messages kept per stream for synchronisation.", minimum=1, maximum=10_000),
        Param("image_buffer_mb", 256.0, "Most image memory kept per camera slot (the newest images that fit).",
              minimum=1.0),
        Param("stale_after_s", 0.5, "No complete observation for this long: inputs are stale.", minimum=0.01),
        # Stamps come from the robot's clock, which may be another host's (robot/stamps.py: the policy).
        Param("max_stamp_age_s", 0.5, "Reject camera/state messages whose stamp is older than this (0: no check).",
              minimum=0.0),
        Param("max_stamp_future_s", 0.05, "Reject stamps further ahead of this host's clock than this "
              "(clock synchronisation residual).", minimum=0.0),
    ]


class ObservationNode(Node):
    def __init__(self, engine: Engine, robot: str = "", **node_kwargs):
        """robot: whose observations these are (a fleet's robot name; "" for the single robot)."""
        super().__init__("oxygen_observation", **node_kwargs)
        self.engine = engine
        self.robot = robot
        info = engine.robot_info(robot)
        self.slots = list(info.camera_slots)
        self.p, problems = declare_all(self, params_for(self.slots))
        topics = {s: self.p[f"cameras.{s}.topic"] for s in self.slots if self.p[f"cameras.{s}.topic"]}
        required = [s for s in self.slots if self.p[f"cameras.{s}.required"]]
        problems += [f"camera slot {s} is required but has no topic" for s in required if s not in topics]
        if not topics:
            problems.append("no camera topic configured (cameras.<slot>.topic)")
        joint_names = [j for j in self.p["joint_names"] if j]
        if joint_names and self.p["state_dim"] and len(joint_names) != self.p["state_dim"]:
            problems.append(f"joint_names has {len(joint_names)} joints but state_dim is {self.p['state_dim']}")
        max_state = info.max_state_dim  # π0.5 pads the state to action_dim: nothing longer fits
        if max(len(joint_names), self.p["state_dim"]) > max_state:
            problems.append(f"state of {max(len(joint_names), self.p['state_dim'])} values (joint_names/state_dim) "
                            f"exceeds the model's {max_state}")
        if problems:
            raise ParameterError("\n".join(problems))
        self.assembler = ObservationAssembler(self.slots, required, self.p["slop_s"], self.p["missing_after_s"],
                                              self.p["buffer"], int(self.p["image_buffer_mb"] * (1 << 20)))
        self.reader = StateReader(joint_names or None, self.p["state_dim"] or None, max_dim=max_state)
        self.stamps = StampCheck(self.p["max_stamp_age_s"], self.p["max_stamp_future_s"])
        self.prompt = ""                 # the task prompt in force (logged when it changes)
        if self.p["prompt"]:
            self.prompt = validate_text(self.p["prompt"], what="prompt", max_chars=self.p["max_prompt_chars"])
            self.assembler.set_prompt(self.prompt)
        self.watch = StaleWatch(self.p["stale_after_s"])
        self.bad_inputs = 0
        self.last_error = ""
        self.observations = 0

        group = MutuallyExclusiveCallbackGroup()  # one input at a time: the assembler is not thread-safe
        for slot, topic in topics.items():
            kind = CompressedImage if self.p[f"cameras.{slot}.compressed"] else Image
            self.create_subscription(kind, topic, lambda msg, s=slot: self._on_image(s, msg),
                                     qos_profile_sensor_data, callback_group=group)
        state_kind = JointState if self.p["state_type"] == "joint_state" else Float64MultiArray
        self.create_subscription(state_kind, self.p["state_topic"], self._on_state, qos_profile_sensor_data,
                                 callback_group=group)
        # The prompt is an event, not a stream: reliable (volatile durability matches any publisher).
        self.create_subscription(String, self.p["prompt_topic"], self._on_prompt, 10, callback_group=group)
        # Inputs poll on arrival; this timer only notices cameras that went silent (then masked).
        self.create_timer(0.1, self._poll, callback_group=group)

    # ------------------------------------------------------------------ callbacks
    # An exception escaping a callback would end rclpy's spin and with it every input (a bug's, not the
    # input's): any error is counted and logged like bad input, and the next message is read.
    def _on_image(self, slot: str, msg) -> None:
        try:
            rgb = image_from_msg(msg, name=slot)   # a malformed message is reported as such, whatever its stamp
            stamp = _stamp_s(msg.header)
            self.stamps.check(f"image {slot!r}", stamp, self._now())
            self.assembler.add_image(slot, stamp, rgb)
        except Exception as e:  # noqa: BLE001
            self._bad(e)
            return
        self._poll()

    def _on_state(self, msg) -> None:
        try:
            if isinstance(msg, JointState):
                vec = self.reader.from_joint_state(list(msg.name), msg.position)
                stamp = _stamp_s(msg.header)
                self.stamps.check("state", stamp, self._now())
            else:
                vec = self.reader.from_array(msg.data)
                stamp = self._now()  # Float64MultiArray has no header: stamped on arrival
            self.assembler.add_state(stamp, vec)
        except Exception as e:  # noqa: BLE001
            self._bad(e)
            return
        self._poll()

    def _on_prompt(self, msg: String) -> None:
        try:
            prompt = validate_text(msg.data, what="prompt", max_chars=self.p["max_prompt_chars"])
            self.assembler.set_prompt(prompt)
        except Exception as e:  # noqa: BLE001
            self._bad(e)
            return
        # Once per change: a task announced again (the demo robot repeats its task every 5 s) is not news;
        # these lines were 40% of the demo's log. The cleaned text, never the raw payload.
        if prompt != self.prompt:
            self.prompt = prompt
            self.get_logger().info(f"task prompt: {prompt!r}")

    def _poll(self) -> None:
        try:
            obs = self.assembler.poll(self._now())
            if obs is not None:
                self.engine.submit_observation(obs, robot=self.robot)
                self.observations += 1
                self.watch.seen(self._now())
        except Exception as e:  # noqa: BLE001
            self._bad(e)

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _bad(self, error: Exception) -> None:
        self.bad_inputs += 1
        self.last_error = str(error) if isinstance(error, InputError) else f"{type(error).__name__}: {error}"
        self.get_logger().warning(f"input rejected: {error}", throttle_duration_sec=1.0)

    def inputs_fresh(self) -> bool:
        return not self.watch.stale(self._now())

    def diagnostics(self) -> list[DiagnosticStatus]:
        now = self._now()
        stale = self.watch.stale(now)
        age = self.watch.age(now)
        level = DiagnosticStatus.ERROR if stale else DiagnosticStatus.OK
        message = (f"no complete observation for {age:.2f} s" if self.watch.last_s is not None
                   else "no observation yet") if stale else "receiving"
        values = dict(self.assembler.stats, **self.stamps.stats, **self.stamps.age_summary(),
                      observations=self.observations, bad_inputs=self.bad_inputs,
                      observation_age_s=age, stale_transitions=self.watch.transitions, last_error=self.last_error)
        return [status(status_name("inputs", self.robot), level, message, values)]
