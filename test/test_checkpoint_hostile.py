"""Hostile checkpoint files: every case is refused with the package's own error (CheckpointError), on one
line, naming the file at fault (and the key when a value is wrong), and nothing hangs: a FIFO opened for
reading blocks until a writer comes, so each case runs under an alarm. The same files reach the engine
node's configure, where they are listed with the other parameter problems before anything loads."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy, save_file as save_numpy
from safetensors.torch import load_file, save_file

from oxygen_ros.engine.factory import file_problems
from oxygen_ros.model.checkpoint import (checkpoint_settings, check_weights, init_random_weights, lerobot_policy,
                                         load_pi05, save_checkpoint)
from oxygen_ros.model.files import MAX_JSON_BYTES, MAX_TOKENIZER_BYTES, CheckpointError
from oxygen_ros.model.normalize import LeRobotNormalizer, Normalizer
from oxygen_ros.model.pi05 import Pi05
from oxygen_ros.model.tokenizer import Tokenizer
from test_checkpoint import CFG

DATA = Path(__file__).parent / "data"
LEROBOT_CASE = DATA / "lerobot_ref" / "mixed_relative"      # config.json, both processors and their stats
Q0 = "paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.q_proj.weight"
STATS = {"mean": [0.0, 1.0], "std": [1.0, 2.0], "q01": [-1.0, -2.0], "q99": [1.0, 3.0]}
PRE = "policy_preprocessor.json"
PRE_STATS = "policy_preprocessor_step_3_normalizer_processor.safetensors"


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A valid openpi model.safetensors of CFG (written once, copied into each case)."""
    folder = tmp_path_factory.mktemp("weights")
    return save_checkpoint(init_random_weights(Pi05(CFG), 0), folder)


@pytest.fixture
def root(tmp_path, weights) -> Path:
    """A valid openpi checkpoint (ckpt/: weights, config.json, assets/robot/norm_stats.json), a valid LeRobot
    policy folder (lerobot/) and a tokenizer, which each case then spoils in one way."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "assets" / "robot").mkdir(parents=True)
    shutil.copy(weights, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps({"action_horizon": CFG.action_horizon, "action_dim": CFG.action_dim}))
    (ckpt / "assets" / "robot" / "norm_stats.json").write_text(json.dumps({"norm_stats": {"state": STATS,
                                                                                         "actions": STATS}}))
    shutil.copytree(LEROBOT_CASE, tmp_path / "lerobot")
    shutil.copy(Path(__file__).parents[1] / "oxygen_ros" / "model" / "assets" / "tiny_tokenizer.model",
                tmp_path / "tokenizer.model")
    return tmp_path


# Run as a separate process: a loader blocked opening a FIFO may hold the interpreter lock (safetensors).
# Opening a FIFO for writing without blocking succeeds only while a reader has it open (ENXIO otherwise): so
# the watchdog fires exactly when something opened a FIFO for reading, however long a slow first load takes.
WATCHDOG = """
import os, pathlib, stat, sys, time
root = pathlib.Path(sys.argv[1])
while True:                        # until the fixture kills it; the test makes its FIFOs after the start
    for path in root.rglob("*"):
        try:
            if not stat.S_ISFIFO(path.lstat().st_mode):
                continue
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        (root / "watchdog_fired").touch()
        os.close(fd)
    time.sleep(0.05)
"""


@pytest.fixture
def within_seconds(root):
    """Fail a case that opens a FIFO for reading instead of hanging the suite. Such a loader blocks in the
    open call, inside native code that retries it after a signal (safetensors, sentencepiece), so no alarm
    can interrupt it: a watchdog process sees the reader (a non-blocking open for writing succeeds only
    then), marks the case failed, and closes its end, which lets the open return (the read sees the end of
    the file). No wall-clock bound: a slow first load on a loaded machine is not a hang."""
    watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(root)])
    yield
    watchdog.kill()
    watchdog.wait()
    assert not (root / "watchdog_fired").exists(), "a file was opened that blocked: a FIFO read"


# ------------------------------------------------------------------------------------------ the spoilers
def edit_json(file: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    def spoil(root: Path):
        data = json.loads((root / file).read_text())
        change(data)
        (root / file).write_text(json.dumps(data))
    return spoil


def write_text(file: str, text: str) -> Callable[[Path], None]:
    return lambda root: (root / file).write_text(text)


def write_bytes(file: str, data: bytes) -> Callable[[Path], None]:
    return lambda root: (root / file).write_bytes(data)


def fifo(file: str) -> Callable[[Path], None]:
    def spoil(root: Path):
        (root / file).unlink()
        os.mkfifo(root / file)
    return spoil


def directory(file: str) -> Callable[[Path], None]:
    def spoil(root: Path):
        (root / file).unlink()
        (root / file).mkdir()
    return spoil


def remove(file: str) -> Callable[[Path], None]:
    return lambda root: (root / file).unlink()


def sparse(file: str, size: int) -> Callable[[Path], None]:
    def spoil(root: Path):
        with open(root / file, "wb") as f:
            f.truncate(size)
    return spoil


def tensors(change: Callable[[dict], object], file: str = "ckpt/model.safetensors") -> Callable[[Path], None]:
    def spoil(root: Path):
        loaded = load_file(str(root / file))
        change(loaded)
        save_file(loaded, str(root / file))
    return spoil


def statistics(change: Callable[[dict], object], file: str = f"lerobot/{PRE_STATS}") -> Callable[[Path], None]:
    def spoil(root: Path):
        loaded = load_numpy(str(root / file))
        change(loaded)
        save_numpy(loaded, str(root / file))
    return spoil


def header(length: int, body: bytes) -> bytes:
    """A safetensors file: its header's declared length (little-endian u64), then what follows."""
    return struct.pack("<Q", length) + body


def sharded(index: dict | str) -> Callable[[Path], None]:
    def spoil(root: Path):
        (root / "ckpt" / "model.safetensors").rename(root / "ckpt" / "shard-1.safetensors")
        text = index if isinstance(index, str) else json.dumps(index)
        (root / "ckpt" / "model.safetensors.index.json").write_text(text)
    return spoil


def fifo_shard(root: Path):
    sharded({"weight_map": {Q0: "shard-1.safetensors", "x": "shard-2.safetensors"}})(root)
    os.mkfifo(root / "ckpt" / "shard-2.safetensors")


def nested(depth: int) -> str:
    return '{"a": ' + "[" * depth + "]" * depth + "}"


def set_step(key: str, value) -> Callable[[dict], None]:
    """Set `key` of the pre-processor's normaliser step (steps[3])."""
    return lambda d: d["steps"][3].__setitem__(key, value)


def set_step_config(index: int, key: str, value) -> Callable[[dict], None]:
    return lambda d: d["steps"][index]["config"].__setitem__(key, value)


# --------------------------------------------------------------------------------------------- loaders
LOADERS: dict[str, Callable[[Path], object]] = {
    "weights": lambda root: check_weights(root / "ckpt", CFG),
    "load": lambda root: load_pi05(root / "ckpt", CFG),
    "settings": lambda root: checkpoint_settings(root / "ckpt"),
    "norm_stats": lambda root: Normalizer.load(root / "ckpt"),
    "norm_file": lambda root: Normalizer.load(root / "ckpt" / "assets" / "robot" / "norm_stats.json"),
    "lerobot_stats": lambda root: LeRobotNormalizer.load(root / "lerobot"),
    "lerobot_policy": lambda root: lerobot_policy(root / "lerobot"),
    "tokenizer": lambda root: Tokenizer(root / "tokenizer.model"),
}

NORM = "ckpt/assets/robot/norm_stats.json"
CASES = [
    # (id, spoil, loader, file at fault, what the message says)
    # -- weights
    ("no weights", remove("ckpt/model.safetensors"), "weights", "ckpt", "no model.safetensors"),
    ("weights a directory", directory("ckpt/model.safetensors"), "weights", "ckpt/model.safetensors",
     "is a directory, not a regular file"),
    ("weights a FIFO", fifo("ckpt/model.safetensors"), "load", "ckpt/model.safetensors", "is a FIFO"),
    ("weights empty", write_bytes("ckpt/model.safetensors", b""), "weights", "ckpt/model.safetensors",
     "not a readable safetensors file"),
    ("header truncated", write_bytes("ckpt/model.safetensors", header(200, b'{"a": {"dtype": "F32"')),
     "weights", "ckpt/model.safetensors", "not a readable safetensors file"),
    ("header length huge", write_bytes("ckpt/model.safetensors", header(1 << 62, b"{}")), "weights",
     "ckpt/model.safetensors", "not a readable safetensors file"),
    ("header not JSON", write_bytes("ckpt/model.safetensors", header(8, b"not json")), "weights",
     "ckpt/model.safetensors", "not a readable safetensors file"),
    ("integer weights", tensors(lambda t: t.__setitem__(Q0, t[Q0].to(torch.int64))), "load",
     "ckpt/model.safetensors", f"1 tensor(s) are not floating-point weights (F16, BF16, F32, F64): {Q0} is I64"),
    ("8-bit float weights", tensors(lambda t: t.__setitem__(Q0, t[Q0].to(torch.float8_e4m3fn))), "weights",
     "ckpt/model.safetensors", f"{Q0} is F8_E4M3"),
    ("missing tensor", tensors(lambda t: t.pop(Q0)), "weights", "ckpt/model.safetensors", "1 missing key(s)"),
    ("wrong shape", tensors(lambda t: t.__setitem__(Q0, t[Q0][:-1])), "weights", "ckpt/model.safetensors",
     "do not match the model config"),
    ("index not JSON", sharded("{not json"), "weights", "ckpt/model.safetensors.index.json", "not valid JSON"),
    ("index a list", sharded("[1, 2]"), "weights", "ckpt/model.safetensors.index.json",
     "must hold a JSON object, got a list"),
    ("index shard a list", sharded({"weight_map": {Q0: [1]}}), "weights", "ckpt/model.safetensors.index.json",
     "shard name [1] is not a file name"),
    ("index shard outside", sharded({"weight_map": {Q0: "../model.safetensors"}}), "weights",
     "ckpt/model.safetensors.index.json", "shard name '../model.safetensors' is not a file name"),
    ("index shard a FIFO", fifo_shard, "weights", "ckpt/shard-2.safetensors", "is a FIFO"),
    # -- config.json: every value bounded as the model config bounds it
    ("config a FIFO", fifo("ckpt/config.json"), "settings", "ckpt/config.json", "is a FIFO"),
    ("config a directory", directory("ckpt/config.json"), "settings", "ckpt/config.json", "is a directory"),
    ("config empty", write_text("ckpt/config.json", ""), "settings", "ckpt/config.json", "not valid JSON"),
    ("config a list", write_text("ckpt/config.json", "[]"), "settings", "ckpt/config.json",
     "must hold a JSON object, got a list"),
    ("config nested too deep", write_text("ckpt/config.json", nested(100_000)), "settings", "ckpt/config.json",
     "not valid JSON"),
    ("config too large", sparse("ckpt/config.json", MAX_JSON_BYTES + 1), "settings", "ckpt/config.json",
     f"more than the {MAX_JSON_BYTES} such a file may have"),
    ("config not UTF-8", write_bytes("ckpt/config.json", b'{"a": "\xff"}'), "settings", "ckpt/config.json",
     "not valid JSON"),
    ("denoise steps 1e8", write_text("ckpt/config.json", '{"num_inference_steps": 1e8}'), "settings",
     "ckpt/config.json", "num_inference_steps must be an integer in [1, 1000], got 100000000.0"),
    ("chunk size 3000", write_text("ckpt/config.json", '{"chunk_size": 3000}'), "settings", "ckpt/config.json",
     "chunk_size must be an integer in [1, 1000], got 3000"),
    ("horizon a string", write_text("ckpt/config.json", '{"action_horizon": "10"}'), "settings",
     "ckpt/config.json", "action_horizon must be an integer in [1, 1000], got '10'"),
    ("action dim negative", write_text("ckpt/config.json", '{"action_dim": -3}'), "settings", "ckpt/config.json",
     "action_dim must be an integer in [1, 1024], got -3"),
    ("chunk size a boolean", write_text("ckpt/config.json", '{"chunk_size": true}'), "settings",
     "ckpt/config.json", "chunk_size must be an integer in [1, 1000], got True"),
    ("token length NaN", write_text("ckpt/config.json", '{"tokenizer_max_length": NaN}'), "settings",
     "ckpt/config.json", "tokenizer_max_length must be an integer in [1, 8192], got nan"),
    ("prefix conditioning a string", write_text("ckpt/config.json", '{"prefix_conditioning": "yes"}'), "settings",
     "ckpt/config.json", "prefix_conditioning must be true or false, got 'yes'"),
    ("two horizons", write_text("ckpt/config.json", '{"action_horizon": 10, "chunk_size": 20}'), "settings",
     "ckpt/config.json", "chunk_size 20 contradicts action_horizon 10"),
    # -- openpi norm_stats.json
    ("norm stats a FIFO", fifo(NORM), "norm_stats", NORM, "is a FIFO"),
    ("norm stats a FIFO given", fifo(NORM), "norm_file", NORM, "is a FIFO"),
    ("norm stats empty", write_text(NORM, ""), "norm_stats", NORM, "not valid JSON"),
    ("norm stats a list", write_text(NORM, "[]"), "norm_stats", NORM, "must hold a JSON object, got a list"),
    ("norm stats null", write_text(NORM, '{"norm_stats": null}'), "norm_stats", NORM, "norm_stats is null"),
    ("state a list", edit_json(NORM, lambda d: d["norm_stats"].__setitem__("state", [1.0])), "norm_stats", NORM,
     "norm_stats.state must be an object, got a list"),
    ("mean a string", edit_json(NORM, lambda d: d["norm_stats"]["state"].__setitem__("mean", ["a", 1.0])),
     "norm_stats", NORM, "norm_stats.state.mean must be a non-empty list of finite numbers"),
    ("mean an object", edit_json(NORM, lambda d: d["norm_stats"]["actions"].__setitem__("mean", {"a": 1})),
     "norm_stats", NORM, "norm_stats.actions.mean must be a non-empty list of finite numbers"),
    ("q01 infinite", write_text(NORM, json.dumps({"state": dict(STATS, q01=[-1.0, float("-inf")])})),
     "norm_stats", NORM, "state.q01 must be a non-empty list of finite numbers"),
    ("std negative", edit_json(NORM, lambda d: d["norm_stats"]["actions"].__setitem__("std", [1.0, -2.0])),
     "norm_stats", NORM, "norm_stats.actions.std has negative values"),
    ("q99 below q01", edit_json(NORM, lambda d: d["norm_stats"]["state"].__setitem__("q99", [-5.0, 3.0])),
     "norm_stats", NORM, "norm_stats.state.q99 is below q01"),
    # -- LeRobot processors and their statistics
    ("processor a FIFO", fifo(f"lerobot/{PRE}"), "lerobot_stats", f"lerobot/{PRE}", "is a FIFO"),
    ("processor steps an object", edit_json(f"lerobot/{PRE}", lambda d: d.__setitem__("steps", {})),
     "lerobot_stats", f"lerobot/{PRE}", "steps must be a list of objects"),
    ("processor eps a string", edit_json(f"lerobot/{PRE}", set_step_config(3, "eps", "small")), "lerobot_stats",
     f"lerobot/{PRE}", "steps[3].config.eps must be a number in [0, 1], got 'small'"),
    ("processor eps NaN", write_text(f"lerobot/{PRE}", (LEROBOT_CASE / PRE).read_text().replace("1e-08", "NaN")),
     "lerobot_stats", f"lerobot/{PRE}", "steps[3].config.eps must be a number in [0, 1], got nan"),
    ("processor norm map a list", edit_json(f"lerobot/{PRE}", set_step_config(3, "norm_map", ["MEAN_STD"])),
     "lerobot_stats", f"lerobot/{PRE}", "steps[3].config.norm_map must be an object, got a list"),
    ("processor state file outside", edit_json(f"lerobot/{PRE}", set_step("state_file", "../weights.safetensors")),
     "lerobot_stats", f"lerobot/{PRE}", "steps[3].state_file must be a file name"),
    ("processor state file missing", remove(f"lerobot/{PRE_STATS}"), "lerobot_stats", f"lerobot/{PRE_STATS}",
     "not found"),
    ("processor stats truncated", lambda root: (root / "lerobot" / PRE_STATS).write_bytes(
        (LEROBOT_CASE / PRE_STATS).read_bytes()[:-16]), "lerobot_stats", f"lerobot/{PRE_STATS}",
     "not a readable safetensors file"),
    ("processor stats NaN", statistics(lambda s: s["observation.state.min"].__setitem__(0, np.nan)),
     "lerobot_stats", f"lerobot/{PRE_STATS}", "must be finite vectors of one length"),
    ("processor stats max below min", statistics(lambda s: s.__setitem__(
        "observation.state.max", s["observation.state.min"] - 1)), "lerobot_stats", f"lerobot/{PRE_STATS}",
     "feature 'observation.state' max is below min"),
    ("processor stats std negative", statistics(lambda s: s.__setitem__(
        "observation.images.base.std", -np.abs(s["observation.images.base.std"]) - 1)), "lerobot_stats",
     f"lerobot/{PRE_STATS}", "feature 'observation.images.base' std has negative values"),
    ("processor action names a number", edit_json(f"lerobot/{PRE}", set_step_config(2, "action_names", 5)),
     "lerobot_policy", f"lerobot/{PRE}", "steps[2].config.action_names must be a list of strings, got 5"),
    ("lerobot features a list", edit_json("lerobot/config.json", lambda d: d.__setitem__("input_features", [])),
     "lerobot_policy", "lerobot/config.json", "input_features must be an object, got a list"),
    ("lerobot action shape a string", edit_json("lerobot/config.json", lambda d: d["output_features"]["action"]
                                                .__setitem__("shape", ["7"])), "lerobot_policy", "lerobot/config.json",
     "output_features.action.shape must be a list of 1 integer(s) in [1, 1024], got ['7']"),
    ("lerobot image resolution huge", edit_json("lerobot/config.json", lambda d: d.__setitem__(
        "image_resolution", [100_000, 64])), "lerobot_policy", "lerobot/config.json",
     "image_resolution must be a list of 2 integer(s) in [1, 4096], got [100000, 64]"),
    ("lerobot mapping a list", edit_json("lerobot/config.json", lambda d: d.__setitem__(
        "normalization_mapping", ["QUANTILES"])), "lerobot_stats", "lerobot/config.json",
     "normalization_mapping must be an object, got a list"),
    # -- tokenizer
    ("tokenizer a FIFO", fifo("tokenizer.model"), "tokenizer", "tokenizer.model", "is a FIFO"),
    ("tokenizer a directory", directory("tokenizer.model"), "tokenizer", "tokenizer.model", "is a directory"),
    ("tokenizer missing", remove("tokenizer.model"), "tokenizer", "tokenizer.model", "not found"),
    ("tokenizer garbage", write_bytes("tokenizer.model", b"garbage" * 10), "tokenizer", "tokenizer.model",
     "not a SentencePiece model"),
    ("tokenizer too large", sparse("tokenizer.model", MAX_TOKENIZER_BYTES + 1), "tokenizer", "tokenizer.model",
     f"{MAX_TOKENIZER_BYTES + 1} bytes, more than the {MAX_TOKENIZER_BYTES} such a file may have"),
]


TOKENIZER_PROBE = """
import sys
from pathlib import Path
from oxygen_ros.model.files import CheckpointError
from oxygen_ros.model.tokenizer import Tokenizer

def peak_kb():
    return int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM")).split()[1])

before = peak_kb()
try:
    Tokenizer(sys.argv[1])
except CheckpointError as e:
    print(e)
print(peak_kb() - before)
"""


@pytest.mark.parametrize("gib", [1, 2])
def test_a_huge_sparse_tokenizer_is_refused_in_one_line_without_reading_it(tmp_path, gib):
    """Issue 40 item 8: before, a sparse 1 GiB tokenizer.model cost +1.6 GB before its refusal and a 2 GiB one
    ended the process with SIGSEGV (sentencepiece read it whole). In a process of its own (a crash is a
    return code here, not the suite's end), its peak memory measured around the call."""
    path = tmp_path / "tokenizer.model"
    sparse("tokenizer.model", gib << 30)(tmp_path)
    run = subprocess.run([sys.executable, "-c", TOKENIZER_PROBE, str(path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, f"return code {run.returncode}: {run.stderr[-2000:]}"
    message, growth_kb = run.stdout.splitlines()
    assert message == f"{path}: {gib << 30} bytes, more than the {MAX_TOKENIZER_BYTES} such a file may have"
    assert int(growth_kb) < 16 << 10, f"grew by {int(growth_kb) >> 10} MB while refusing it"


@pytest.mark.parametrize("spoil, loader, culprit, said", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_file_is_a_checkpoint_error_naming_it(root, within_seconds, spoil, loader, culprit, said):
    LOADERS[loader](root)                               # the unspoilt files load
    spoil(root)
    with pytest.raises(CheckpointError) as refused:
        LOADERS[loader](root)
    message = str(refused.value)
    assert type(refused.value) is CheckpointError
    assert message.startswith(f"{root / culprit}:") or message.startswith(f"{root / culprit} ("), message
    assert said in message, message
    assert "\n" not in message and len(message) < 1000, message


# ------------------------------------------------------------------------------- at the engine's configure
def test_file_problems_lists_each_files_problem_once_and_loads_nothing(root, within_seconds):
    """What the engine node lists at configure: the weights' dtype, the tokenizer (a FIFO) and the statistics
    (a FIFO), one line each, every line naming its file."""
    tensors(lambda t: t.__setitem__(Q0, t[Q0].to(torch.int32)))(root)
    fifo("tokenizer.model")(root)
    fifo(NORM)(root)
    assert file_problems(CFG) == []                                      # random weights: nothing to read
    problems = file_problems(CFG, checkpoint=str(root / "ckpt"), tokenizer=str(root / "tokenizer.model"),
                             norm_stats=str(root / "ckpt"))
    assert problems == [
        f"{root / 'ckpt' / 'model.safetensors'}: 1 tensor(s) are not floating-point weights (F16, BF16, F32, F64): "
        f"{Q0} is I32",
        f"{root / 'tokenizer.model'}: is a FIFO, not a regular file",
        f"{root / NORM}: is a FIFO, not a regular file"]


def test_the_engine_node_lists_checkpoint_values_templates_seed_and_files_together(root, within_seconds):
    """Issue 33 items 6-7 at the engine node's configure: a checkpoint's chunk_size beyond the parameter's
    maximum, a question template the engine cannot format, a negative seed and a FIFO for norm stats are
    refused together, one line each, before anything loads (before: served, formatted on every question,
    accepted then no chunk, and a start that hung)."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from oxygen_ros.nodes.engine_node import EngineNode

    (root / "ckpt" / "config.json").write_text('{"chunk_size": 3000, "num_inference_steps": 1e8}')
    fifo(NORM)(root)
    context = Context()
    rclpy.init(context=context, args=["test"])
    node = EngineNode(context=context, parameter_overrides=[
        Parameter("model", value="tiny"), Parameter("checkpoint", value=str(root / "ckpt")),
        Parameter("norm_stats", value=str(root / NORM)), Parameter("seed", value=-1),
        Parameter("question_template", value="{text}{0}"), Parameter("kv_budget_mb", value=8.0)])
    try:
        node.trigger_configure()
        assert node.engine is None
        lines = node.failure.splitlines()
    finally:
        node.destroy_node()
        rclpy.shutdown(context=context)
    config = root / "ckpt" / "config.json"
    for expected in (f"{config}: chunk_size must be an integer in [1, 1000], got 3000",
                     f"{config}: num_inference_steps must be an integer in [1, 1000], got 100000000.0",
                     "oxygen_engine.seed = -1: must be >= 0",
                     "question_template '{text}{0}': {0} is not a field it may use ({text}; write {{ and }} for a "
                     "literal brace)",
                     f"{root / NORM}: is a FIFO, not a regular file"):
        assert expected in lines, node.failure
    assert len(lines) == len(set(lines)), node.failure                  # each once
