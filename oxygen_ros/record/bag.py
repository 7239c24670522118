"""A ROS 2 MCAP recording, bounded in size: `oxygen_<start>_<n>.mcap` files in one directory, a new file
when the messages written to the current one pass `max_file_bytes` (before compression, so
files stay under it), the oldest deleted beyond `max_files`. Each file stands on
its own (profile ros2, ros2msg schemas, CDR messages, the run's metadata): `ros2 bag info FILE`,
Foxglove and replay.py open any one of them. Messages arrive already CDR-serialised (raw subscriptions,
rclpy.serialization), so what is stored is byte for byte what went over DDS."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from mcap.well_known import MessageEncoding, Profile, SchemaEncoding
from mcap.writer import CompressionType, Writer

from .msgdef import message_definition, type_name

METADATA = "oxygen_ros"          # the metadata record replay reads (parameters of the recorded run)


class RotatingBag:
    def __init__(self, directory: str | Path, max_file_bytes: int, max_files: int, metadata: dict[str, str],
                 on_new_file: Callable[[], None] | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes, self.max_files = max_file_bytes, max_files
        self.metadata = metadata
        self.on_new_file = on_new_file          # re-writes latched state (the task prompt) into a new file
        self.prefix = time.strftime("oxygen_%Y%m%d_%H%M%S", time.gmtime())
        self.files: list[Path] = []
        self.messages = 0
        self.deleted = 0
        self._writer: Writer | None = None
        self._stream = None
        self._channels: dict[str, int] = {}
        self._schemas: dict[str, int] = {}
        self._sequence = 0
        self._file_bytes = 0

    def write(self, topic: str, msg_type, data: bytes, log_time_ns: int | None = None, rotate: bool = True) -> None:
        """rotate=False keeps this message in the current file: the parts of one observation (images, then
        state) never straddle two files, so a file whose predecessor was deleted has no half frames."""
        if self._writer is None:
            self._open()
        elif rotate and self._file_bytes >= self.max_file_bytes:
            self._close()
            self._open()
        channel = self._channels.get(topic)
        if channel is None:
            name = type_name(msg_type)
            schema = self._schemas.get(name)
            if schema is None:
                schema = self._schemas[name] = self._writer.register_schema(
                    name, SchemaEncoding.ROS2, message_definition(msg_type).encode())
            channel = self._channels[topic] = self._writer.register_channel(topic, MessageEncoding.CDR, schema)
        now = time.time_ns() if log_time_ns is None else log_time_ns
        self._sequence += 1
        self._writer.add_message(channel, log_time=now, data=bytes(data), publish_time=now, sequence=self._sequence)
        self.messages += 1
        self._file_bytes += len(data)

    def _open(self) -> None:
        path = self.directory / f"{self.prefix}_{len(self.files) + self.deleted}.mcap"
        self._stream = open(path, "wb")
        self._writer = Writer(self._stream, compression=CompressionType.ZSTD)
        self._writer.start(profile=Profile.ROS2, library="oxygen_ros recorder (mcap)")
        self._writer.add_metadata(METADATA, self.metadata)
        self._channels, self._schemas = {}, {}
        self._file_bytes = 0
        self.files.append(path)
        while len(self.files) > self.max_files:
            self.files.pop(0).unlink(missing_ok=True)
            self.deleted += 1
        if self.on_new_file is not None:
            self.on_new_file()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.finish()
            self._stream.close()
            self._writer = self._stream = None

    def close(self) -> None:
        self._close()
