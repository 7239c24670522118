"""The oxygen_ros demo's simulated arm as a LeRobot robot (`--robot.type=oxygen_demo`)."""
from .config_oxygen_demo import OxygenDemoConfig
from .oxygen_demo import OxygenDemo

__all__ = ["OxygenDemo", "OxygenDemoConfig"]
