"""The strict π0.5 checkpoint loader: openpi and LeRobot layouts, aliases, sharding, dtypes, and errors that
name the offending keys."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file, save_model
from torch import nn

from oxygen_ros.model import inference
from oxygen_ros.model.checkpoint import (CheckpointError, init_random_weights, load_pi05, openpi_name,
                                         save_checkpoint)
from oxygen_ros.model.config import GemmaConfig, Pi05Config, VisionConfig, from_oracle_json
from oxygen_ros.model.pi05 import Pi05, PrefixRow, param_dtype

ORACLE = Path(__file__).resolve().parents[1] / ".." / "shared" / "oracle"
LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"
EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
EXPERT_LM_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"
Q0 = "paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.q_proj.weight"


def small_config(width: int = 32, **changes) -> Pi05Config:
    """A π0.5 of ~40k parameters: 2x2 patches of 14 px per image, 2 layers everywhere."""
    cfg = Pi05Config(
        vlm=GemmaConfig(width=width, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=8),
        expert=GemmaConfig(width=16, depth=2, mlp_dim=32, num_heads=2, num_kv_heads=1, head_dim=8),
        vision=VisionConfig(width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=14, image_size=28),
        vocab_size=64, action_dim=8, action_horizon=4, max_token_len=16, num_denoise_steps=3)
    return cfg.replace(**changes)


CFG = small_config()


def random_model(cfg: Pi05Config = CFG, seed: int = 0) -> Pi05:
    return init_random_weights(Pi05(cfg), seed).eval()


def openpi_tensors(model: Pi05) -> dict[str, torch.Tensor]:
    return {openpi_name(n): p.detach().clone().contiguous() for n, p in model.named_parameters()}


def write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def assert_same_parameters(a: Pi05, b: Pi05, dtype: torch.dtype | None = None):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        expected = pa[name].detach() if dtype is None else pa[name].detach().to(dtype)
        assert torch.equal(expected, pb[name].detach()), name


def outputs(model: Pi05) -> tuple[torch.Tensor, torch.Tensor]:
    """Last prefix hidden state and actions of a fixed input (2 cameras, 5 tokens)."""
    g = torch.Generator().manual_seed(1)
    size = model.cfg.vision.image_size
    row = PrefixRow(torch.rand(2, 3, size, size, generator=g) * 2 - 1, torch.tensor([2, 7, 9, 11, 5]))
    cache = inference.ContiguousCache(model, 64)
    pre = inference.prefill(model, cache, [row], "torch")
    noise = torch.randn(1, model.cfg.action_horizon, model.cfg.action_dim, generator=g)
    return pre.hidden, inference.sample_actions(model, cache, pre.segments, noise, backend="torch")


# Bitwise equality holds for the parameters (asserted above), not for outputs: a loaded tensor may sit at
# another alignment or stride than the original, and GEMM kernels may pick another blocking (so another
# summation order) for it; on an AMD EPYC the outputs differed in the last bits. float32 through this
# 2-layer model: 1e-5, absolute and relative (what one float32 ulp per op accumulates to is ~1e-6).
OUTPUT_TOL = dict(rtol=1e-5, atol=1e-5)


def assert_same_outputs(a: Pi05, b: Pi05):
    """The same weights give the same outputs: compared on `b`'s flow-time grid (a LeRobot file denoises on
    LeRobot's, which differs from openpi's by float32 rounding)."""
    a.time_grid = b.time_grid
    for x, y in zip(outputs(a), outputs(b)):
        torch.testing.assert_close(y, x, **OUTPUT_TOL)


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("fmt", ["openpi", "lerobot"])
def test_round_trip(tmp_path, fmt):
    model = random_model()
    out = save_checkpoint(model, tmp_path, fmt)
    assert out == tmp_path / "model.safetensors"
    with safe_open(str(out), framework="pt") as f:
        keys = set(f.keys())
    if fmt == "openpi":
        assert LM_HEAD in keys and EMBED not in keys                  # tied embedding stored once
        assert Q0 in keys
    else:
        assert all(k.startswith("model.") for k in keys)
        assert {"model." + LM_HEAD, "model." + EMBED} <= keys          # LeRobot stores both names
    for path in (tmp_path, out):                                       # a directory or the file itself
        loaded = load_pi05(path, CFG)
        assert_same_parameters(model, loaded)
        assert loaded.time_grid == fmt          # denoised on its format's flow-time grid (test_lerobot_time_grid.py)
        assert_same_outputs(model, loaded)


def test_loaded_model_dtype_device_and_no_grad(tmp_path):
    model = random_model()
    save_checkpoint(model, tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        loaded = load_pi05(tmp_path, CFG, device="cpu", dtype=dtype)
        assert not loaded.training
        for name, p in loaded.named_parameters():
            assert p.dtype == param_dtype(name, dtype), name     # bfloat16 keeps openpi's float32 islands
            assert p.device.type == "cpu", name
            assert not p.requires_grad, name
        assert loaded.dtype == dtype
    islands = {n for n, p in load_pi05(tmp_path, CFG, dtype=torch.bfloat16).named_parameters()
               if p.dtype == torch.float32}
    for expected in ("vision.patch_embedding.weight", "vision.position_embedding", "vlm_layers.0.input_norm.weight",
                     "vlm_norm.weight", "expert_layers.0.post_attention_norm.dense.weight", "expert_norm.dense.bias",
                     "action_in_proj.weight", "action_out_proj.bias", "time_mlp_in.weight", "time_mlp_out.bias"):
        assert expected in islands, expected
    assert not any(n.startswith(("vision.layers.", "embed_tokens", "projector")) or ".q_proj" in n for n in islands)
    for name, p in load_pi05(tmp_path, CFG, dtype=torch.bfloat16, islands=False).named_parameters():
        assert p.dtype == torch.bfloat16, name
    loaded = load_pi05(tmp_path, CFG, dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        served = dict(loaded.named_parameters())[name]
        assert torch.equal(p.detach().to(param_dtype(name, torch.bfloat16)), served), name


def test_bf16_checkpoint_loads_into_float32(tmp_path):
    model = random_model()
    write(tmp_path, {k: v.to(torch.bfloat16) for k, v in openpi_tensors(model).items()})
    loaded = load_pi05(tmp_path, CFG, dtype=torch.float32)
    for name, p in model.named_parameters():
        q = dict(loaded.named_parameters())[name]
        assert q.dtype == torch.float32
        assert torch.equal(q, p.detach().to(torch.bfloat16).float()), name


def test_openpi_file_written_by_save_model(tmp_path):
    """What openpi actually writes: `safetensors.torch.save_model(PI0Pytorch)` keeps one name of the tied
    embedding (lm_head, alphabetically first), records the alias in the metadata, and also holds the
    expert's unused LM head."""
    model = random_model()
    tensors = openpi_tensors(model)
    module = nn.Module()

    def put(name: str, tensor: torch.Tensor | nn.Parameter):
        *path, leaf = name.split(".")
        m = module
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor))

    for name, tensor in tensors.items():
        put(name, tensor)
    put(EMBED, getattr(module.paligemma_with_expert.paligemma.lm_head, "weight"))  # tied: same Parameter
    put(EXPERT_LM_HEAD, torch.randn(CFG.vocab_size, CFG.expert.width))
    tmp_path.mkdir(exist_ok=True)
    save_model(module, str(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert LM_HEAD in keys and EMBED not in keys and EXPERT_LM_HEAD in keys
    assert meta[EMBED] == LM_HEAD
    loaded = load_pi05(tmp_path, CFG)
    assert_same_parameters(model, loaded)
    assert_same_outputs(model, loaded)


def test_expert_lm_head_is_ignored_in_lerobot_files_too(tmp_path):
    model = random_model()
    save_checkpoint(model, tmp_path, "lerobot")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model." + EXPERT_LM_HEAD] = torch.randn(CFG.vocab_size, CFG.expert.width)
    write(tmp_path, tensors)
    assert_same_parameters(model, load_pi05(tmp_path, CFG))


def test_lerobot_file_with_embed_tokens_and_lm_head(tmp_path):
    model = random_model()
    tensors = {"model." + k: v for k, v in openpi_tensors(model).items()}
    tensors["model." + EMBED] = tensors["model." + LM_HEAD].clone()
    write(tmp_path, tensors)
    loaded = load_pi05(tmp_path, CFG)
    assert_same_parameters(model, loaded)
    assert_same_outputs(model, loaded)


def test_lerobot_file_with_embed_tokens_only(tmp_path):
    """The tied embedding under its embedding name only (the alias) is enough."""
    model = random_model()
    tensors = openpi_tensors(model)
    tensors[EMBED] = tensors.pop(LM_HEAD)
    write(tmp_path, {"model." + k: v for k, v in tensors.items()})
    assert_same_parameters(model, load_pi05(tmp_path, CFG))


def test_action_time_mlp_alias(tmp_path):
    model = random_model()
    tensors = openpi_tensors(model)
    for part in ("in", "out"):
        for p in ("weight", "bias"):
            tensors[f"action_time_mlp_{part}.{p}"] = tensors.pop(f"time_mlp_{part}.{p}")
    write(tmp_path, tensors)
    loaded = load_pi05(tmp_path, CFG)
    assert_same_parameters(model, loaded)


def test_sharded_checkpoint(tmp_path):
    model = random_model()
    tensors = openpi_tensors(model)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    assert not (tmp_path / "model.safetensors").exists()
    loaded = load_pi05(tmp_path, CFG)
    assert_same_parameters(model, loaded)
    assert_same_outputs(model, loaded)


# ------------------------------------------------------------------------------------------ errors
def test_missing_key_is_named(tmp_path):
    tensors = openpi_tensors(random_model())
    del tensors["action_out_proj.bias"]
    del tensors[Q0]
    write(tmp_path, tensors)
    with pytest.raises(CheckpointError, match="2 missing key") as err:
        load_pi05(tmp_path, CFG)
    assert "action_out_proj.bias" in str(err.value) and Q0 in str(err.value)


def test_unexpected_key_is_named(tmp_path):
    tensors = openpi_tensors(random_model())
    tensors["paligemma_with_expert.something_new.weight"] = torch.zeros(3)
    write(tmp_path, tensors)
    with pytest.raises(CheckpointError, match="unexpected key") as err:
        load_pi05(tmp_path, CFG)
    assert "paligemma_with_expert.something_new.weight" in str(err.value)


def test_pi0_checkpoint_gets_the_pi0_hint(tmp_path):
    tensors = openpi_tensors(random_model())
    tensors["state_proj.weight"] = torch.zeros(CFG.expert.width, CFG.action_dim)
    tensors["state_proj.bias"] = torch.zeros(CFG.expert.width)
    write(tmp_path, tensors)
    with pytest.raises(CheckpointError) as err:
        load_pi05(tmp_path, CFG)
    message = str(err.value)
    assert "state_proj.weight" in message and "state_proj.bias" in message
    assert "π0, not a π0.5" in message


def test_expert_rmsnorm_weights_get_the_adarms_hint(tmp_path):
    tensors = openpi_tensors(random_model())
    key = "paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.weight"
    tensors[key] = torch.zeros(CFG.expert.width)
    write(tmp_path, tensors)
    with pytest.raises(CheckpointError, match="adaRMSNorm") as err:
        load_pi05(tmp_path, CFG)
    assert key in str(err.value)


def test_shape_mismatch_names_the_keys(tmp_path):
    save_checkpoint(random_model(small_config(width=48)), tmp_path)
    with pytest.raises(CheckpointError, match="wrong preset") as err:
        load_pi05(tmp_path, CFG)
    message = str(err.value)
    assert "22 tensor(s) do not match" in message                    # every VLM-width tensor
    assert ("paligemma_with_expert.paligemma.model.multi_modal_projector.linear.weight has shape [48, 16], "
            "the config expects [32, 16]") in message


def test_mixed_prefixed_and_unprefixed_keys(tmp_path):
    tensors = openpi_tensors(random_model())
    tensors["model." + Q0] = tensors.pop(Q0)
    write(tmp_path, tensors)
    with pytest.raises(CheckpointError, match="mixes") as err:
        load_pi05(tmp_path, CFG)
    assert "action_in_proj.weight" in str(err.value)          # names (some of) the unprefixed keys


def test_directory_without_model_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="no model.safetensors") as err:
        load_pi05(tmp_path, CFG)
    assert str(tmp_path) in str(err.value)


def test_wrong_format_name():
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        save_checkpoint(random_model(), "/nonexistent", "orbax")


# ------------------------------------------------------------------------------------------ oracle files
@pytest.mark.parametrize("case", ["case_a", "case_c"])
def test_oracle_checkpoints_load(case):
    path = ORACLE / case
    assert (path / "model.safetensors").exists(), f"oracle case not found at {path.resolve()}"
    cfg = from_oracle_json(path / "config.json")
    model = load_pi05(path, cfg)
    file = load_file(str(path / "model.safetensors"))
    assert EMBED not in file and EXPERT_LM_HEAD in file                 # openpi save_model layout
    assert torch.equal(model.embed_tokens.weight, file[LM_HEAD])
    for name, p in model.named_parameters():
        assert torch.equal(p, file[openpi_name(name)]), name
    assert not any(p.requires_grad for p in model.parameters())
    # Every file tensor but the expert's LM head was used.
    assert {openpi_name(n) for n, _ in model.named_parameters()} == set(file) - {EXPERT_LM_HEAD}
    assert np.isfinite(model.embed_tokens.weight.numpy()).all()


# ------------------------------------------------------------------------------------------ corrupt files
def test_a_corrupt_safetensors_file_is_a_checkpoint_error_naming_it(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":1}garbage..")
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'model.safetensors'}: not a readable safetensors file"):
        load_pi05(tmp_path, CFG)


def test_a_truncated_safetensors_file_is_a_checkpoint_error(tmp_path):
    out = write(tmp_path, openpi_tensors(random_model())) / "model.safetensors"
    out.write_bytes(out.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_pi05(tmp_path, CFG)


@pytest.mark.parametrize("index, problem", [
    ("{not json", "not valid JSON"),
    ('{"metadata": {}}', "has no weight_map"),
    ('{"weight_map": {"a": 3}}', "shard name 3 is not a file name"),
    ('{"weight_map": {"a": "../../etc/model.safetensors"}}', "shard name '../../etc/model.safetensors' is not a file name"),
    ('{"weight_map": {"a": "/abs/model.safetensors"}}', "shard name '/abs/model.safetensors' is not a file name"),
    ('{"weight_map": {"a": "missing.safetensors"}}', "shard missing.safetensors not found"),
])
def test_a_bad_shard_index_is_a_checkpoint_error(tmp_path, index, problem):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=f"model.safetensors.index.json: .*{problem}"):
        load_pi05(tmp_path, CFG)


def test_the_float32_islands_spelled_out_by_parameter_name(tmp_path):
    """bfloat16 serving keeps exactly these parameters in float32, named per layer here rather than with
    the regex the code uses (model/pi05.py FLOAT32_ISLANDS): dropping the VLM's post-attention norms from
    that regex passed the test above, which compares against the same regex (issue #21)."""
    save_checkpoint(random_model(), tmp_path)
    loaded = load_pi05(tmp_path, CFG, dtype=torch.bfloat16)
    names = [n for n, _ in loaded.named_parameters()]

    def under(module: str) -> set[str]:
        found = {n for n in names if n == module or n.startswith(module + ".")}
        assert found, f"no parameter under {module}"
        return found

    expected = set().union(*(under(m) for m in (
        "vision.patch_embedding", "vision.position_embedding", "vlm_norm", "expert_norm",
        "action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")))
    for stack, depth in (("vlm", CFG.vlm.depth), ("expert", CFG.expert.depth)):
        for layer in range(depth):
            for norm in ("input_norm", "post_attention_norm"):      # the expert's: adaRMS modulation (dense)
                expected |= under(f"{stack}_layers.{layer}.{norm}")
    float32 = {n for n, p in loaded.named_parameters() if p.dtype == torch.float32}
    assert float32 == expected, (sorted(float32 - expected), sorted(expected - float32))


def lerobot_tensors_with_head(model: Pi05, head: torch.Tensor) -> dict[str, torch.Tensor]:
    """A LeRobot file: the embedding as embed_tokens, and `head` as the separate lm_head."""
    tensors = {"model." + k: v for k, v in openpi_tensors(model).items()}
    tensors["model." + EMBED] = tensors["model." + LM_HEAD].clone()
    tensors["model." + LM_HEAD] = head
    return tensors


@pytest.mark.parametrize("head, problem", [
    (torch.zeros(CFG.vocab_size, CFG.vlm.width + 1), f"{LM_HEAD} has shape [64, 33], the config expects [64, 32]"),
    (torch.zeros(CFG.vocab_size - 1, CFG.vlm.width), f"{LM_HEAD} has shape [63, 32], the config expects [64, 32]"),
    (torch.zeros(CFG.vocab_size, CFG.vlm.width, dtype=torch.int32), f"{LM_HEAD} is I32"),
])
def test_a_lerobot_lm_head_apart_from_the_embedding_is_checked(tmp_path, head, problem):
    """Issue 41 item 7: LeRobot's separate lm_head is the text head: its shape and dtype are checked before the
    load, as every other weight's (it was read unchecked)."""
    write(tmp_path, lerobot_tensors_with_head(random_model(), head))
    with pytest.raises(CheckpointError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        load_pi05(tmp_path, CFG)


def test_a_differing_lerobot_lm_head_is_the_text_head_and_an_equal_one_is_not_kept(tmp_path):
    """As LeRobot reads its file: the embedding from embed_tokens, the text logits from lm_head when the two
    were fine-tuned apart; an lm_head equal to the embedding is the tied one (nothing kept apart)."""
    model = random_model()
    head = torch.randn(CFG.vocab_size, CFG.vlm.width, generator=torch.Generator().manual_seed(5))
    write(tmp_path / "apart", lerobot_tensors_with_head(model, head))
    loaded = load_pi05(tmp_path / "apart", CFG)
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight)
    assert torch.equal(loaded.lm_head, head)
    write(tmp_path / "tied", lerobot_tensors_with_head(model, model.embed_tokens.weight.detach().clone()))
    assert load_pi05(tmp_path / "tied", CFG).lm_head is None


def file_mapped(tensor: torch.Tensor, path: Path) -> bool:
    """Whether the tensor's memory lies in a memory map of `path` (Linux /proc/self/maps)."""
    address = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return len(fields) > 5 and fields[5] == str(path.resolve())
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_weights_in_the_serving_dtype_stay_mapped_and_converted_ones_are_read_apart(tmp_path):
    """A weight already in the serving dtype is the file's memory map (never a second copy); one converted is
    read into memory of its own (no page of the file kept resident for it) and equal to the mapped value cast."""
    model = random_model()
    save_checkpoint(model, tmp_path, "openpi")
    file = tmp_path / "model.safetensors"
    mapped = load_pi05(tmp_path, CFG, dtype=torch.float32)
    converted = load_pi05(tmp_path, CFG, dtype=torch.bfloat16)
    q = "vlm_layers.0.q_proj.weight"
    assert file_mapped(dict(mapped.named_parameters())[q], file)
    assert not file_mapped(dict(converted.named_parameters())[q], file)
    for (name, a), (_, b) in zip(mapped.named_parameters(), converted.named_parameters()):
        assert torch.equal(a.to(b.dtype), b), name
