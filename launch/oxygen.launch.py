"""Launch oxygen_ros on a robot with a ROS 2 install:

    ros2 launch oxygen_ros oxygen.launch.py robot:=libero params_file:=/path/to/overrides.yaml
    ros2 launch oxygen_ros oxygen.launch.py robot:=droid managed:=true record:=/data/bags console:=8080
    ros2 launch oxygen_ros oxygen.launch.py robot:='' params_file:=/path/to/fleet.yaml   # one engine, many robots
    ros2 launch oxygen_ros oxygen.launch.py robot:=droid namespace:=robot2   # a second robot on the same domain

One process (oxygen_bringup) composes the engine and the observation, action and conversation nodes,
so language requests reach the frame KV cache through in-process handles; `robot` picks
config/<robot>.yaml, `params_file` overrides it (checkpoint, tokenizer, topics...). Both reach oxygen_bringup
as its --robot and --params-file, so its checks apply before anything starts: an unknown node section or
parameter, a wrong type or bound, unparsable YAML, a missing file or a port in use is one line each, and the
process exits with status 2 (docs/robots.md, "Starting it").
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node


def _bringup(context):
    robot = LaunchConfiguration("robot").perform(context)
    params_file = LaunchConfiguration("params_file").perform(context)
    arguments = ["--robot", robot] if robot else []      # robot:='' for a fleet (its params file names each robot's)
    if params_file:
        arguments += ["--params-file", params_file]
    for flag in ("demo", "managed"):
        if LaunchConfiguration(flag).perform(context).lower() in ("true", "1"):
            arguments.append(f"--{flag}")
    for option in ("record", "console", "namespace"):
        value = LaunchConfiguration(option).perform(context)
        if value:
            arguments += [f"--{option}", value]
    return [Node(package="oxygen_ros", executable="oxygen_bringup", arguments=arguments, output="screen",
                 emulate_tty=True)]


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument("robot", default_value="libero",
                              description="libero, droid, aloha or demo; '' for a fleet (docs/fleet.md)"),
        DeclareLaunchArgument("params_file", default_value="", description="ROS parameters YAML overriding the robot config"),
        DeclareLaunchArgument("demo", default_value="false", description="add the simulated robot and demo client"),
        DeclareLaunchArgument("managed", default_value="false",
                              description="leave /oxygen_engine's lifecycle transitions to a lifecycle manager"),
        DeclareLaunchArgument("record", default_value="", description="record the run as ROS 2 MCAP into this directory"),
        DeclareLaunchArgument("console", default_value="", description="serve the operator console on this port"),
        DeclareLaunchArgument("namespace", default_value="",
                              description="ROS namespace of every node (two robots on one ROS domain: robot1, robot2)"),
        OpaqueFunction(function=_bringup),
    ])
