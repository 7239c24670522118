"""openpi's wire format: msgpack maps whose numpy arrays are tagged maps.

An array travels as {b"__ndarray__": True, b"data": <raw bytes>, b"dtype": <numpy dtype.str>, b"shape":
[...]}, a numpy scalar as {b"__npgeneric__": True, b"data": <value>, b"dtype": <dtype.str>}: what
openpi-client's `msgpack_numpy` packs and unpacks. Written here from that format rather than imported, for
what a server must add: arrays of plain numeric or boolean dtypes only (never object, void or strings),
data whose length must match shape x itemsize, and a precise ProtocolError for anything else, so that a
bad message gets an answer instead of an exception in the server.
"""
from __future__ import annotations

import math

import msgpack
import numpy as np

# Plain numbers and booleans: what observations and actions are made of.
_KINDS = "biuf"
_MAX_DIMS = 8


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


def unpack(data) -> dict:
    """A message from a client -> a dict; ProtocolError when it is not a msgpack map in openpi's format."""
    if isinstance(data, str):
        raise ProtocolError("expected a binary msgpack message (openpi-client's WebsocketClientPolicy.infer), "
                            "got a text frame")
    try:
        message = msgpack.unpackb(data, object_hook=_decode_hook)
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
