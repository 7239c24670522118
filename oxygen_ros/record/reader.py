"""Reading an MCAP file that may be unfinished or hostile, record by record, in the order written.

A process killed while recording leaves a file without its closing summary (and possibly half a record
at its end): mcap's seeking reader refuses it (RecordLengthLimitExceeded, read from the missing footer).
This reader takes the records one by one from the start: it frames them itself, bounded by the file's
size, and parses each with mcap's record classes. A record cut off by the end of the file ends the
reading (`unfinished` says where); anything else that does not parse makes the file unreadable
(McapFileError, one line). A chunk is decompressed only when it says it holds at most
MAX_CHUNK_BYTES (the recorder writes chunks of ~1 MB; a 1 kB zstd frame can claim gigabytes), zstd or
uncompressed only (what the recorder writes). Nothing in a file decides what code runs: schemas are
returned as names, and the caller maps topics to its own types.
"""
from __future__ import annotations

import io
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from mcap.data_stream import ReadDataStream
from mcap.opcode import Opcode
from mcap.records import Channel, Chunk, Message, Metadata, Schema
from mcap.stream_reader import breakup_chunk

MAGIC = b"\x89MCAP0\r\n"
RECORD_HEAD = 9                            # opcode (1 byte) + length (8)
MAX_CHUNK_BYTES = 256 << 20
COMPRESSIONS = ("", "zstd")


class McapFileError(ValueError):
    """The file is not a readable MCAP recording: the message says where and why, in one line."""


@dataclass
class FileContents:
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    messages: list[tuple[str, str, bytes]] = field(default_factory=list)    # (topic, schema name, data)
    unfinished: str = ""                   # non-empty: the file ends before its summary (why, where)


def read_file(path: str | Path) -> FileContents:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < len(MAGIC):
                raise McapFileError(f"{path}: not an MCAP file ({os.fstat(f.fileno()).st_size} bytes)")
            # Mapped, not read: a record is copied out only once its length is known to fit in the file.
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _read(path, data)
    except OSError as e:
        raise McapFileError(f"{path}: {e.strerror or e}") from None


def _read(path: Path, data) -> FileContents:
    if data[:len(MAGIC)] != MAGIC:
        raise McapFileError(f"{path}: not an MCAP file (no MCAP magic at its start)")
    contents = FileContents()
    schemas: dict[int, str] = {}
    channels: dict[int, tuple[str, int]] = {}
    offset = len(MAGIC)
    while True:
        if offset == len(data):
            contents.unfinished = f"ends after {offset} bytes, before its summary"
            return contents
        if offset + RECORD_HEAD > len(data):
            contents.unfinished = f"ends inside a record header at byte {offset}"
            return contents
        opcode, length = struct.unpack_from("<BQ", data, offset)
        if offset == len(MAGIC) and opcode != Opcode.HEADER:
            raise McapFileError(f"{path}: not an MCAP file (its first record is {_name(opcode)}, not a header)")
        body_start = offset + RECORD_HEAD
        if length > len(data) - body_start:
            contents.unfinished = f"ends inside a record of {length} bytes at byte {offset}"
            return contents
        body = data[body_start:body_start + length]
        offset = body_start + length
        if opcode in (Opcode.DATA_END, Opcode.FOOTER):
            return contents                 # the summary that follows repeats what was read
        try:
            for record in _records(opcode, body):
                if isinstance(record, Schema):
                    schemas[record.id] = record.name
                elif isinstance(record, Channel):
                    channels[record.id] = (record.topic, record.schema_id)
                elif isinstance(record, Metadata):
                    contents.metadata.setdefault(record.name, dict(record.metadata))
                elif isinstance(record, Message):
                    topic, schema_id = channels.get(record.channel_id, (None, 0))
                    if topic is None:
                        raise McapFileError(f"message on channel {record.channel_id}, which was never declared")
                    contents.messages.append((topic, schemas.get(schema_id, ""), record.data))
        except McapFileError as e:
            raise McapFileError(f"{path}: record at byte {body_start - RECORD_HEAD}: {e}") from None
        except Exception as e:  # noqa: BLE001 - whatever a malformed record makes mcap raise: one line
            raise McapFileError(f"{path}: record at byte {body_start - RECORD_HEAD} ({_name(opcode)}) does "
                                f"not parse: {type(e).__name__}: {e}") from None


def _records(opcode: int, body: bytes) -> list:
    stream = ReadDataStream(io.BytesIO(body))
    if opcode == Opcode.SCHEMA:
        return [Schema.read(stream)]
    if opcode == Opcode.CHANNEL:
        return [Channel.read(stream)]
    if opcode == Opcode.MESSAGE:
        return [Message.read(stream, len(body))]
    if opcode == Opcode.METADATA:
        return [Metadata.read(stream)]
    if opcode == Opcode.CHUNK:
        chunk = Chunk.read(stream)
        if chunk.compression not in COMPRESSIONS:
            raise McapFileError(f"chunk compression {chunk.compression!r}: only zstd or none is read")
        if chunk.uncompressed_size > MAX_CHUNK_BYTES:
            raise McapFileError(f"a chunk says it holds {chunk.uncompressed_size} bytes, more than "
                                f"{MAX_CHUNK_BYTES} (the recorder writes ~1 MB chunks)")
        return breakup_chunk(chunk, validate_crc=True)
    return []                                # header, indexes, attachments, statistics: not needed


def _name(opcode: int) -> str:
    try:
        return Opcode(opcode).name
    except ValueError:
        return f"opcode {opcode}"
