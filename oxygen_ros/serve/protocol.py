"""openpi's wire format: msgpack maps whose numpy arrays are tagged maps.

An array travels as {b"__ndarray__": True, b"data": <raw bytes>, b"dtype": <numpy dtype.str>, b"shape":
[...]}, a numpy scalar as {b"__npgeneric__": True, b"data": <value>, b"dtype": <dtype.str>}: what
openpi-client's `msgpack_numpy` packs and unpacks. Written here from that format rather than imported, for
what a server must add: arrays of plain numeric or boolean dtypes only (never object, void or strings),
data whose length must match shape x itemsize, and a precise ProtocolError for anything else, so that a
bad message gets an answer instead of an exception in the server.

Before msgpack builds anything, `scan` walks the message's headers (str and bin payloads skipped by their
length) and refuses it past `MAX_OBJECTS` objects or `MAX_DEPTH` nested containers, or at any extension
type: msgpack would otherwise build every object a message declares, holding the interpreter lock (32 MB of
empty maps are 33 million dicts, gigabytes and seconds). An openpi message, a map of a few arrays each
packed as a small map around one bin payload, holds a few hundred objects at most.
"""
from __future__ import annotations

import math

import msgpack
import numpy as np

# Plain numbers and booleans: what observations and actions are made of.
_KINDS = "biuf"
_MAX_DIMS = 8
MAX_OBJECTS = 4096          # objects in one message (each array is ~10: its map, keys, shape and data)
MAX_DEPTH = 16              # nested maps and arrays (an ALOHA observation: 3)


class ProtocolError(ValueError):
    """A message that is not openpi's format: the text says what is wrong with it."""


def _dtype(value) -> np.dtype:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        raise ProtocolError(f"array dtype must be a numpy dtype string such as '<f4', got {type(value).__name__}")
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise ProtocolError(f"array dtype {value!r} is not a numpy dtype") from None
    if dtype.kind not in _KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise ProtocolError(f"array dtype {value!r} is not a plain numeric or boolean dtype")
    return dtype


def _array(obj: dict) -> np.ndarray:
    dtype = _dtype(obj.get(b"dtype"))
    data, shape = obj.get(b"data"), obj.get(b"shape")
    if not isinstance(data, bytes):
        raise ProtocolError(f"array data must be bytes, got {type(data).__name__}")
    if not isinstance(shape, (list, tuple)) or len(shape) > _MAX_DIMS or \
            not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ProtocolError(f"array shape must be a list of at most {_MAX_DIMS} sizes >= 0, got {shape!r}")
    need = math.prod(shape) * dtype.itemsize
    if need != len(data):
        raise ProtocolError(f"array of shape {list(shape)} and dtype {dtype.str} needs {need} bytes, the message "
                            f"has {len(data)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _decode_hook(obj: dict):
    if b"__ndarray__" in obj:
        return _array(obj)
    if b"__npgeneric__" in obj:
        value = obj.get(b"data")
        if not isinstance(value, (bool, int, float)):
            raise ProtocolError(f"numpy scalar data must be a number, got {type(value).__name__}")
        try:
            return _dtype(obj.get(b"dtype")).type(value)
        except OverflowError:
            raise ProtocolError(f"numpy scalar {value!r} does not fit {obj.get(b'dtype')!r}") from None
    return obj


# msgpack's first byte -> how many bytes follow it before the next object: fixed-size scalars.
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
          0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8}
# str 8/16/32 and bin 8/16/32 -> the size of their length field
_SIZED = {0xd9: 1, 0xda: 2, 0xdb: 4, 0xc4: 1, 0xc5: 2, 0xc6: 4}
# array 16/32 -> (length field size, objects per entry); map 16/32 likewise (a key and a value per entry)
_CONTAINERS = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}
_EXT = frozenset((0xc7, 0xc8, 0xc9, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8))


def scan(data: bytes, max_objects: int = MAX_OBJECTS, max_depth: int = MAX_DEPTH) -> int:
    """The number of objects in one msgpack message, counted from its headers without building any (str
    and bin payloads skipped by length); ProtocolError as soon as the count passes `max_objects`, the
    nesting `max_depth`, or at an extension type, a truncated message or bytes after it."""
    size, pos, objects = len(data), 0, 0
    pending = [1]                          # objects still to read at each open nesting level
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        if pos >= size:
            raise ProtocolError(f"not a msgpack message: it ends inside an object (after {size} bytes)")
        objects += 1
        if objects > max_objects:
            raise ProtocolError(f"message refused: more than {max_objects} msgpack objects (an openpi message "
                                f"holds a few hundred; send arrays as msgpack_numpy packs them)")
        head = data[pos]
        pos += 1
        if head <= 0x7f or head >= 0xe0:                      # positive and negative fixint
            continue
        if head <= 0x9f:                                       # fixmap (0x80-0x8f), fixarray (0x90-0x9f)
            count = (head & 0x0f) * (2 if head <= 0x8f else 1)
        elif head <= 0xbf:                                     # fixstr
            pos += head & 0x1f
            continue
        elif head in _FIXED:
            pos += _FIXED[head]
            continue
        elif head in _SIZED:
            n = _SIZED[head]
            pos += n + int.from_bytes(data[pos:pos + n], "big")
            continue
        elif head in _CONTAINERS:
            n, per_entry = _CONTAINERS[head]
            count = int.from_bytes(data[pos:pos + n], "big") * per_entry
            pos += n
        elif head in _EXT:
            raise ProtocolError(f"message refused: msgpack extension type (byte 0x{head:02x} at offset {pos - 1}); "
                                f"openpi messages have none")
        else:                                                  # 0xc1: never used
            raise ProtocolError(f"not a msgpack message: byte 0x{head:02x} at offset {pos - 1}")
        if len(pending) > max_depth:
            raise ProtocolError(f"message refused: nested deeper than {max_depth} maps or arrays")
        if count:
            pending.append(count)
    if pos != size:
        what = "ends inside an object" if pos > size else f"has {size - pos} bytes after its one object"
        raise ProtocolError(f"not a msgpack message: it {what}")
    return objects


def _no_extensions(code: int, data: bytes):
    raise ProtocolError(f"message refused: msgpack extension type {code}; openpi messages have none")


def unpack(data) -> dict:
    """A message from a client -> a dict; ProtocolError when it is not a msgpack map in openpi's format or
    holds more than `MAX_OBJECTS` objects or `MAX_DEPTH` levels (refused by `scan` before decoding)."""
    if isinstance(data, str):
        raise ProtocolError("expected a binary msgpack message (openpi-client's WebsocketClientPolicy.infer), "
                            "got a text frame")
    scan(data)
    try:
        # scan() bounds every count; these limits say the same to msgpack, whose own defaults follow the size
        message = msgpack.unpackb(data, object_hook=_decode_hook, ext_hook=_no_extensions,
                                  max_array_len=MAX_OBJECTS, max_map_len=MAX_OBJECTS, max_ext_len=0)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for malformed input
        raise ProtocolError(f"not a msgpack message: {type(e).__name__}: {e}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"expected a msgpack map of observation keys, got {type(message).__name__}")
    return message


def _encode_hook(obj):
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _KINDS:
            raise TypeError(f"cannot send an array of dtype {obj.dtype}")
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send {type(obj).__name__}")


def pack(message: dict) -> bytes:
    """A reply (or the metadata) -> bytes that openpi-client's msgpack_numpy.unpackb reads."""
    return msgpack.packb(message, default=_encode_hook)
