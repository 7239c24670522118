"""The captions task (the robot's memory): a scene caption of a robot's frame every N frames or S seconds.

A caption is an ordinary language request (kind "memory", owner = the robot) attached to the frame it
describes, so it shares that frame's KV and is decoded in the same batches as the conversation's replies;
this task only decides when one is due and keeps the log of finished captions.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Callable

from ..config import EngineConfig
from ..cycle import Frame
from ..requests import Reply, RequestHandle, TextRequest
from ..stats import EngineStats

log = logging.getLogger("oxygen_ros.engine")


@dataclass(frozen=True)
class Caption:
    stamp: float
    frame_index: int
    prompt: str
    text: str
    robot: str = ""                # whose camera the caption describes


class CaptionsTask:
    def __init__(self, config: EngineConfig, stats: EngineStats, submit: Callable[[TextRequest], RequestHandle],
                 notify: Callable[[Caption], None]):
        self.config, self.stats, self.submit, self.notify = config, stats, submit, notify
        self.log: collections.deque[Caption] = collections.deque(maxlen=config.memory_log_size)
        self._last: dict[str, tuple[int, float]] = {}       # per robot: (frame index, time) of its last caption
        self._off: set[str] = set()                          # robots whose frames are never captioned

    def after_chunk(self, f: Frame, now: float) -> None:
        """A robot's frame delivered its chunk: ask for a caption of it if one is due. A failure here costs
        the caption only, never the frame."""
        if f.robot in self._off:
            return
        try:
            self._maybe_caption(f.robot, f.index, now)
        except Exception as e:  # noqa: BLE001 - a caption is optional; the frame and its chunk are not
            self.stats.count("captions_failed")
            self.stats.note_error(f"frame {f.index}: caption not requested: {e}")
            log.exception("caption request failed")

    def _maybe_caption(self, robot: str, index: int, now: float) -> None:
        c = self.config
        last = self._last.get(robot)
        due = (c.memory_every_frames and (last is None or index - last[0] >= c.memory_every_frames)) or \
              (c.memory_period_s and (last is None or now - last[1] >= c.memory_period_s))
        if not due:
            return
        self._last[robot] = (index, now)
        handle = self.submit(TextRequest(c.memory_prompt, max_tokens=c.memory_max_tokens, kind="memory",
                                         owner=robot))
        handle.add_done_callback(lambda reply: self._on_reply(robot, reply))

    def _on_reply(self, robot: str, reply: Reply) -> None:
        if not reply.success:
            self.stats.count("captions_failed")
            return
        caption = Caption(reply.frame_stamp, reply.frame_index, self.config.memory_prompt, reply.text, robot)
        self.log.append(caption)
        self.notify(caption)

    def set_enabled(self, robot: str, enabled: bool) -> None:
        """Captions for this robot's frames or not (a socket client reads no caption topic)."""
        (self._off.discard if enabled else self._off.add)(robot)

    def forget(self, robot: str) -> None:
        self._last.pop(robot, None)
        self._off.discard(robot)
