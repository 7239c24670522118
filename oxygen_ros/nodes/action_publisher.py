"""ActionPublisher: a timer at action_rate_hz publishes the next action of the newest chunk.

The engine thread only drops each new chunk into a one-slot mailbox; the timer (its own callback group,
so nothing else delays it) takes it, publishes it on /oxygen/action_chunk (with the subtask that conditioned
it, under a hierarchical policy), and plays the rows through the ChunkFollower, which samples the chunk in
time: rows are one control period apart (the checkpoint's rate), commands go out at action_rate_hz; a chunk
from an observation at t0 starts at the time now - t0.
Every command is clamped to the configured limits. With no fresh chunk, or stale inputs, or the output
disabled, the configured safe behaviour applies and /diagnostics says so.
"""
from __future__ import annotations

import threading

import numpy as np
from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from std_srvs.srv import SetBool
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.engine.engine import ChunkResult, Engine
from oxygen_ros.robot.chunks import EXECUTIONS, ChunkFollower, execution_problems
from oxygen_ros.robot.errors import InputError
from oxygen_ros.robot.limits import ActionLimits
from oxygen_ros.robot.rate import RateMeter

from .action_output import OUTPUT_TYPES, chunk_message, command_message, trajectory_message, zero_twist
from .engine_node import status, status_name
from .params import Param, ParameterError, declare_all

ENABLE_SERVICE = "oxygen/enable"   # relative, like every interface name: resolved in the robot's namespace

PARAMS = [
    Param("action_rate_hz", 70.0, "Commands per second.", minimum=1.0, maximum=1000.0),
    Param("output_type", "float64_array", "Message type of /oxygen/action.", choices=tuple(OUTPUT_TYPES)),
    Param("action_topic", "oxygen/action", "Where commands go (relative: in the robot's namespace)."),
    Param("chunk_topic", "oxygen/action_chunk", "Where every new chunk goes (oxygen_interfaces/ActionChunk)."),
    Param("joint_names", [], "Names of the action dimensions (joint_state / joint_trajectory / chunks).", item=str),
    Param("frame_id", "base_link", "Frame of twist / pose commands."),
    Param("rotation", "axis_angle", "Rotation encoding of pose actions.",
          choices=("axis_angle", "euler_xyz", "quaternion_wxyz")),
    Param("lower_limits", [], "Per-dimension lower bound (empty: none).", item=float),
    Param("upper_limits", [], "Per-dimension upper bound (empty: none).", item=float),
    Param("max_velocity", [], "Per-dimension max change per second (empty: none).", item=float),
    Param("interpolate", [], "Per action dimension: true where it is position-like (interpolated between chunk "
                             "rows), false where velocity-like (held for its row's control period). Empty: all held.", item=bool),
    Param("replan_steps", 0, "Rows the current chunk plays before a newer chunk takes over (openpi's "
                             "open_loop_horizon / replan_steps; 0: at once).", minimum=0),
    Param("execution", "naive", "How a new chunk takes over: naive (at once, at its row meant for now), blend "
                                "(mixed in linearly over blend_steps ticks), rtc (at once, without blending: "
                                "real-time chunking made it continue the playing chunk; docs/rtc.md).",
          choices=EXECUTIONS),
    Param("blend_steps", 0, "Ticks over which a new chunk is blended in linearly (execution blend only).",
          minimum=0, maximum=1000),
    Param("on_exhausted", "hold", "Past the chunk's last row: hold it, or stop.", choices=("hold", "stop")),
    Param("hold_timeout_s", 1.0, "Longest hold before stopping anyway.", minimum=0.0),
    Param("on_stale", "stop", "Inputs stale (no camera/state): stop, or hold the last command.",
          choices=("stop", "hold")),
    Param("start_enabled", True, "Publish commands from the start (else wait for /oxygen/enable)."),
]


class ActionPublisher(Node):
    def __init__(self, engine: Engine, inputs_fresh=None, robot: str = "", **node_kwargs):
        """robot: whose chunks to play (a fleet's robot name; "" for the single robot)."""
        super().__init__("oxygen_action", **node_kwargs)
        self.engine = engine
        self.robot = robot
        info = engine.robot_info(robot)
        self.p, problems = declare_all(self, PARAMS)
        p = self.p
        self.inputs_fresh = inputs_fresh or (lambda: True)
        dim = info.action_dim
        self.names = list(p["joint_names"])
        if self.names and len(self.names) != dim:
            problems.append(f"joint_names has {len(self.names)} names, the actions have {dim} dimensions")
        if p["interpolate"] and len(p["interpolate"]) != dim:
            problems.append(f"interpolate has {len(p['interpolate'])} entries, the actions have {dim} dimensions")
        if p["output_type"] in ("joint_state", "joint_trajectory") and not self.names:
            problems.append(f"output_type {p['output_type']} needs joint_names")
        if abs(info.action_rate_hz - p["action_rate_hz"]) > 1e-9:
            problems.append(f"action_rate_hz {p['action_rate_hz']} differs from the engine's "
                            f"{info.action_rate_hz} (chunk rows would be mistimed)")
        if p["execution"] in EXECUTIONS and p["blend_steps"] >= 0 and p["replan_steps"] >= 0:
            # the combination (each value alone was checked by declare_all)
            problems += execution_problems(p["execution"], p["blend_steps"], p["replan_steps"])
        if p["execution"] == "rtc" and not engine.config.rtc:
            problems.append("execution 'rtc' plays chunks the engine guided: turn on the engine's real-time "
                            "chunking (oxygen_engine rtc: true)")
        try:
            self.limits = ActionLimits.from_config(dim, p["lower_limits"] or None, p["upper_limits"] or None,
                                                   p["max_velocity"] or None, 1.0 / p["action_rate_hz"])
        except InputError as e:
            problems.append(str(e))
        if problems:
            raise ParameterError("\n".join(problems))

        self.follower = ChunkFollower(p["execution"], p["blend_steps"], p["on_exhausted"],
                                      [bool(v) for v in p["interpolate"]], p["replan_steps"])
        self._incoming: ChunkResult | None = None
        self._incoming_lock = threading.Lock()
        self.enabled = p["start_enabled"]
        engine.actions.set_playing(robot, self.enabled)
        self.active = True          # False while the engine node is inactive: output cannot be enabled
        self.last_status = "no_chunk"
        self.previous: np.ndarray | None = None
        self.clamped_ticks = 0
        self.rate = RateMeter()
        self.commands = 0
        self._hold_since: float | None = None
        self._stopped_sent = False
        self.tick_errors = 0
        self.last_error = ""
        self._shut_down = False
        # One tick and a change of `enabled` never interleave: otherwise a tick that had already checked
        # `enabled` published its command after set_enabled(False)'s final stop (shutdown race).
        self._output_lock = threading.Lock()

        self.pub = self.create_publisher(OUTPUT_TYPES[p["output_type"]], p["action_topic"], 10)
        from oxygen_interfaces.msg import ActionChunk

        self.chunk_pub = self.create_publisher(ActionChunk, p["chunk_topic"], 10)
        group = MutuallyExclusiveCallbackGroup()
        self.timer = self.create_timer(1.0 / p["action_rate_hz"], self._tick, callback_group=group)
        self.create_service(SetBool, ENABLE_SERVICE, self._on_enable, callback_group=MutuallyExclusiveCallbackGroup())
        # The engine's listeners get every robot's chunks: this robot's only.
        engine.add_chunk_listener(lambda chunk: chunk.robot == robot and self._on_chunk(chunk))

    # engine thread: store only, never block
    def _on_chunk(self, chunk: ChunkResult) -> None:
        with self._incoming_lock:
            self._incoming = chunk

    def _on_enable(self, request: SetBool.Request, response: SetBool.Response) -> SetBool.Response:
        if request.data and self._shut_down:
            response.success, response.message = False, "shutting down: action output stays disabled"
            return response
        if request.data and not self.active:
            response.success = False
            response.message = "engine inactive (oxygen_engine lifecycle): activate it first"
            return response
        if request.data and self.engine.faulted:
            # A safe stop is a latch with a reason: it is cleared on purpose, not by enabling in passing.
            response.success = False
            response.message = (f"engine safe stop ({self.engine.faulted}): call /oxygen_engine/clear_safe_stop "
                                "first")
            return response
        self.set_enabled(request.data)
        response.success = True
        response.message = "action output enabled" if request.data else "action output disabled"
        return response

    def shut_down(self) -> None:
        """The first step of a shutdown: output disabled for good (the final stop sent), before the engine
        stops; /oxygen/enable can no longer turn it back on."""
        self._shut_down = True
        self.set_enabled(False)

    def set_enabled(self, enabled: bool) -> None:
        """Disabling waits for a tick in progress, then sends the final stop: no command follows it. The
        engine is told whether the chunks play: while they do not, real-time chunking continues none."""
        with self._output_lock:
            if self.enabled and not enabled:
                self._send_stop(self._now())
            self.enabled = enabled and not self._shut_down
            self.engine.actions.set_playing(self.robot, self.enabled)
        self.get_logger().info("action output " + ("enabled" if self.enabled else "disabled"))

    def _tick(self) -> None:
        with self._output_lock:
            try:
                self._tick_locked()
            except Exception as e:  # noqa: BLE001 - an exception would end rclpy's spin: no ticks, no stop
                self.tick_errors += 1
                self.last_status = "error"
                self.last_error = f"{type(e).__name__}: {e}"
                self.get_logger().error(f"tick failed, actions stopped: {self.last_error}", throttle_duration_sec=1.0)
                self._send_stop(self._now())

    def _tick_locked(self) -> None:
        now = self._now()
        self.rate.tick(now)
        with self._incoming_lock:
            chunk, self._incoming = self._incoming, None
        new_chunk = chunk is not None and self.follower.push(chunk.plan)
        if new_chunk:
            msg = chunk_message(chunk.plan, self.names, chunk.compute_s, chunk.rtc_delay_rows)
            msg.subtask = chunk.subtask          # what the chunk was conditioned on (hierarchy; "" when none)
            self.chunk_pub.publish(msg)
            self._hold_since = None   # holding the newest chunk's last row is fresh again
        if not self.enabled:
            self.last_status = "disabled"
            return
        cmd = self.follower.next(now)
        state = cmd.status
        if not self.inputs_fresh() and self.p["on_stale"] == "stop":
            state = "stale_stop"
        elif cmd.status == "hold":
            self._hold_since = self._hold_since if self._hold_since is not None else now
            if now - self._hold_since > self.p["hold_timeout_s"]:
                state = "hold_timeout"
        if cmd.status != "hold":
            self._hold_since = None
        self.last_status = state
        if cmd.action is None or state in ("stale_stop", "hold_timeout"):
            self._send_stop(now)
            return
        try:
            action, mask = self.limits.apply(cmd.action, self.previous)
        except InputError as e:  # NaN can never be published
            self.get_logger().error(f"command discarded: {e}", throttle_duration_sec=1.0)
            self._send_stop(now)
            return
        self.clamped_ticks += bool(mask.any())
        self.previous = action
        self._stopped_sent = False
        if self.p["output_type"] == "joint_trajectory":
            # The controller interpolates a whole chunk: send each chunk once, when it starts.
            if cmd.switched:
                plan = self.follower.plan
                rows = np.array([self.limits.apply(r)[0] for r in plan.actions])
                self.pub.publish(trajectory_message(plan, rows, now, self.names))
                self.commands += 1
            return
        self.pub.publish(command_message(self.p["output_type"], action, now, self.names, self.p["frame_id"],
                                         self.p["rotation"]))
        self.commands += 1

    def _send_stop(self, now: float) -> None:
        """Stopping = no further commands. A velocity interface gets one explicit zero twist and a
        trajectory controller one empty trajectory (which makes it hold position)."""
        if not self._stopped_sent:
            if self.p["output_type"] == "twist":
                self.pub.publish(zero_twist(now, self.p["frame_id"]))
            elif self.p["output_type"] == "joint_trajectory":
                self.pub.publish(JointTrajectory(joint_names=self.names))
        self._stopped_sent = True
        self.previous = None

    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def diagnostics(self) -> list[DiagnosticStatus]:
        r = self.rate.summary()
        state = self.last_status
        if state in ("ok", "blending"):
            level, message = DiagnosticStatus.OK, "publishing"
        elif state == "disabled":
            level, message = DiagnosticStatus.WARN, "output disabled (/oxygen/enable)"
        elif state == "hold":
            level, message = DiagnosticStatus.WARN, "no fresh chunk: holding the last command"
        elif state == "stale_stop":
            level, message = DiagnosticStatus.ERROR, "inputs stale: actions stopped"
        elif state == "hold_timeout":
            level, message = DiagnosticStatus.ERROR, "no fresh chunk for too long: actions stopped"
        elif state == "error":
            level, message = DiagnosticStatus.ERROR, f"tick failed, actions stopped: {self.last_error}"
        else:
            level, message = DiagnosticStatus.WARN, f"no command ({state})"
        plan = self.follower.plan
        values = dict(r, status=state, commands=self.commands, clamped_ticks=self.clamped_ticks,
                      enabled=self.enabled, tick_errors=self.tick_errors,
                      chunk_age_s=self._now() - plan.stamp_s if plan is not None else "none", **self.follower.stats)
        return [status(status_name("actions", self.robot), level, message, values)]
