"""Action rows -> ROS messages, one builder per output type (no node needed: tested directly).

Output types (the robot config picks one):
- float64_array: std_msgs/Float64MultiArray, the action vector (ros2_control forward command
  controllers, e.g. a position or velocity group controller);
- joint_state: sensor_msgs/JointState, positions by joint name;
- joint_trajectory: trajectory_msgs/JointTrajectory: the rest of the chunk from now on, each row at its
  own time_from_start (joint_trajectory_controller);
- twist: geometry_msgs/TwistStamped from [vx, vy, vz, wx, wy, wz, ...] (end-effector velocity);
- pose: geometry_msgs/PoseStamped from [x, y, z, rotation..., ...] with the rotation as axis-angle,
  Euler xyz or a wxyz quaternion (end-effector pose).
"""
from __future__ import annotations

import numpy as np
from builtin_interfaces.msg import Duration, Time
from geometry_msgs.msg import PoseStamped, TwistStamped
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray, MultiArrayDimension
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from oxygen_ros.robot.chunks import ActionChunkPlan
from oxygen_ros.robot.ee import pose_from_action, twist_from_action
from oxygen_ros.robot.trajectory import chunk_to_trajectory_points, seconds_to_duration

OUTPUT_TYPES = {"float64_array": Float64MultiArray, "joint_state": JointState, "joint_trajectory": JointTrajectory,
                "twist": TwistStamped, "pose": PoseStamped}


def ros_time(seconds: float) -> Time:
    sec, nanosec = seconds_to_duration(seconds)
    return Time(sec=sec, nanosec=nanosec)


def command_message(kind: str, action: np.ndarray, now_s: float, names: list[str], frame_id: str,
                    rotation: str):
    """One command for this tick (every type but joint_trajectory)."""
    values = [float(v) for v in action]
    if kind == "float64_array":
        msg = Float64MultiArray(data=values)
        msg.layout.dim = [MultiArrayDimension(label="action", size=len(values), stride=len(values))]
        return msg
    if kind == "joint_state":
        msg = JointState(name=list(names), position=values)
        msg.header.stamp = ros_time(now_s)
        return msg
    if kind == "twist":
        msg = TwistStamped()
        msg.header.stamp, msg.header.frame_id = ros_time(now_s), frame_id
        (msg.twist.linear.x, msg.twist.linear.y, msg.twist.linear.z), \
            (msg.twist.angular.x, msg.twist.angular.y, msg.twist.angular.z) = \
            (map(float, part) for part in twist_from_action(action))
        return msg
    if kind == "pose":
        position, quat = pose_from_action(action, rotation)
        msg = PoseStamped()
        msg.header.stamp, msg.header.frame_id = ros_time(now_s), frame_id
        p, q = msg.pose.position, msg.pose.orientation
        p.x, p.y, p.z = map(float, position)
        q.x, q.y, q.z, q.w = map(float, quat)
        return msg
    raise ValueError(f"no single-command message for output type {kind!r}")


def zero_twist(now_s: float, frame_id: str) -> TwistStamped:
    """The explicit 'stand still' command of a velocity interface."""
    msg = TwistStamped()
    msg.header.stamp, msg.header.frame_id = ros_time(now_s), frame_id
    return msg


def trajectory_message(plan: ActionChunkPlan, actions: np.ndarray, now_s: float, names: list[str]) -> JointTrajectory:
    """The chunk's rows still ahead of now (already clamped: `actions`), timed as the chunk intends."""
    start = min(max(plan.row_at(now_s) + 1, 0), plan.horizon - 1)
    offset = max(plan.time_of_row(start) - now_s, 0.0)
    msg = JointTrajectory(joint_names=list(names))
    msg.header.stamp = ros_time(now_s)
    for positions, t in chunk_to_trajectory_points(actions, plan.step_period_s, start, offset):
        sec, nanosec = seconds_to_duration(t)
        msg.points.append(JointTrajectoryPoint(positions=positions, time_from_start=Duration(sec=sec, nanosec=nanosec)))
    return msg


def chunk_message(plan: ActionChunkPlan, names: list[str], compute_latency_s: float, rtc_delay_rows: int | None,
                  model_actions: np.ndarray | None = None):
    """`model_actions`: the recorder's, with RTC on (what replay restores for the next chunk to continue)."""
    from oxygen_interfaces.msg import ActionChunk

    msg = ActionChunk(frame_index=plan.frame_index, horizon=plan.horizon, dim=plan.actions.shape[1],
                      step_period_s=plan.step_period_s, actions=plan.actions.ravel().tolist(), names=list(names),
                      compute_latency_s=float(compute_latency_s),
                      rtc_delay_rows=rtc_delay_rows or 0)
    if model_actions is not None:
        msg.model_actions = np.ascontiguousarray(model_actions, dtype=np.float32).ravel()
    msg.header.stamp = ros_time(plan.stamp_s)
    return msg
