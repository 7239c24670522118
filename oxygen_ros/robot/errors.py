"""Errors for bad input from outside the process: messages, requests and parameters.

Every check in oxygen_ros.robot raises a subclass of InputError whose message names the problem
precisely, so a node can catch InputError alone, log the message and drop the input without crashing.
"""


class InputError(ValueError):
    """Bad input: the message says what is wrong and with which value."""


class ImageError(InputError):
    """A camera image (raw or compressed) that cannot be turned into an RGB array."""


class StateError(InputError):
    """A robot state (joint states or a plain array) that cannot be used."""


class TextError(InputError):
    """A prompt or a question that is not usable text."""


class SyncError(InputError):
    """An input to the observation assembler that does not fit its streams (unknown slot, bad stamp)."""


class ActionError(InputError):
    """An action, action chunk or pose that must not reach the robot (NaN, wrong size, ...)."""


class ConfigError(InputError):
    """A parameter (from YAML or the command line) that is inconsistent or out of range."""


class TimeError(InputError):
    """A time or duration that is not finite or does not fit a ROS message."""
