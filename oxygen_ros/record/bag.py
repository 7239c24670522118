"""A ROS 2 MCAP recording, bounded in size: `oxygen_<start>_<n>.mcap` files in one directory, a new file
when the messages written to the current one pass `max_file_bytes` (before compression, so
files stay under it), the oldest deleted beyond `max_files`. Each file stands on
its own (profile ros2, ros2msg schemas, CDR messages, the run's metadata): `ros2 bag info FILE`,
Foxglove and replay.py open any one of them. Messages arrive already CDR-serialised (raw subscriptions,
rclpy.serialization), so what is stored is byte for byte what went over DDS.

Counting is exact: a message counts as written (`messages`) once a flush has put it in the file; the
mcap writer holds the chunk in progress in memory until then. `flush()` (the recorder calls it every
`flush_period_s`) bounds what a crash of the process can lose: the file on disk is a valid MCAP up to its
last flush (without its closing summary: replay reads such unfinished files).

Write errors (a full disk, no file descriptor left): the file in progress is cut back to its last flush
(so it ends on a whole record), the messages since that flush are counted in `dropped`, and the
recording goes on in a new file as soon as one can be written (tried again every `retry_s`; messages
meanwhile are dropped and counted). Before, a full disk while a file was being finished jammed the
writer for good and lost messages it had counted as written."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from mcap.well_known import MessageEncoding, Profile, SchemaEncoding
from mcap.writer import CompressionType, Writer

from .msgdef import message_definition, type_name

METADATA = "oxygen_ros"          # the metadata record replay reads (parameters of the recorded run)


class RotatingBag:
    def __init__(self, directory: str | Path, max_file_bytes: int, max_files: int, metadata: dict[str, str],
                 on_new_file: Callable[[], None] | None = None, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, log: Callable[[bool, str], None] | None = None):
        """log(is_error, line): told of each write error and each recovery."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes, self.max_files = max_file_bytes, max_files
        self.metadata = metadata
        self.on_new_file = on_new_file          # re-writes latched state (the task prompt) into a new file
        self.retry_s, self.clock, self.log = retry_s, clock, log or (lambda is_error, line: None)
        self.prefix = time.strftime("oxygen_%Y%m%d_%H%M%S", time.gmtime())
        self.files: list[Path] = []
        self.messages = 0              # in a file (flushed)
        self.dropped = 0               # lost to write errors, never in a file
        self.write_errors = 0
        self.last_error = ""
        self.deleted = 0
        self._writer: Writer | None = None
        self._stream = None
        self._channels: dict[str, int] = {}
        self._schemas: dict[str, int] = {}
        self._sequence = 0
        self._file_bytes = 0
        self._pending = 0              # messages given to the writer since its last flush
        self._flushed_at = 0           # size of the current file at its last flush
        self._retry_at: float | None = None     # after a write error: no file until then

    def write(self, topic: str, msg_type, data: bytes, log_time_ns: int | None = None, rotate: bool = True) -> bool:
        """rotate=False keeps this message in the current file: the parts of one observation (images, then
        state) never straddle two files, so a file whose predecessor was deleted has no half frames.
        False when the message was dropped (a write error now or not long ago: counted in `dropped`)."""
        if self._writer is not None and rotate and self._file_bytes >= self.max_file_bytes:
            self._finish()
        # A frame's later part never starts a file (its first part was dropped: no half frames).
        if self._writer is None and not (rotate and self._open()):
            self.dropped += 1
            return False
        try:
            self._pending += 1           # counted first: this call may write (and fail to write) a whole chunk
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
            self._writer.add_message(channel, log_time=now, data=bytes(data), publish_time=now,
                                     sequence=self._sequence)
        except OSError as e:
            self._failed(e)
            return False
        self._file_bytes += len(data)
        return True

    @property
    def failing(self) -> bool:
        """The last write failed and no file has been opened since."""
        return self._retry_at is not None

    def flush(self) -> None:
        """Everything given so far into the file (the chunk in progress finished, the stream flushed)."""
        if self._writer is None:
            return
        try:
            self._writer.flush()
        except OSError as e:
            self._failed(e)
            return
        self._flushed()

    def close(self) -> None:
        """Finish the current file (its summary makes it seekable). OSError if that failed: the file is then
        left as of its last flush and its unflushed messages are counted in `dropped`."""
        if self._writer is None:
            return
        errors = self.write_errors
        self._finish()
        if self.write_errors > errors:
            raise OSError(f"finishing {self.files[-1].name if self.files else 'the file'}: {self.last_error}")

    # ------------------------------------------------------------------ files
    def _open(self) -> bool:
        if self._retry_at is not None and self.clock() < self._retry_at:
            return False
        path = self.directory / f"{self.prefix}_{len(self.files) + self.deleted}.mcap"
        self._pending = self._flushed_at = 0
        try:
            self._stream = open(path, "wb")
            self._writer = Writer(self._stream, compression=CompressionType.ZSTD)
            self._writer.start(profile=Profile.ROS2, library="oxygen_ros recorder (mcap)")
            self._writer.add_metadata(METADATA, self.metadata)
            self._stream.flush()
        except OSError as e:
            self.files.append(path)       # what was written of it is cut back (to nothing) in _failed
            self._failed(e)
            return False
        self._channels, self._schemas = {}, {}
        self._file_bytes = 0
        self._flushed_at = self._stream.tell()
        self.files.append(path)
        while len(self.files) > self.max_files:
            self.files.pop(0).unlink(missing_ok=True)
            self.deleted += 1
        if self._retry_at is not None:
            self._retry_at = None
            self.log(False, f"recording again, in {path.name} (after: {self.last_error}; {self.dropped} messages "
                     f"dropped so far)")
        if self.on_new_file is not None:
            self.on_new_file()
        return True

    def _finish(self) -> None:
        try:
            self._writer.finish()
            self._stream.flush()
            self._flushed()
            self._stream.close()
        except OSError as e:
            self._failed(e)
            return
        self._writer = self._stream = None

    def _flushed(self) -> None:
        self.messages += self._pending
        self._pending = 0
        self._flushed_at = self._stream.tell()

    def _failed(self, error: OSError) -> None:
        """Give up the current file: cut it back to its last flush (a whole record; truncating needs no
        free space), count what was not flushed as dropped, and try a new file after retry_s."""
        self.write_errors += 1
        self.last_error = f"{type(error).__name__}: {error}"
        path = self.files[-1] if self.files else None
        stream, self._writer, self._stream = self._stream, None, None
        if stream is not None:
            try:
                stream.close()          # its buffer cannot be written: closing raises, the descriptor is freed
            except OSError:
                pass
        if path is not None and path.exists():
            try:
                os.truncate(path, self._flushed_at)
            except OSError:
                pass
            if self._flushed_at == 0:
                path.unlink(missing_ok=True)
                self.files.pop()
        self.dropped += self._pending
        self.log(True, f"recording: {self.last_error}: {self._pending} messages not in {path.name if path else 'a file'} "
                 f"dropped; trying a new file every {self.retry_s:g} s")
        self._pending = 0
        self._flushed_at = 0
        self._retry_at = self.clock() + self.retry_s
