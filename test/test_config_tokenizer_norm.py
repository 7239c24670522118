"""Model configs (presets, parameter counts, validation, files), the tokenizer and the π0.5 prompt format,
and openpi norm stats."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from oxygen_ros.model.files import CheckpointError
from oxygen_ros.model.config import (PRESETS, GemmaConfig, Pi05Config, VisionConfig, load_config,
                                     num_parameters, preset)
from oxygen_ros.model.normalize import Normalizer
from oxygen_ros.model.pi05 import Pi05
from oxygen_ros.model.tokenizer import TINY_TOKENIZER, Prompt, Tokenizer, discretize_state, train_tiny

ASSETS = Path(str(resources.files("oxygen_ros.model") / "assets"))


# ============================================================================================ config
# π0.5 = PaliGemma (SigLIP So400m/14 vision tower without its pooling head, ~412 M; Gemma 2B with its
# 257152 x 2048 tied embedding, ~2.51 B) + the Gemma 300M action expert with adaRMSNorm (~0.43 B) + the
# action/time projections: the published "3.3 B" model.
PI05_PARAMETERS = 3_353_433_872


def test_pi05_preset_builds_on_meta_with_the_published_size():
    cfg = preset("pi05")
    with torch.device("meta"):
        model = Pi05(cfg)
    count = sum(p.numel() for p in model.parameters())
    assert count == num_parameters(cfg) == PI05_PARAMETERS
    assert 3.2e9 <= count <= 3.5e9
    parts = {}
    for name, p in model.named_parameters():
        parts[name.split(".")[0]] = parts.get(name.split(".")[0], 0) + p.numel()
    assert parts["embed_tokens"] == 257152 * 2048
    assert 0.40e9 < parts["vision"] < 0.42e9                                  # So400m without head
    assert 1.9e9 < parts["vlm_layers"] + parts["embed_tokens"] - 0.5e9 < 2.1e9  # Gemma 2B body
    assert 0.40e9 < parts["expert_layers"] < 0.45e9                           # Gemma 300M + adaRMS
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny", "bench"])
def test_num_parameters_matches_a_real_build(name):
    cfg = preset(name)
    with torch.device("meta"):
        model = Pi05(cfg)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(cfg)


def test_num_parameters_of_an_odd_config():
    cfg = Pi05Config(vlm=GemmaConfig(24, 3, 40, 6, 2, 4), expert=GemmaConfig(10, 3, 14, 4, 2, 4),
                     vision=VisionConfig(12, 2, 20, 3, patch_size=7, image_size=21), vocab_size=37,
                     action_dim=5, action_horizon=3)
    assert sum(p.numel() for p in Pi05(cfg).parameters()) == num_parameters(cfg)


def test_presets():
    assert set(PRESETS) == {"pi05", "bench", "tiny", "demo"}
    assert preset("pi05").prefix_language_attention == "bidirectional"   # the upstream default
    assert preset("tiny").vocab_size == preset("demo").vocab_size == Tokenizer.tiny().vocab_size
    with pytest.raises(ValueError, match="unknown model preset 'pi0'"):
        preset("pi0")


def _cfg(**changes) -> Pi05Config:
    base = dict(vlm=GemmaConfig(32, 2, 64, 4, 1, 8), expert=GemmaConfig(16, 2, 32, 4, 1, 8),
                vision=VisionConfig(16, 1, 32, 2, patch_size=14, image_size=28), vocab_size=64)
    return Pi05Config(**{**base, **changes})


@pytest.mark.parametrize("changes, message", [
    (dict(expert=GemmaConfig(16, 2, 32, 4, 1, 16)), r"expert head_dim \(16\) must equal the VLM's \(8\)"),
    (dict(expert=GemmaConfig(16, 2, 32, 4, 2, 8)), r"expert num_kv_heads \(2\) must equal the VLM's \(1\)"),
    (dict(expert=GemmaConfig(16, 3, 32, 4, 1, 8)), r"expert depth \(3\) must equal the VLM's \(2\)"),
    (dict(vlm=GemmaConfig(32, 2, 64, 3, 2, 8), expert=GemmaConfig(16, 2, 32, 4, 2, 8)),
     "num_heads 3 is not a multiple of num_kv_heads 2"),
    (dict(vlm=GemmaConfig(32, 2, 64, 4, 1, 7), expert=GemmaConfig(16, 2, 32, 4, 1, 7)),
     r"head_dim 7 must be even \(RoPE\)"),
    (dict(vision=VisionConfig(18, 1, 32, 4, patch_size=14, image_size=28)),
     "vision width 18 is not a multiple of its 4 heads"),
    (dict(vision=VisionConfig(16, 1, 32, 2, patch_size=14, image_size=30)),
     "image_size must be a multiple of patch_size"),
    (dict(expert=GemmaConfig(15, 2, 32, 4, 1, 8)), "expert width must be even"),
    (dict(action_horizon=0), r"action_horizon must be an integer in \[1, 1000\], got 0"),
    (dict(vocab_size=-1), r"vocab_size must be an integer in \[1, 2147483648\], got -1"),
    # Beyond the bounds the engine runs nothing useful (10^8 denoise steps: no chunk, ever); a float or a
    # boolean where an integer is needed is refused, not truncated.
    (dict(num_denoise_steps=10**8), r"num_denoise_steps must be an integer in \[1, 1000\], got 100000000"),
    (dict(action_horizon=3000), r"action_horizon must be an integer in \[1, 1000\], got 3000"),
    (dict(max_token_len=9000), r"max_token_len must be an integer in \[1, 8192\], got 9000"),
    (dict(action_dim=2000), r"action_dim must be an integer in \[1, 1024\], got 2000"),
    (dict(num_denoise_steps=10.0), r"num_denoise_steps must be an integer in \[1, 1000\], got 10.0"),
    (dict(action_horizon=True), r"action_horizon must be an integer in \[1, 1000\], got True"),
    (dict(vlm=GemmaConfig(32, 2, 64, 2, 0, 8)), r"vlm.num_kv_heads must be an integer in \[1, 2147483648\], got 0"),
    (dict(vision=VisionConfig(16, 1, 32, 2, layer_norm_eps=float("nan"))),
     "vision.layer_norm_eps must be a positive finite number, got nan"),
    (dict(time_max_period=-4.0), "time_max_period must be a positive finite number, got -4.0"),
    (dict(prefix_conditioning="yes"), "prefix_conditioning must be true or false, got 'yes'"),
    (dict(prefix_language_attention="prefix_lm"), "prefix_language_attention must be one of"),
])
def test_config_validation(changes, message):
    with pytest.raises(ValueError, match="invalid model config: .*" + message):
        _cfg(**changes)


def test_config_validation_reports_every_problem():
    with pytest.raises(ValueError) as err:
        _cfg(expert=GemmaConfig(16, 3, 32, 4, 1, 16), action_dim=0)
    assert "depth" in str(err.value) and "head_dim" in str(err.value) and "action_dim" in str(err.value)


def test_replace_validates_too():
    cfg = _cfg()
    assert cfg.replace(prefix_language_attention="causal").prefix_language_attention == "causal"
    with pytest.raises(ValueError, match="prefix_language_attention"):
        cfg.replace(prefix_language_attention="Causal")


def _plain(cfg: Pi05Config) -> dict:
    return json.loads(json.dumps(cfg.to_dict()))          # tuples -> lists, as a file holds them


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_load_config_files(tmp_path, suffix):
    cfg = preset("tiny").replace(prefix_language_attention="causal", action_horizon=7)
    path = tmp_path / f"model{suffix}"
    data = _plain(cfg)
    path.write_text(json.dumps(data) if suffix == ".json" else yaml.safe_dump(data))
    loaded = load_config(path)
    assert loaded == cfg
    assert isinstance(loaded.camera_slots, tuple) and isinstance(loaded.vlm, GemmaConfig)


def test_load_config_yaml_written_by_hand(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("""
vocab_size: 1000
num_denoise_steps: 5
vlm: {width: 32, depth: 2, mlp_dim: 64, num_heads: 4, num_kv_heads: 1, head_dim: 8}
expert: {width: 16, depth: 2, mlp_dim: 32, num_heads: 4, num_kv_heads: 1, head_dim: 8}
vision: {width: 16, depth: 1, mlp_dim: 32, num_heads: 2, image_size: 28}
""")
    cfg = load_config(path)
    assert cfg.num_denoise_steps == 5 and cfg.vision.image_size == 28 and cfg.vision.patch_size == 14
    assert cfg.prefix_language_attention == "bidirectional"


def test_load_config_rejects_unknown_keys(tmp_path):
    data = _plain(preset("tiny"))
    data["prefix_attention"] = "causal"                   # misspelt field
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"unknown model config keys: \['prefix_attention'\]"):
        load_config(path)
    data = _plain(preset("tiny"))
    data["vlm"]["hidden_size"] = 3                        # unknown nested key: named too
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"unknown model config keys in .vlm.: \[.hidden_size.\]"):
        load_config(path)


def test_load_config_rejects_non_mappings_and_invalid_values(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        load_config(path)
    data = _plain(preset("tiny"))
    data["expert"]["head_dim"] = 32
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"expert head_dim \(32\) must equal the VLM's \(64\)"):
        load_config(path)


# ============================================================================================ tokenizer
@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.tiny()


def test_tiny_tokenizer_special_ids(tok):
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert [tok.sp.id_to_piece(i) for i in range(3)] == ["<pad>", "</s>", "<s>"]
    assert tok.vocab_size == 1000 == preset("tiny").vocab_size
    assert tok.encode("pick", bos=True)[0] == 2 and tok.encode("pick")[0] != 2


def test_discretize_state_by_hand():
    # openpi: np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
    values = np.array([-1.0, 1.0, 0.0, -0.999, 0.5, 1 / 128 - 1e-9, 1 / 128, 0.99999])
    assert discretize_state(values).tolist() == [0, 255, 128, 0, 192, 128, 129, 255]
    # Not clipped, as upstream: below -1 is bin -1, above 1 stays in the last bin.
    out_of_range = np.array([-1.5, -1.0000001, 1.0000001, 3.0])
    assert discretize_state(out_of_range).tolist() == [-1, -1, 255, 255]
    rng = np.random.default_rng(0)
    x = rng.uniform(-1.3, 1.3, size=200)
    np.testing.assert_array_equal(discretize_state(x), np.digitize(x, np.linspace(-1, 1, 257)[:-1]) - 1)


def test_action_prompt_with_state(tok):
    state = np.array([-1.0, 1.0, 0.0, 0.5, -2.0])
    prompt = tok.action_prompt("  pick_up the\nred cube \n", state, 200)
    text = "Task: pick up the red cube, State: 0 255 128 192 -1;\nAction: "
    assert prompt == Prompt([2] + tok.encode(text), 0)
    assert tok.decode(prompt.tokens) == text


def test_action_prompt_without_state(tok):
    prompt = tok.action_prompt(" open_the drawer\n", None, 200)
    assert prompt.tokens == [2] + tok.encode("open the drawer") + tok.encode("\n")
    assert prompt.truncated == 0


def test_action_prompt_truncation_is_reported(tok):
    state = np.linspace(-1, 1, 32)
    full = tok.action_prompt("stack the blocks", state, 10_000)
    assert full.truncated == 0
    cut = tok.action_prompt("stack the blocks", state, 20)
    assert cut.tokens == full.tokens[:20]
    assert cut.truncated == len(full.tokens) - 20 > 0
    exact = tok.action_prompt("stack the blocks", state, len(full.tokens))
    assert exact == full


@pytest.mark.parametrize("text", ["pick up the cube", "Task: x, State: 0 1 2;\nAction: ", "  two  spaces ",
                                  "Grüße aus Köln", "把红色方块放进盒子", "robot 🤖 arm", "tab\tand\u00a0nbsp"])
def test_decode_encode_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_byte_fallback_for_unseen_characters(tok):
    ids = tok.encode("日")
    assert tok.sp.unk_id() not in ids                      # byte pieces, not <unk>
    assert [tok.sp.id_to_piece(i) for i in ids if tok.sp.id_to_piece(i) != "▁"] == ["<0xE6>", "<0x97>", "<0xA5>"]


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'paligemma_tokenizer.model'}: not found"):
        Tokenizer(tmp_path / "paligemma_tokenizer.model")


def test_retraining_reproduces_the_shipped_vocabulary(tmp_path, tok):
    import sentencepiece as spm

    model = train_tiny(tmp_path, ASSETS / "tiny_corpus.txt")
    assert model == tmp_path / TINY_TOKENIZER and sorted(p.name for p in tmp_path.iterdir()) == ["tiny_corpus.txt", TINY_TOKENIZER]  # the corpus is copied next to it (relative paths)
    fresh = spm.SentencePieceProcessor(model_file=str(model))
    assert fresh.get_piece_size() == tok.vocab_size
    assert [fresh.id_to_piece(i) for i in range(tok.vocab_size)] == [tok.sp.id_to_piece(i)
                                                                      for i in range(tok.vocab_size)]
    assert [fresh.get_score(i) for i in range(tok.vocab_size)] == [tok.sp.get_score(i)
                                                                    for i in range(tok.vocab_size)]
    text = (ASSETS / "tiny_corpus.txt").read_text()[:2000]
    assert fresh.encode(text) == tok.sp.encode(text)


def test_retraining_reproduces_the_shipped_file_byte_for_byte(tmp_path):
    model = train_tiny(tmp_path, ASSETS / "tiny_corpus.txt")
    assert model.read_bytes() == (ASSETS / TINY_TOKENIZER).read_bytes()


# ============================================================================================ norm stats
STATE = {"mean": [0.0, 1.0, 2.0], "std": [1.0, 2.0, 4.0], "q01": [-1.0, 0.0, -4.0], "q99": [1.0, 2.0, 4.0]}
ACTIONS = {"mean": [0.5, -0.5], "std": [0.25, 0.5], "q01": [-2.0, 10.0], "q99": [2.0, 30.0]}


def _write_stats(path: Path, stats: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"norm_stats": stats}))
    return path


def test_quantile_normalisation_by_hand(tmp_path):
    norm = Normalizer.load(_write_stats(tmp_path / "norm_stats.json", {"state": STATE, "actions": ACTIONS}))
    assert norm.use_quantiles
    x = np.array([0.0, 1.0, 4.0])
    # (x - q01) / (q99 - q01 + 1e-6) * 2 - 1
    expected = [(0 + 1) / (2 + 1e-6) * 2 - 1, (1 - 0) / (2 + 1e-6) * 2 - 1, (4 + 4) / (8 + 1e-6) * 2 - 1]
    np.testing.assert_allclose(norm.normalize_state(x), expected, rtol=0, atol=1e-15)
    assert norm.normalize_state(np.array([-1.0, 0.0, -4.0])).tolist() == [-1.0, -1.0, -1.0]   # q01 -> -1
    # Inverse on the actions: (x + 1) / 2 * (q99 - q01 + 1e-6) + q01
    a = np.array([[-1.0, 1.0], [0.0, 0.5]])
    expected = [[-2.0, 1 * (20 + 1e-6) + 10], [0.5 * (4 + 1e-6) - 2, 0.75 * (20 + 1e-6) + 10]]
    np.testing.assert_allclose(norm.unnormalize_actions(a), expected, rtol=0, atol=1e-12)
    # Round trip with the same stats.
    both = Normalizer(norm.state, norm.state)
    y = np.random.default_rng(1).normal(size=(4, 3))
    np.testing.assert_allclose(both.unnormalize_actions(both.normalize_state(y)), y, atol=1e-12)


def test_fewer_stat_dims_than_the_vector(tmp_path):
    norm = Normalizer.load(_write_stats(tmp_path / "n.json", {"state": STATE, "actions": ACTIONS}))
    state = np.array([0.0, 1.0, 4.0, 7.0, -9.0])                        # 3 stats dims, 5 values
    out = norm.normalize_state(state)
    np.testing.assert_allclose(out[:3], norm.normalize_state(state[:3]))
    assert out[3:].tolist() == [7.0, -9.0]
    chunk = np.full((10, 32), 0.5)                                      # padded action_dim 32, 2 stats dims
    un = norm.unnormalize_actions(chunk)
    assert un.shape == (10, 32)
    np.testing.assert_allclose(un[:, 0], 0.75 * (4 + 1e-6) - 2)
    np.testing.assert_allclose(un[:, 1], 0.75 * (20 + 1e-6) + 10)
    assert np.all(un[:, 2:] == 0.5)


def test_zscore_mode(tmp_path):
    stats = {"state": {k: v for k, v in STATE.items() if k in ("mean", "std")},
             "actions": {k: v for k, v in ACTIONS.items() if k in ("mean", "std")}}
    path = _write_stats(tmp_path / "n.json", stats)
    norm = Normalizer.load(path, use_quantiles=False)
    x = np.array([1.0, 5.0, 2.0])
    np.testing.assert_allclose(norm.normalize_state(x), [(1 - 0) / (1 + 1e-6), (5 - 1) / (2 + 1e-6), 0.0],
                               atol=1e-15)
    np.testing.assert_allclose(norm.unnormalize_actions(np.array([1.0, -2.0])),
                               [1 * (0.25 + 1e-6) + 0.5, -2 * (0.5 + 1e-6) - 0.5], atol=1e-15)
    # Quantile mode (the π0.5 default) needs q01 and q99.
    with pytest.raises(ValueError, match="needs q01 and q99 for 'state'"):
        Normalizer.load(path)


def test_missing_q01_in_quantile_mode(tmp_path):
    state = dict(STATE)
    del state["q01"]
    path = _write_stats(tmp_path / "n.json", {"state": state, "actions": ACTIONS})
    with pytest.raises(ValueError, match="q01 and q99 for 'state'"):
        Normalizer.load(path)
    assert Normalizer.load(path, use_quantiles=False).state.q01 is None


def test_bad_stats(tmp_path):
    with pytest.raises(ValueError, match=r"unknown norm stats keys \['action'\]"):
        Normalizer.load(_write_stats(tmp_path / "a.json", {"state": STATE, "action": ACTIONS}))
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'b.json'}: norm_stats.state.std is missing"):
        Normalizer.load(_write_stats(tmp_path / "b.json", {"state": {"mean": [0.0]}}))
    with pytest.raises(ValueError, match="different lengths"):
        Normalizer.load(_write_stats(tmp_path / "c.json", {"state": {**STATE, "q99": [1.0, 2.0]}}))
    with pytest.raises(CheckpointError, match="norm_stats.state.mean must be a non-empty list of finite numbers"):
        Normalizer.load(_write_stats(tmp_path / "d.json", {"state": {**STATE, "mean": [0.0, float("nan"), 1.0]}}))
    (tmp_path / "e.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'e.json'}: must hold a JSON object, got a list"):
        Normalizer.load(tmp_path / "e.json")


def test_checkpoint_directory_with_assets(tmp_path):
    ckpt = tmp_path / "pi05_droid"
    _write_stats(ckpt / "assets" / "droid" / "norm_stats.json", {"state": STATE, "actions": ACTIONS})
    (ckpt / "model.safetensors").write_bytes(b"")
    norm = Normalizer.load(ckpt)
    assert norm.state.q99.tolist() == STATE["q99"] and norm.actions.mean.tolist() == ACTIONS["mean"]
    assert Normalizer.load(ckpt, asset_id="droid").state.q01.tolist() == STATE["q01"]
    with pytest.raises(ValueError, match="asset_id='libero'"):
        Normalizer.load(ckpt, asset_id="libero")
    # A second asset dir: ambiguous unless asset_id picks one.
    other = {"state": {**STATE, "q01": [-3.0, -3.0, -3.0]}, "actions": ACTIONS}
    _write_stats(ckpt / "assets" / "libero" / "norm_stats.json", other)
    with pytest.raises(ValueError, match="expected one norm_stats.json") as err:
        Normalizer.load(ckpt)
    assert "droid" in str(err.value) and "libero" in str(err.value)
    assert Normalizer.load(ckpt, asset_id="libero").state.q01.tolist() == [-3.0] * 3
    assert Normalizer.load(ckpt, asset_id="droid").state.q01.tolist() == STATE["q01"]
    with pytest.raises(ValueError, match="found none"):
        Normalizer.load(tmp_path / "pi05_droid" / "assets")


def test_identity_normalizer():
    norm = Normalizer.identity()
    x = np.array([3.0, -7.0])
    assert norm.normalize_state(x).tolist() == [3.0, -7.0] and norm.unnormalize_actions(x).tolist() == [3.0, -7.0]


def test_a_corrupt_tokenizer_or_norm_stats_file_is_a_value_error_naming_it(tmp_path):
    from oxygen_ros.model.normalize import Normalizer
    from oxygen_ros.model.tokenizer import Tokenizer

    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match=f"{bad}: not a SentencePiece model"):
        Tokenizer(bad)
    stats = tmp_path / "norm_stats.json"
    stats.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match=f"{stats}: not valid JSON"):
        Normalizer.load(stats)
