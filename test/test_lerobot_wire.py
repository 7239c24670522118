"""oxygen_ros/serve/lerobot/wire.py's decoder on its own: LeRobot's pickles as its robot_client makes them
decode to the same values, and every class of hostile payload is refused with a reason (Refused: the
server's INVALID_ARGUMENT; TooLarge: RESOURCE_EXHAUSTED) before it can run code or allocate.

"As LeRobot's client makes them": `pickle.dumps(obj)` (the C pickler, the default protocol, and protocol 5)
of dataclasses defined as in LeRobot 0.6.1's lerobot/async_inference/helpers.py, importable under that
module name while the test runs (LeRobot itself is not needed). Allocation is measured with tracemalloc
(Python objects and numpy's buffers): a refusal may use at most ALLOC_BUDGET bytes.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import sys
import tracemalloc
import types
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from oxygen_ros.serve.lerobot import wire
from oxygen_ros.serve.lerobot.wire import (LEROBOT_MODULE, DecodeLimits, Refused, RemotePolicyConfig,
                                           TimedObservation, TooLarge, decode)

ALLOC_BUDGET = 16 << 20          # a refusal allocates no more than this (the payloads are all under 1 MB)


# ---------------------------------------------------------------------------------- LeRobot's own classes
def _lerobot_helpers() -> types.ModuleType:
    """LeRobot 0.6.1's helper classes (same fields, same inheritance) in a module named as LeRobot's."""
    @dataclass
    class TimedData:
        timestamp: float
        timestep: int

    @dataclass
    class TimedAction(TimedData):
        action: torch.Tensor

    @dataclass
    class TimedObservation(TimedData):
        observation: dict
        must_go: bool = False

    @dataclass
    class RemotePolicyConfig:
        policy_type: str
        pretrained_name_or_path: str
        lerobot_features: dict
        actions_per_chunk: int
        device: str = "cpu"
        rename_map: dict = field(default_factory=dict)

    helpers = types.ModuleType(LEROBOT_MODULE)
    for cls in (TimedData, TimedAction, TimedObservation, RemotePolicyConfig):
        cls.__module__, cls.__qualname__ = LEROBOT_MODULE, cls.__name__
        setattr(helpers, cls.__name__, cls)
    return helpers


_HELPERS = _lerobot_helpers()


@pytest.fixture
def lerobot_classes(monkeypatch):
    """LeRobot's classes, importable under LeRobot's module name while the test runs, so that the standard
    pickler writes them exactly as robot_client's `pickle.dumps` does."""
    package, sub = types.ModuleType("lerobot"), types.ModuleType("lerobot.async_inference")
    package.async_inference, sub.helpers = sub, _HELPERS
    for name, module in (("lerobot", package), ("lerobot.async_inference", sub), (LEROBOT_MODULE, _HELPERS)):
        monkeypatch.setitem(sys.modules, name, module)
    return _HELPERS


def so101_raw(rng) -> dict:
    """What an SO-101 robot's get_observation() returns (floats per motor, HWC uint8 cameras), plus the task."""
    raw = {f"{m}.pos": float(rng.uniform(-90, 90)) for m in
           ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper")}
    raw["front"] = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    raw["wrist"] = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
    raw["task"] = "pick up the cube"
    return raw


def assert_same(got, want):
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
        assert got.flags.writeable and got.flags.f_contiguous == want.flags.f_contiguous
        np.testing.assert_array_equal(got, want)
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want):
            assert_same(a, b)
    else:
        assert type(got) is type(want) and got == want


# ---------------------------------------------------------------------------------- legit pickles
@pytest.mark.parametrize("protocol", [pickle.DEFAULT_PROTOCOL, 5])
def test_an_observation_pickled_by_lerobots_client_decodes(lerobot_classes, protocol):
    rng = np.random.default_rng(0)
    raw = so101_raw(rng)
    raw |= {"depth": rng.uniform(0, 2, (6, 5)).astype(np.float32), "fortran": np.asfortranarray(rng.uniform(
            size=(4, 3))), "big_endian": np.arange(5, dtype=">i4"), "mask": np.array([True, False]),
            "empty": np.zeros((0, 3), np.float32), "scalar": np.float64(0.25), "np_int": np.int64(-7),
            "tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3), "bools": [True, False], "none": None}
    sent = lerobot_classes.TimedObservation(timestamp=1712.5, timestep=41, observation=raw, must_go=True)
    got = decode(pickle.dumps(sent, protocol=protocol), TimedObservation)
    assert isinstance(got, TimedObservation)
    assert (got.timestamp, got.timestep, got.must_go) == (1712.5, 41, True)
    assert_same(got.observation, raw)


def test_must_go_defaults_as_in_lerobot(lerobot_classes):
    sent = lerobot_classes.TimedObservation(timestamp=1.0, timestep=0, observation={"task": ""})
    assert decode(pickle.dumps(sent), TimedObservation).must_go is False


def test_policy_instructions_pickled_by_lerobots_client_decode(lerobot_classes):
    features = {"observation.state": {"dtype": "float32", "shape": (6,), "names": ["a.pos"] * 6},
                "observation.images.front": {"dtype": "image", "shape": (480, 640, 3),
                                             "names": ["height", "width", "channels"], "info": {"is_depth_map": False}}}
    sent = lerobot_classes.RemotePolicyConfig("pi05", "user/pi05_so101", features, 10, "cuda",
                                              {"observation.images.top": "observation.images.front"})
    got = decode(pickle.dumps(sent), RemotePolicyConfig)
    assert isinstance(got, RemotePolicyConfig)
    assert (got.policy_type, got.pretrained_name_or_path, got.actions_per_chunk, got.device) == \
        ("pi05", "user/pi05_so101", 10, "cuda")
    assert_same(got.lerobot_features, features)
    assert got.rename_map == sent.rename_map


# ---------------------------------------------------------------------------------- hostile payloads
def refusal(data: bytes, expect=TimedObservation, limits: DecodeLimits = DecodeLimits()) -> Refused:
    """The decoder's refusal of `data`, which must allocate at most ALLOC_BUDGET on the way."""
    tracemalloc.start()
    try:
        with pytest.raises(Refused) as e:
            decode(data, expect, limits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= ALLOC_BUDGET, f"refusing it allocated {peak} bytes"
    return e.value


class _Reduce:
    """Pickles as `fn(*args)` (and BUILD with `state`): whatever globals the attacker names."""

    def __init__(self, fn, args, state=None):
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def inside(lerobot_classes, value) -> bytes:
    """`value` hidden in an otherwise real observation."""
    raw = so101_raw(np.random.default_rng(1)) | {"extra": value}
    return pickle.dumps(lerobot_classes.TimedObservation(timestamp=0.0, timestep=0, observation=raw))


def test_reduce_to_os_system_is_refused_and_never_runs(lerobot_classes, tmp_path):
    marker = tmp_path / "ran"
    for data in (pickle.dumps(_Reduce(os.system, (f"touch {marker}",))),
                 inside(lerobot_classes, _Reduce(os.system, (f"touch {marker}",)))):
        e = refusal(data)
        assert type(e) is Refused and f"refused global {os.system.__module__}.system" in str(e)
    assert not marker.exists()


@pytest.mark.parametrize("name, obj, expect", [
    ("builtins.eval", _Reduce(eval, ("1 + 1",)), TimedObservation),
    ("builtins.getattr", _Reduce(getattr, ("text", "upper")), TimedObservation),
    ("numpy.load", _Reduce(np.load, ("x.npy",)), TimedObservation),
    ("torch.serialization.load", _Reduce(torch.load, ("x.pt",)), TimedObservation),
    # Allowed in an observation, not in policy instructions (each message has its own allowlist).
    ("numpy._core.multiarray._reconstruct", np.zeros(2), RemotePolicyConfig),
    ("collections.OrderedDict", collections.OrderedDict(a=1), RemotePolicyConfig),
])
def test_unknown_globals_are_refused(lerobot_classes, name, obj, expect):
    cls = lerobot_classes.TimedObservation if expect is TimedObservation else lerobot_classes.RemotePolicyConfig
    msg = cls(0.0, 0, {"x": obj}) if expect is TimedObservation else cls("pi05", "p", {"x": obj}, 1)
    e = refusal(pickle.dumps(msg), expect)
    assert type(e) is Refused and f"refused global {name}" in str(e), str(e)


def test_another_message_class_is_refused(lerobot_classes):
    e = refusal(pickle.dumps(lerobot_classes.RemotePolicyConfig("pi05", "p", {}, 1)), TimedObservation)
    assert f"refused global {LEROBOT_MODULE}.RemotePolicyConfig" in str(e)


def test_numpy_shape_bomb_allocates_nothing(lerobot_classes):
    """numpy's own `_reconstruct(ndarray, shape, ...)` allocates the shape it is given: 1 TB from ~100 bytes."""
    bomb = _Reduce(np._core.multiarray._reconstruct, (np.ndarray, (1 << 40,), b"b"))
    e = refusal(inside(lerobot_classes, bomb))
    assert type(e) is Refused and "only plain arrays as numpy pickles them" in str(e)


def test_numpy_state_bomb_allocates_nothing(lerobot_classes):
    """An array state declaring 1 GB and carrying none: refused before anything of that size exists."""
    bomb = _Reduce(np._core.multiarray._reconstruct, (np.ndarray, (0,), b"b"),
                   (1, (1 << 30,), np.dtype("u1"), False, b""))
    e = refusal(inside(lerobot_classes, bomb))
    assert type(e) is Refused and f"needs {1 << 30} bytes, carries 0" in str(e)


def test_tensor_view_bomb_allocates_nothing(lerobot_classes):
    """A 1-element storage viewed as 10^10 elements (stride 0): cloning it would allocate 40 GB."""
    with warnings.catch_warnings():      # TypedStorage's deprecation warning: torch warns once per process
        warnings.simplefilter("ignore", UserWarning)
        one = torch.ones(1).storage()
    bomb = _Reduce(torch._utils._rebuild_tensor_v2, (one, 0, (10**10,), (0,), False, collections.OrderedDict()))
    e = refusal(inside(lerobot_classes, bomb))
    assert type(e) is Refused and "does not lie inside its storage" in str(e)


def _legacy_storage_bytes(numel: int, header: int, payload: bytes) -> bytes:
    """torch.save's legacy stream for one float storage (what `torch.storage._load_from_bytes` reads): magic,
    protocol, system info, the storage record (a persistent id), its keys, an 8-byte size, the raw bytes."""
    class Record:
        pass

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", numel) if isinstance(obj, Record) else None

    out = io.BytesIO()
    for obj in (wire._TORCH_MAGIC, wire._TORCH_PROTOCOL, {"protocol_version": 1001, "little_endian": True,
                                                          "type_sizes": {"short": 2, "int": 4, "long": 4}}):
        pickle.dump(obj, out, protocol=2)
    _Pickler(out, protocol=2).dump(Record())
    pickle.dump(["0"], out, protocol=2)
    return out.getvalue() + header.to_bytes(8, "little") + payload


def test_tensor_storage_bomb_allocates_nothing(lerobot_classes):
    """A storage record declaring 2^40 floats with 4 bytes behind it."""
    ok = _legacy_storage_bytes(1, 1, np.float32(2.5).tobytes())
    assert torch.equal(wire._storage_from_bytes(ok, wire._Budget(DecodeLimits(), len(ok), "test")).data,
                       torch.tensor([2.5]))
    bomb = _Reduce(torch.storage._load_from_bytes, (_legacy_storage_bytes(1 << 40, 1 << 40, b"\0" * 4),))
    e = refusal(inside(lerobot_classes, bomb))
    assert type(e) is Refused and f"{1 << 40} elements need {4 << 40} bytes, carries 4" in str(e)


@pytest.mark.parametrize("array", [np.array([1, "a"], dtype=object), np.array([(1, 2.0)], dtype="i4,f8"),
                                   np.array([b"ab"], dtype="V2")])
def test_object_structured_and_void_arrays_are_refused(lerobot_classes, array):
    e = refusal(inside(lerobot_classes, array))
    assert type(e) is Refused and "only numeric arrays" in str(e), str(e)


def _nested(lerobot_classes, opener: bytes, depth: int) -> bytes:
    """An observation holding `depth` containers one inside the other, written opcode by opcode (the C
    pickler recurses, and overflows the C stack, long before the unpickler would): each `opener` starts a
    container, the innermost holds None, and each closing opcode puts one inside the one before."""
    closer = {b"]": b"a", b"(": b"t"}[opener]          # lists: EMPTY_LIST ... APPEND; tuples: MARK ... TUPLE
    nested = opener * depth + b"N" + closer * depth
    marker = "NESTED_HERE"
    data = pickle.dumps(lerobot_classes.TimedObservation(0.0, 0, {"extra": marker, "task": ""}), protocol=2)
    unicode = b"X" + len(marker).to_bytes(4, "little") + marker.encode()
    assert data.count(unicode) == 1
    return data.replace(unicode, nested)


@pytest.mark.parametrize("opener", [b"]", b"("])
@pytest.mark.parametrize("depth", [13, 4000])           # 4000: within the opcode limit, past the recursion limit
def test_deep_nesting_is_too_large_not_a_crash(lerobot_classes, opener, depth):
    e = refusal(_nested(lerobot_classes, opener, depth))
    assert type(e) is TooLarge and "nested deeper than 12 levels" in str(e)


def test_nesting_within_the_limit_decodes(lerobot_classes):
    got = decode(_nested(lerobot_classes, b"]", 10), TimedObservation).observation["extra"]
    for _ in range(10):
        (got,) = got
    assert got is None


def test_a_4gb_declared_length_is_refused_before_reading(lerobot_classes):
    """BINBYTES8 declaring 4 GB with 3 bytes behind it: the C unpickler allocates the declared size first."""
    e = refusal(b"\x80\x04\x8e" + (4 << 30).to_bytes(8, "little") + b"abc.")
    assert type(e) is Refused and "4294967296" in str(e)


def test_a_memo_index_bomb_is_refused(lerobot_classes):
    """LONG_BINPUT 2^31: the C unpickler would size its memo to hold that index (16 GB)."""
    e = refusal(b"\x80\x04N" + b"r" + (1 << 31).to_bytes(4, "little") + b".")
    assert type(e) is Refused and "memo index 2147483648" in str(e)


@pytest.mark.parametrize("data, opcode", [(b"\x80\x04\x8c\x01xQ.", "BINPERSID"), (b"Pxx\n.", "PERSID")])
def test_persistent_ids_are_refused(data, opcode):
    e = refusal(data)
    assert type(e) is Refused and f"persistent ids are refused (opcode {opcode}" in str(e)


def test_persistent_ids_are_refused_by_the_unpickler_too():
    """The second line of defence: the unpickler itself, were a persistent id to get past the scan."""
    with pytest.raises(Refused, match="persistent ids are refused"):
        wire._Unpickler(io.BytesIO(b"\x80\x04\x8c\x01xQ."), {}, "test").load()


def test_the_byte_cap_comes_before_anything_is_read(lerobot_classes):
    limits = DecodeLimits(max_bytes=4096)
    e = refusal(b"\xff" * 4097, limits=limits)              # garbage: over the cap is said, not "malformed"
    assert type(e) is TooLarge and "4097 bytes, over the limit of 4096" in str(e)
    sent = lerobot_classes.TimedObservation(0.0, 0, {"img": np.zeros(8192, np.uint8), "task": ""})
    e = refusal(pickle.dumps(sent), limits=limits)
    assert type(e) is TooLarge and "over the limit of 4096" in str(e)
    small = lerobot_classes.TimedObservation(0.0, 0, {"img": np.zeros(64, np.uint8), "task": ""})
    assert decode(pickle.dumps(small), TimedObservation, limits).observation["img"].shape == (64,)


def test_bytes_after_the_pickle_are_refused(lerobot_classes):
    data = pickle.dumps(lerobot_classes.TimedObservation(0.0, 0, {"task": ""}))
    e = refusal(data + b"\x80\x04N.")
    assert type(e) is Refused and "4 bytes after the pickle's end" in str(e)


@pytest.mark.parametrize("data, index", [(b"Np2147483648\n.", 2147483648), (b"Ng2147483648\n.", 2147483648),
                                         (b"N\x94h\xff.", 255), (b"Nj\x00\x00\x00\x80.", 1 << 31)])
def test_memo_indices_of_every_protocol_are_checked(data, index):
    """PUT/GET (protocol 0, decimal text), BINGET and LONG_BINGET: an index beyond the opcodes seen is refused
    by the scan, whichever protocol's opcode carries it."""
    e = refusal(data)
    assert type(e) is Refused and f"memo index {index}" in str(e), str(e)


# ---------------------------------------------------------------------------------- what a message builds
def _repeated_calls(lerobot_classes, fn, args, times: int) -> bytes:
    """An observation whose `extra` is `times` calls of `fn` on ONE memoised argument tuple: the pickle holds
    the arguments once, each call builds their whole size again."""
    return inside(lerobot_classes, [_Reduce(fn, args) for _ in range(times)])


def test_memo_reuse_of_one_buffer_cannot_build_more_than_the_message(lerobot_classes):
    """Issue 40 item 1: numpy's `_frombuffer` 2,000 times on one memoised 1 MiB buffer (a 1 MiB message that
    grew the server by 1.5 GB). The budget is the message's own length: the second copy is refused."""
    buf = bytes(1 << 20)
    data = _repeated_calls(lerobot_classes, np._core.numeric._frombuffer, (buf, np.dtype("u1"), (1 << 20,), "C"), 2000)
    assert len(data) < (1 << 20) + (64 << 10)
    e = refusal(data)
    assert type(e) is TooLarge and f"would build more than {len(data)} bytes" in str(e), str(e)


def test_memo_reuse_of_one_tensor_storage_cannot_build_more_than_the_message(lerobot_classes):
    """The same with torch's `_rebuild_tensor_v2` on one memoised (storage, offset, size, stride) tuple."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        storage = torch.zeros(1 << 18).storage()                    # 1 MiB of float32
    args = (storage, 0, (1 << 18,), (1,), False, collections.OrderedDict())
    data = _repeated_calls(lerobot_classes, torch._utils._rebuild_tensor_v2, args, 500)
    e = refusal(data)
    assert type(e) is TooLarge and "would build more than" in str(e) and "a tensor of 1048576 bytes" in str(e), str(e)


def test_shared_references_are_counted_as_the_copies_they_become(lerobot_classes):
    """Issue 40 item 2: feature lists referencing each other through the memo: 10 lists of 10 lists ... 8 deep,
    10^8 references in under 1 kB. Each reference would be walked and copied: refused at `max_opcodes` visits."""
    names = ["shoulder_pan.pos"]
    for _ in range(8):
        names = [names] * 10
    features = {"observation.state": {"dtype": "float32", "shape": (6,), "names": names}}
    data = pickle.dumps(lerobot_classes.RemotePolicyConfig("pi05", "p", features, 10))
    assert len(data) < 1024
    e = refusal(data, RemotePolicyConfig)
    assert type(e) is TooLarge and "more than 10000 objects to build (shared references" in str(e), str(e)
    # An honest config of the same kind decodes (the budget counts objects, not the nesting).
    names = [["shoulder_pan.pos"] * 10 for _ in range(10)]
    features["observation.state"]["names"] = names
    got = decode(pickle.dumps(lerobot_classes.RemotePolicyConfig("pi05", "p", features, 10)), RemotePolicyConfig)
    assert got.lerobot_features["observation.state"]["names"] == names


def test_the_built_bytes_and_array_count_budgets(lerobot_classes):
    """`max_built_bytes` and `max_arrays` (the server sets them from the client's declared cameras and joints)."""
    sent = lerobot_classes.TimedObservation(0.0, 0, {"img": np.zeros(2000, np.uint8), "task": ""})
    e = refusal(pickle.dumps(sent), limits=DecodeLimits(max_built_bytes=1999))
    assert type(e) is TooLarge and "would build more than 1999 bytes" in str(e)
    got = decode(pickle.dumps(sent), TimedObservation, DecodeLimits(max_built_bytes=2000))
    assert got.observation["img"].size == 2000
    many = lerobot_classes.TimedObservation(0.0, 0, {f"a{i}": np.zeros(1, np.uint8) for i in range(9)} | {"task": ""})
    e = refusal(pickle.dumps(many), limits=DecodeLimits(max_arrays=8))
    assert type(e) is TooLarge and "more than 8 arrays and tensors" in str(e)


def test_an_ordered_dict_with_a_state_is_refused(lerobot_classes):
    """Issue 40 item 4: an OrderedDict whose BUILD replaces `items` (an instance attribute over the method):
    the walk called it and the server answered INTERNAL. Refused when BUILD comes."""
    e = refusal(inside(lerobot_classes, _Reduce(collections.OrderedDict, (), {"items": 1})))
    assert type(e) is Refused and "OrderedDict with a state (dict) is refused" in str(e), str(e)


def test_one_message_has_a_time_budget(lerobot_classes, monkeypatch):
    """`max_seconds` of the decoding thread's CPU time, on a simulated clock that advances 0.2 s at each
    reading: refused once it is spent."""
    clock = iter(np.arange(0.0, 1e6, 0.2))
    monkeypatch.setattr(wire.time, "thread_time", lambda: float(next(clock)))
    data = inside(lerobot_classes, [np.zeros(4, np.uint8) for _ in range(4)])
    e = refusal(data, limits=DecodeLimits(max_seconds=0.5))
    assert type(e) is TooLarge and "decoding took more than 0.5 s of CPU time" in str(e), str(e)


def test_a_tensor_camera_fits_the_budget_of_its_own_bytes(lerobot_classes):
    """A plugin robot's camera as a torch tensor: its storage and the tensor made of it are one image's bytes
    (the rebuild of a storage's first tensor is not a second charge), so it decodes within a budget of its
    bytes; two such cameras do not."""
    image = torch.randint(0, 256, (96, 128, 3), dtype=torch.uint8)
    sent = lerobot_classes.TimedObservation(0.0, 0, {"front": image, "task": ""})
    data = pickle.dumps(sent)
    assert len(data) < 2 * image.numel()
    got = decode(data, TimedObservation, DecodeLimits(max_built_bytes=image.numel()))
    assert torch.equal(got.observation["front"], image)
    twice = lerobot_classes.TimedObservation(0.0, 0, {"a": image, "b": image[1:], "task": ""})
    e = refusal(pickle.dumps(twice), limits=DecodeLimits(max_built_bytes=image.numel()))
    assert type(e) is TooLarge and f"would build more than {image.numel()} bytes" in str(e)
