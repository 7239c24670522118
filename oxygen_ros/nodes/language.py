"""The hierarchical policy's language as ROS sees it, without ROS: which topic each kind of text goes to and
with which QoS, the engine's updates handed from the engine thread to a node's executor, and the points and
boxes of a spatial answer in the robot's camera pixels. The conversation service (one per robot) uses it.

Pixels of a spatial answer. The model writes `<locNNNN>` indices of coordinates normalised over the camera
image it was trained on (LeRobot's VQA labels are normalised over the dataset's camera frame; PaliGemma's
over the image it stretched to 224 px): the black bars the model's resize-with-pad adds are not part of
that frame. So a normalised (x, y) is the camera image's pixel (x · width, y · height), continuous (column
i spans [i, i + 1)), whatever the model's input size, the resize and the padding. A slot the robot config
turns 180° before the model sees it (`rotate_180`) is turned back: (width - x · width, height - y · height),
a box's corners swapped so that x1 <= x2 and y1 <= y2 still hold.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Callable, Sequence

from oxygen_ros.model.pi052 import Located

# kind of LanguageUpdate -> (the conversation service's parameter, default topic, what it carries)
TOPICS = {
    "subtask": ("subtask_topic", "oxygen/subtask", "The robot's current subtask (LanguageUpdate, latched)."),
    "memory": ("progress_topic", "oxygen/progress",
               "The robot's progress memory, rewritten when a subtask completes (LanguageUpdate, latched; "
               "the periodic scene captions stay on memory_topic)."),
    "plan": ("plan_topic", "oxygen/plan", "The plan of the latest interjection's reply (LanguageUpdate, latched)."),
    "speech": ("speech_topic", "oxygen/speech",
               "What the robot says in reply to an interjection (LanguageUpdate, each once, not latched)."),
}
# State, not events: the newest subtask, progress memory and plan are what a node started late (a console, a
# behaviour tree, a logger) needs at once, as /tf_static or /robot_description serve theirs; speech is an
# utterance, said once: a text-to-speech node started later must not say an old sentence again.
LATCHED = ("subtask", "memory", "plan")


def qos_for(kind: str):
    """Reliable; transient local with depth 1 for the state kinds (a late subscriber gets the newest),
    volatile with depth 10 for speech."""
    from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

    if kind in LATCHED:
        return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                          durability=DurabilityPolicy.TRANSIENT_LOCAL)
    return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE,
                      durability=DurabilityPolicy.VOLATILE)


class LanguageOutbox:
    """One robot's language updates on their way from the engine thread (`put`, the engine's language listener:
    enqueue and wake, nothing more) to the executor that publishes them (`take`, in the order they came)."""

    def __init__(self, robot: str, wake: Callable[[], None]):
        self.robot = robot
        self._wake = wake
        self._updates: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, update) -> None:
        if update.robot == self.robot and update.kind in TOPICS:   # the listeners get every robot's updates
            self._updates.put(update)
            self._wake()

    def take(self) -> list:
        out = []
        while True:
            try:
                out.append(self._updates.get_nowait())
            except queue.Empty:
                return out


@dataclass(frozen=True)
class PixelItem:
    label: str
    kind: str
    normalized: tuple[float, ...]
    pixels: tuple[float, ...]            # empty when the image size is unknown


def in_pixels(items: Sequence[Located], width: int, height: int, rotated_180: bool = False) -> list[PixelItem]:
    """`items` (parse_loc_answer's, normalised over the camera image) in that image's pixels; width or height
    0: the size is unknown, the pixels are left empty. See the module docstring for the mapping."""
    out = []
    for item in items:
        pixels: tuple[float, ...] = ()
        if width > 0 and height > 0:
            xs = [v * width for v in item.xy[0::2]]
            ys = [v * height for v in item.xy[1::2]]
            if rotated_180:
                xs, ys = [width - x for x in reversed(xs)], [height - y for y in reversed(ys)]
            pixels = tuple(v for pair in zip(xs, ys) for v in pair)
        out.append(PixelItem(item.label, item.kind, tuple(item.xy), pixels))
    return out
