from dataclasses import dataclass

from lerobot.robots.config import RobotConfig


@RobotConfig.register_subclass("oxygen_demo")
@dataclass(kw_only=True)
class OxygenDemoConfig(RobotConfig):
    """One episode of the demo's reach task: episode `episode` of `seed`, drawn as oxygen_ros's evaluation
    draws it (oxygen_ros.sim.scene.draw_episode: the same scene and named cube)."""

    seed: int = 1000
    episode: int = 0
    steps: int = 210             # control ticks (actions executed) before the episode counts as failed
    image_size: int = 64         # the base camera's pixels (the demo model's)
    result_file: str = ""        # where the outcome is written as JSON when the episode ends
