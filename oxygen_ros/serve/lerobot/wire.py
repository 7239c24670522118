"""LeRobot's async-inference payloads, read without `pickle.loads`.

LeRobot 0.6.1's robot_client pickles three dataclasses of `lerobot.async_inference.helpers` (recreated here
under those names): a `RemotePolicyConfig` (SendPolicyInstructions), a `TimedObservation` (SendObservations:
floats per motor, numpy camera images, the task string) and, from the server, a `list[TimedAction]`
(GetActions: torch tensors). Unpickling what a network peer sent runs whatever the pickle names, so this
module decodes with a restricted unpickler instead:

  1. a byte cap (`DecodeLimits.max_bytes`, checked on the reassembled stream before anything else);
  2. an opcode scan (pickletools, nothing built): at most `max_opcodes` opcodes, every declared length and
     frame within the bytes present, memo indices within the opcodes seen (the C unpickler sizes its memo
     by the index it is given), no persistent ids, extension codes, out-of-band buffers or protocol-0/1
     class instantiation, nothing after STOP;
  3. the unpickler, whose `find_class` knows only the globals of the message expected (per RPC), each
     mapped to a stand-in that allocates nothing before checking: numpy's `_reconstruct` makes an empty
     builder (never an array of the shape it is given), whose state must carry exactly shape x itemsize
     bytes; `numpy.dtype` accepts numeric dtypes only (no object arrays, no structured or void types); a
     numpy scalar's bytes must be its itemsize; a torch tensor's storage is read from LeRobot's legacy
     `torch.save` bytes by this module (never `torch.load`) and its view must lie inside the storage;
  4. a walk of the result: the message's dataclass, containers nested at most `max_depth` deep, leaves of
     the allowed kinds only, arrays materialised.

What a message BUILDS is budgeted, not only what it sends (`_Budget`, one per message): every array, tensor
storage and further tensor of one storage is charged before it is made, against `max_built_bytes` (by default
the message's own length: an honest pickle carries every byte its arrays hold, so only memo reuse of one
buffer could build more) and `max_arrays`; the walk of step 4 counts every object it visits against
`max_opcodes` (a container reached again through the memo would be copied once per reference: an honest pickle
visits at most one object per opcode); and the whole decode has `max_seconds` of CPU time (its thread's: a
loaded machine's waits are not the message's cost). A 1 MiB buffer named 2,000 times, or feature lists
referencing each other 10^8 times, are refused in milliseconds, having built at most their budget.

Every refusal is a `Refused` (the peer sent something malformed or not allowed) or `TooLarge` (over a
limit) with the reason; the server turns them into INVALID_ARGUMENT / RESOURCE_EXHAUSTED.

Replies are pickled with the standard library's pure-Python pickler, whose global names for the three
classes are written as LeRobot's (`lerobot.async_inference.helpers.TimedAction`): the client unpickles
them into its own classes.
"""
from __future__ import annotations

import collections
import io
import math
import pickle
import pickletools
import time
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import numpy as np
import torch

LEROBOT_MODULE = "lerobot.async_inference.helpers"
PICKLE_PROTOCOL = 4          # what LeRobot's client writes (Python 3.12/3.13's default)


class Refused(ValueError):
    """A payload that is malformed or names what is not allowed (INVALID_ARGUMENT)."""


class TooLarge(Refused):
    """A payload over a size, count or depth limit (RESOURCE_EXHAUSTED)."""


# ---------------------------------------------------------------------------------- LeRobot's three classes
def clipped(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters, saying how long it was (a client's names go into errors and logs)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class _Recreated:
    """BUILD sets exactly the dataclass's fields (LeRobot pickles them as the instance's __dict__)."""

    def __setstate__(self, state):
        names = {f.name for f in fields(self)}
        if type(state) is not dict or not all(type(k) is str for k in state):
            raise Refused(f"{type(self).__name__}: its state must be a dict of field names, got "
                          f"{type(state).__name__}")
        unknown = sorted(set(state) - names)
        if unknown:
            raise Refused(clipped(f"{type(self).__name__}: unknown fields {unknown} (LeRobot's are {sorted(names)})"))
        self.__dict__.update(state)


@dataclass
class TimedObservation(_Recreated):
    timestamp: float
    timestep: int
    observation: dict
    must_go: bool = False


@dataclass
class TimedAction(_Recreated):
    timestamp: float
    timestep: int
    action: torch.Tensor


@dataclass
class RemotePolicyConfig(_Recreated):
    policy_type: str
    pretrained_name_or_path: str
    lerobot_features: dict
    actions_per_chunk: int
    device: str = "cpu"
    rename_map: dict = field(default_factory=dict)


_LEROBOT_NAMES = {TimedObservation: "TimedObservation", TimedAction: "TimedAction",
                  RemotePolicyConfig: "RemotePolicyConfig"}


class _LeRobotPickler(pickle._Pickler):
    """The standard pickler (pure Python), writing the three classes under LeRobot's module name."""

    def save_global(self, obj, name=None):
        alias = _LEROBOT_NAMES.get(obj)
        if alias is None:
            return super().save_global(obj, name)
        self.save(LEROBOT_MODULE)
        self.save(alias)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def encode(obj: Any) -> bytes:
    """`obj` pickled as LeRobot's own code pickles it (its classes under LeRobot's names)."""
    buf = io.BytesIO()
    _LeRobotPickler(buf, protocol=PICKLE_PROTOCOL).dump(obj)
    return buf.getvalue()


# ---------------------------------------------------------------------------------- limits and the scan
@dataclass(frozen=True)
class DecodeLimits:
    max_bytes: int = 32 << 20        # the reassembled stream (LeRobot sends ~1 MB per 640x480 camera)
    max_opcodes: int = 10_000        # a real observation or policy config has a few hundred
    max_depth: int = 12              # containers within containers (a config's features are 4 deep)
    max_ndim: int = 8
    max_built_bytes: int | None = None   # arrays, tensors and storages built; None: the message's own length
    max_arrays: int = 64             # arrays, tensors and numpy scalars built (an SO-101: 2 cameras, 6 joints)
    max_seconds: float = 0.5         # one message's whole decode, CPU time of its thread (a real one: ms)

    def problems(self) -> list[str]:
        out = [f"{name} {getattr(self, name)} must be at least 1" for name in
               ("max_bytes", "max_opcodes", "max_depth", "max_ndim", "max_arrays") if getattr(self, name) < 1]
        if self.max_built_bytes is not None and self.max_built_bytes < 0:
            out.append(f"max_built_bytes {self.max_built_bytes} must be at least 0")
        if not self.max_seconds > 0:
            out.append(f"max_seconds {self.max_seconds} must be positive")
        return out


class _Budget:
    """What one message may build: bytes of arrays/tensors/storages, their count, objects walked, time.
    Charged before each thing is made, so that a refusal has built at most the budget."""

    def __init__(self, limits: DecodeLimits, message_bytes: int, what: str):
        cap = message_bytes if limits.max_built_bytes is None else min(message_bytes, limits.max_built_bytes)
        self.limits, self.what, self.bytes_left, self.arrays_left = limits, what, cap, limits.max_arrays
        self.cap, self.nodes_left = cap, limits.max_opcodes
        self.deadline = time.thread_time() + limits.max_seconds

    def build(self, nbytes: int, kind: str) -> None:
        self.arrays_left -= 1
        self.bytes_left -= nbytes
        if self.arrays_left < 0:
            raise TooLarge(f"{self.what}: more than {self.limits.max_arrays} arrays and tensors")
        if self.bytes_left < 0:
            raise TooLarge(f"{self.what}: its arrays and tensors would build more than {self.cap} bytes (a {kind} "
                           f"of {nbytes} bytes over the budget; memo reuse of one buffer is never needed)")
        self.check_time()

    def visit(self) -> None:
        self.nodes_left -= 1
        if self.nodes_left < 0:
            raise TooLarge(f"{self.what}: more than {self.limits.max_opcodes} objects to build (shared references "
                           "through the pickle memo: each becomes a copy)")
        if self.nodes_left % 256 == 0:
            self.check_time()

    def check_time(self) -> None:
        if time.thread_time() > self.deadline:
            raise TooLarge(f"{self.what}: decoding took more than {self.limits.max_seconds:g} s of CPU time")


_REFUSED_OPCODES = {
    "PERSID": "persistent ids are refused", "BINPERSID": "persistent ids are refused",
    "EXT1": "extension-registry globals are refused", "EXT2": "extension-registry globals are refused",
    "EXT4": "extension-registry globals are refused",
    "NEXT_BUFFER": "out-of-band buffers are refused", "READONLY_BUFFER": "out-of-band buffers are refused",
    "INST": "protocol-0 class instantiation is refused", "OBJ": "protocol-1 class instantiation is refused",
}
_MEMO_OPCODES = {"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"}


def scan(data: bytes | memoryview, limits: DecodeLimits, what: str = "payload", start: int = 0,
         persistent_ids: bool = False) -> int:
    """Check one pickle starting at `start` without building anything; returns the offset after its STOP.
    `persistent_ids`: only for a torch storage record (its own unpickler checks the id)."""
    view = memoryview(data)[start:]
    stream = io.BytesIO(view)
    count, marks = 0, 0
    try:
        for op, arg, pos in pickletools.genops(stream):
            count += 1
            if count > limits.max_opcodes:
                raise TooLarge(f"{what}: more than {limits.max_opcodes} pickle opcodes")
            if op.name in _REFUSED_OPCODES and not (persistent_ids and op.name == "BINPERSID"):
                raise Refused(f"{what}: {_REFUSED_OPCODES[op.name]} (opcode {op.name} at byte {pos})")
            if op.name == "FRAME" and pos + 9 + arg > len(view):
                raise Refused(f"{what}: a frame declares {arg} bytes at byte {pos}; {len(view) - pos - 9} follow")
            if op.name in _MEMO_OPCODES and arg > count:
                raise Refused(f"{what}: memo index {arg} at byte {pos} (only {count} opcodes so far)")
            if op.name == "MARK":
                marks += 1
                if marks > limits.max_depth:
                    raise TooLarge(f"{what}: nested deeper than {limits.max_depth} levels")
            elif pickletools.markobject in op.stack_before:
                marks -= 1
            if op.name == "STOP":
                return start + stream.tell()
    except Refused:
        raise
    except ValueError as e:       # truncated data, a length beyond the bytes present, a bad opcode
        raise Refused(f"{what}: malformed pickle: {e}") from None
    raise Refused(f"{what}: malformed pickle: no STOP")


# ---------------------------------------------------------------------------------- numpy stand-ins
_DTYPES = ("b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8")


class _Dtype:
    """`numpy.dtype(name, align, copy)` while decoding: numeric types only."""

    def __init__(self, name, align=False, copy=True):
        if not isinstance(name, str) or name not in _DTYPES:
            raise Refused(f"dtype {name!r} refused: only numeric arrays ({', '.join(_DTYPES)}); object, "
                          "structured and void arrays are never decoded")
        self.dtype = np.dtype(name)

    def __setstate__(self, state):
        ok = (isinstance(state, tuple) and len(state) in (8, 9) and state[1] in ("<", ">", "|", "=")
              and state[2:5] == (None, None, None) and state[5:8] == (-1, -1, 0) and state[8:] in ((), (None,)))
        if not ok:
            raise Refused(f"dtype {self.dtype.str}: unexpected state {str(state)[:80]}")
        if state[1] in ("<", ">"):
            self.dtype = self.dtype.newbyteorder(state[1])


def _shape(value, limits: DecodeLimits, what: str) -> tuple[int, ...]:
    if (not isinstance(value, tuple) or len(value) > limits.max_ndim
            or not all(type(d) is int and d >= 0 for d in value)):
        raise Refused(f"{what}: shape must be a tuple of at most {limits.max_ndim} non-negative ints, got "
                      f"{str(value)[:80]}")
    return value


def _array(data, dtype, shape, fortran: bool, budget: _Budget) -> np.ndarray:
    if not isinstance(dtype, _Dtype):
        raise Refused(f"array: dtype must be a numpy dtype, got {type(dtype).__name__}")
    shape = _shape(shape, budget.limits, "array")
    if type(data) not in (bytes, bytearray):
        raise Refused(f"array: its data must be bytes, got {type(data).__name__}")
    nbytes = math.prod(shape) * dtype.dtype.itemsize
    if len(data) != nbytes:
        raise Refused(f"array of shape {list(shape)} {dtype.dtype.str} needs {nbytes} bytes, carries {len(data)}")
    budget.build(nbytes, "array")
    # A copy of the bytes present (never more): writable, and its own memory.
    return np.frombuffer(data, dtype=dtype.dtype).reshape(shape, order="F" if fortran else "C").copy(
        order="F" if fortran else "C")


class _ArrayBuilder:
    """What numpy's `_reconstruct` returns while decoding: nothing allocated until BUILD brings the bytes."""

    def __init__(self, budget: _Budget):
        self.budget, self.array = budget, None

    def __setstate__(self, state):
        if type(state) is not tuple or len(state) != 5 or state[0] != 1 or not isinstance(state[3], bool):
            raise Refused(f"array: unexpected state {str(state)[:80]}")
        self.array = _array(state[4], state[2], state[1], state[3], self.budget)


class _NdarrayType:
    """`numpy.ndarray` as an argument of `_reconstruct` (the only place LeRobot's pickles name it)."""


def _numpy_globals(budget: _Budget) -> dict:
    def reconstruct(subtype, shape, typecode):
        if subtype is not _NdarrayType or type(shape) is not tuple or shape != (0,) or typecode != b"b":
            raise Refused(f"numpy _reconstruct({getattr(subtype, '__name__', subtype)}, {str(shape)[:40]}, "
                          f"{str(typecode)[:20]}): only plain arrays as numpy pickles them")
        return _ArrayBuilder(budget)

    def scalar(dtype, data):
        if not isinstance(dtype, _Dtype) or type(data) is not bytes or len(data) != dtype.dtype.itemsize:
            raise Refused("numpy scalar: a numeric dtype and exactly its itemsize in bytes")
        budget.build(len(data), "numpy scalar")
        return np.frombuffer(data, dtype=dtype.dtype)[0]

    def frombuffer(buf, dtype, shape, order):
        if type(order) is not str or order not in ("C", "F"):
            raise Refused(f"array: order must be C or F, got {str(order)[:10]}")
        return _array(buf, dtype, shape, order == "F", budget)

    out = {("numpy", "ndarray"): _NdarrayType, ("numpy", "dtype"): _Dtype}
    for core in ("numpy._core", "numpy.core"):     # numpy 2 writes numpy._core, numpy 1 numpy.core
        out[(f"{core}.multiarray", "_reconstruct")] = reconstruct
        out[(f"{core}.multiarray", "scalar")] = scalar
        out[(f"{core}.numeric", "_frombuffer")] = frombuffer
    return out


# ---------------------------------------------------------------------------------- torch stand-ins
_STORAGES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
             "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
             "BoolStorage": torch.bool}
_TORCH_MAGIC = 0x1950A86A20F9469CFC6C
_TORCH_PROTOCOL = 1001


@dataclass(frozen=True)
class _StorageKind:
    dtype: torch.dtype


@dataclass
class _Storage:
    data: torch.Tensor        # 1-D, its own memory
    rebuilt: bool = False     # a tensor was made of it (its first tensor is its bytes, already charged)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, allowed: dict, what: str):
        super().__init__(file)
        self.allowed, self.what = allowed, what

    def find_class(self, module, name):
        obj = self.allowed.get((module, name))
        if obj is None:
            raise Refused(f"{self.what}: refused global {module}.{name} (not something LeRobot's client sends "
                          f"in this message)")
        return obj

    def persistent_load(self, pid):
        raise Refused(f"{self.what}: persistent ids are refused")


class _StorageUnpickler(_Unpickler):
    """The storage record of LeRobot's legacy `torch.save` bytes: ('storage', kind, key, 'cpu', numel)."""

    def persistent_load(self, pid):
        if (not isinstance(pid, tuple) or len(pid) not in (5, 6) or pid[0] != "storage"
                or not isinstance(pid[1], _StorageKind) or not isinstance(pid[2], str) or pid[3] != "cpu"
                or type(pid[4]) is not int or pid[4] < 0 or pid[5:] not in ((), (None,))):
            raise Refused(f"{self.what}: unexpected storage record {str(pid)[:80]}")
        return pid


def _load_one(data: bytes, start: int, allowed: dict, budget: _Budget, what: str,
              unpickler=_Unpickler) -> tuple[Any, int]:
    budget.check_time()
    end = scan(data, budget.limits, what, start, persistent_ids=unpickler is _StorageUnpickler)
    return unpickler(io.BytesIO(memoryview(data)[start:end]), allowed, what).load(), end


def _storage_from_bytes(data, budget: _Budget) -> _Storage:
    """`torch.storage._load_from_bytes` (a storage pickled by a tensor) read by hand: the legacy format's
    magic, version, system info, the storage record, its key, then numel and the raw bytes."""
    what = "tensor storage"
    if type(data) is not bytes:
        raise Refused(f"{what}: must be bytes")
    magic, pos = _load_one(data, 0, {}, budget, what)
    version, pos = _load_one(data, pos, {}, budget, what)
    info, pos = _load_one(data, pos, {}, budget, what)
    if magic != _TORCH_MAGIC or version != _TORCH_PROTOCOL or not isinstance(info, dict) \
            or info.get("little_endian") is not True:
        raise Refused(f"{what}: not a little-endian legacy torch.save stream")
    kinds = {("torch", name): _StorageKind(dtype) for name, dtype in _STORAGES.items()}
    record, pos = _load_one(data, pos, kinds, budget, what, _StorageUnpickler)
    keys, pos = _load_one(data, pos, {}, budget, what)
    if not isinstance(record, tuple) or keys != [record[2]]:
        raise Refused(f"{what}: expected one storage")
    kind, numel = record[1], record[4]
    itemsize = torch.empty((), dtype=kind.dtype).element_size()
    header = data[pos:pos + 8]
    if len(header) != 8 or int.from_bytes(header, "little") != numel:
        raise Refused(f"{what}: its size header does not match its record ({numel} elements)")
    raw = data[pos + 8:]
    if len(raw) != numel * itemsize:
        raise Refused(f"{what}: {numel} elements need {numel * itemsize} bytes, carries {len(raw)}")
    budget.build(len(raw), "tensor storage")
    return _Storage(torch.frombuffer(bytearray(raw), dtype=kind.dtype) if numel else
                    torch.empty(0, dtype=kind.dtype))


class _OrderedDict(collections.OrderedDict):
    """`collections.OrderedDict()` while decoding (a tensor's empty backward hooks): items only, no state (a
    BUILD would otherwise set instance attributes such as `items` over the class's methods)."""

    def __setstate__(self, state):
        raise Refused(f"an OrderedDict with a state ({type(state).__name__}) is refused: only items")


def _torch_globals(budget: _Budget) -> dict:
    limits = budget.limits

    def rebuild(storage, offset, size, stride, requires_grad, hooks, *metadata):
        if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0:
            raise Refused("tensor: a storage and a non-negative offset")
        size = _shape(tuple(size) if type(size) in (tuple, list) else size, limits, "tensor")
        stride = _shape(tuple(stride) if type(stride) in (tuple, list) else stride, limits, "tensor stride")
        if len(stride) != len(size) or type(hooks) is not _OrderedDict or hooks or metadata not in ((), (None,)):
            raise Refused("tensor: one stride per dimension, no backward hooks, no metadata")
        numel, available = math.prod(size), storage.data.numel()
        if numel and (numel > available or offset + sum((s - 1) * st for s, st in zip(size, stride)) >= available):
            raise Refused(f"tensor of size {list(size)} (stride {list(stride)}, offset {offset}) does not lie "
                          f"inside its storage of {available} elements")
        if storage.rebuilt:                  # one more copy of the same bytes (a view, or memo reuse)
            budget.build(numel * storage.data.element_size(), "tensor")
        storage.rebuilt = True
        return torch.as_strided(storage.data, size, stride, offset).clone()

    return {("torch._utils", "_rebuild_tensor_v2"): rebuild,
            ("torch.storage", "_load_from_bytes"): lambda b: _storage_from_bytes(b, budget),
            ("collections", "OrderedDict"): _OrderedDict}


# ---------------------------------------------------------------------------------- decoding
_LEAVES = (type(None), bool, int, float, str, np.ndarray, np.bool_, np.integer, np.floating, torch.Tensor)


def _materialise(obj, budget: _Budget, depth: int = 0):
    """The decoded tree with array builders replaced by their arrays; Refused for any other kind of object.
    Every object visited is charged to the budget: a container the memo shares is walked (and copied) once per
    reference, so sharing cannot multiply the work beyond `max_opcodes` visits."""
    budget.visit()
    limits = budget.limits
    if depth > limits.max_depth:
        raise TooLarge(f"nested deeper than {limits.max_depth} levels")
    kind = type(obj)
    if kind is _ArrayBuilder:
        if obj.array is None:
            raise Refused("an array without its data")
        return obj.array
    if isinstance(obj, _LEAVES):
        return obj
    if kind in (dict, _OrderedDict):        # the class's own items(): nothing an instance could have replaced
        if not all(type(k) is str for k in dict.keys(obj)):
            raise Refused("dictionary keys must be strings")
        return {k: _materialise(v, budget, depth + 1) for k, v in dict.items(obj)}
    if kind in (list, tuple):
        items = [_materialise(v, budget, depth + 1) for v in obj]
        return items if kind is list else tuple(items)
    if kind in _LEROBOT_NAMES:
        missing = [f.name for f in fields(obj) if f.name not in obj.__dict__
                   and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise Refused(f"{kind.__name__}: missing fields {missing}")
        return kind(**{k: _materialise(v, budget, depth + 1) for k, v in obj.__dict__.items()})
    raise Refused(f"a {kind.__name__} object is not allowed here")


def decode(data: bytes, expect: type, limits: DecodeLimits = DecodeLimits()):
    """One of LeRobot's messages (`expect`: TimedObservation or RemotePolicyConfig) from its pickle bytes;
    Refused / TooLarge with the reason. Nothing outside the message's allowlist is ever called, and what the
    message builds stays within `limits` (`_Budget`)."""
    what = expect.__name__
    if len(data) > limits.max_bytes:
        raise TooLarge(f"{what}: {len(data)} bytes, over the limit of {limits.max_bytes}")
    budget = _Budget(limits, len(data), what)
    allowed = {(LEROBOT_MODULE, what): expect}
    if expect is TimedObservation:
        allowed.update(_numpy_globals(budget))
        allowed.update(_torch_globals(budget))
    end = scan(data, limits, what)
    if end != len(data):
        raise Refused(f"{what}: {len(data) - end} bytes after the pickle's end")
    try:
        obj = _Unpickler(io.BytesIO(data), allowed, what).load()
    except (Refused, MemoryError, RecursionError):
        raise
    except Exception as e:  # noqa: BLE001 - the unpickler's own complaints: wrong arguments, bad stack...
        raise Refused(clipped(f"{what}: malformed pickle: {type(e).__name__}: {e}")) from None
    if type(obj) is not expect:
        raise Refused(f"expected a {LEROBOT_MODULE}.{what}, got {type(obj).__name__}")
    return _materialise(obj, budget)
