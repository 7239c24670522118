"""LeRobot pi05 directories: processor norm stats, camera order, state in the prompt, and the embedding
that LeRobot 0.6.1 fine-tunes apart from the text head (split across shards)."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file
from test_checkpoint import CFG, EMBED, LM_HEAD, openpi_tensors, random_model

from oxygen_ros.model.checkpoint import lerobot_policy, load_pi05
from oxygen_ros.model.normalize import Normalizer

STATE = {"mean": [0.1, -0.2, 0.3], "std": [1.0, 2.0, 0.5], "q01": [-1.0, -3.0, 0.0], "q99": [1.5, 2.0, 0.9]}
ACTIONS = {"mean": [0.0] * 4, "std": [1.0] * 4, "q01": [-2.0, -1.0, 0.0, 5.0], "q99": [2.0, 1.0, 1.0, 9.0]}


def _lerobot_stats(path):
    """What LeRobot's NormalizerProcessorStep saves: flat '<feature>.<stat>' float32 tensors, also for images."""
    flat = {f"observation.state.{k}": np.array(v, np.float32) for k, v in STATE.items()}
    flat |= {f"action.{k}": np.array(v, np.float32) for k, v in ACTIONS.items()}
    flat |= {"observation.state.min": np.array([-5.0, -5.0, -5.0], np.float32),
             "observation.images.base_0_rgb.mean": np.zeros((3, 1, 1), np.float32)}
    path.mkdir(parents=True, exist_ok=True)
    save_numpy(flat, str(path / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    return path


def test_processor_stats_normalise_like_openpi_norm_stats(tmp_path):
    lerobot = Normalizer.load(_lerobot_stats(tmp_path / "lerobot"))
    openpi_file = tmp_path / "openpi" / "norm_stats.json"
    openpi_file.parent.mkdir()
    # openpi's json holds the same numbers (float32, as LeRobot stores them).
    as_f32 = lambda d: {k: np.array(v, np.float32).tolist() for k, v in d.items()}  # noqa: E731
    openpi_file.write_text(json.dumps({"norm_stats": {"state": as_f32(STATE), "actions": as_f32(ACTIONS)}}))
    openpi = Normalizer.load(openpi_file)
    x = np.array([0.3, -1.0, 0.45])
    np.testing.assert_array_equal(lerobot.normalize_state(x), openpi.normalize_state(x))
    a = np.random.default_rng(0).uniform(-1, 1, size=(5, 6))
    np.testing.assert_array_equal(lerobot.unnormalize_actions(a), openpi.unnormalize_actions(a))
    # And the numbers are openpi's formula, by hand.
    q01, q99 = np.float32(STATE["q01"]).astype(np.float64), np.float32(STATE["q99"]).astype(np.float64)
    np.testing.assert_allclose(lerobot.normalize_state(x), (x - q01) / (q99 - q01 + 1e-6) * 2 - 1, atol=1e-12)


def test_processor_stats_without_state_or_actions_are_refused(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    save_numpy({"observation.images.x.mean": np.zeros(3, np.float32)},
               str(tmp_path / "policy_preprocessor_step_1_normalizer_processor.safetensors"))
    with pytest.raises(ValueError, match="no state or action statistics"):
        Normalizer.load(tmp_path)


def _config(path, features: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"type": "pi05", "chunk_size": 50, "input_features": features}))
    return path


def test_camera_order_comes_from_input_features(tmp_path):
    visual = {"type": "VISUAL", "shape": [3, 224, 224]}
    slots = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    policy = lerobot_policy(_config(tmp_path / "a", {"observation.images.image": visual,
                                                     "observation.state": {"type": "STATE", "shape": [8]},
                                                     "observation.images.wrist_image": visual}))
    assert policy.state_in_prompt                       # LeRobot's pi05 always puts the state in the prompt
    assert policy.camera_slots(slots) == ({"observation.images.image": "base_0_rgb",
                                           "observation.images.wrist_image": "left_wrist_0_rgb"}, [])
    # Named after slots, but in another order: refused with how to fix it.
    swapped = lerobot_policy(_config(tmp_path / "b", {"observation.images.left_wrist_0_rgb": visual,
                                                      "observation.images.base_0_rgb": visual}))
    _, problems = swapped.camera_slots(slots)
    assert len(problems) == 2 and "reorder input_features" in problems[0]
    too_many = lerobot_policy(_config(tmp_path / "c", {f"observation.images.cam{i}": visual for i in range(4)}))
    assert "4 cameras" in too_many.camera_slots(slots)[1][0]
    assert lerobot_policy(tmp_path / "d") is None       # not a LeRobot directory


@pytest.mark.parametrize("embed_first", [True, False])
def test_two_embeddings_in_two_shards(tmp_path, caplog, embed_first):
    """LeRobot 0.6.1 fine-tunes embed_tokens and lm_head apart. Split into two shards in module order, the
    head used to replace the embedding silently; now the embedding is embed_tokens in either order and the
    head serves the text logits, with a log line."""
    model = random_model()
    tensors = {"model." + k: v for k, v in openpi_tensors(model).items()}
    head = tensors["model." + LM_HEAD]
    embed = head + 0.5 * torch.randn(head.shape, generator=torch.Generator().manual_seed(3))
    tensors["model." + EMBED] = embed
    first = ["model." + (EMBED if embed_first else LM_HEAD)]
    rest = [k for k in tensors if k not in first]
    weight_map = {}
    for shard, keys in (("model-00001-of-00002.safetensors", first), ("model-00002-of-00002.safetensors", rest)):
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard), metadata={"format": "pt"})
        weight_map |= {k: shard for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with caplog.at_level(logging.WARNING):
        loaded = load_pi05(tmp_path, CFG)
    assert torch.equal(loaded.embed_tokens.weight, embed)
    assert torch.equal(loaded.lm_head, head)
    assert any("lm_head and embed_tokens differ" in r.message for r in caplog.records)
    h = torch.randn(2, CFG.vlm.width, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(loaded.logits(h), F.linear(h, head), rtol=0, atol=0)
    # The prompt is embedded with embed_tokens.
    tokens = torch.tensor([1, 5, 7])
    torch.testing.assert_close(loaded.embed_text(tokens), embed[tokens] * CFG.vlm.width ** 0.5, rtol=0, atol=0)


def test_equal_embeddings_stay_tied(tmp_path, caplog):
    model = random_model()
    tensors = {"model." + k: v for k, v in openpi_tensors(model).items()}
    tensors["model." + EMBED] = tensors["model." + LM_HEAD].clone()
    tmp_path.mkdir(exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.WARNING):
        loaded = load_pi05(tmp_path, CFG)
    assert loaded.lm_head is None and not caplog.records


def test_bringup_follows_a_lerobot_directory(tmp_path):
    """oxygen_bringup --robot libero on a LeRobot directory (tiny weights, processor stats, config.json):
    starts, maps the cameras, and puts the state in the prompt as LeRobot trained it (libero's config says
    no), saying so."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    from oxygen_ros.engine.factory import build_model, model_config
    from oxygen_ros.model.checkpoint import save_checkpoint

    ckpt = tmp_path / "pi05_libero_lerobot"
    save_checkpoint(build_model(model_config("tiny")), ckpt, "lerobot")
    visual = {"type": "VISUAL", "shape": [3, 224, 224]}
    (ckpt / "config.json").write_text(json.dumps({
        "type": "pi05", "chunk_size": 10, "input_features": {
            "observation.images.image": visual, "observation.images.wrist_image": visual,
            "observation.state": {"type": "STATE", "shape": [8]}}}))
    flat = {f"observation.state.{k}": np.full(8, v, np.float32) for k, v in
            (("mean", 0.0), ("std", 1.0), ("q01", -1.0), ("q99", 1.0))}
    flat |= {f"action.{k}": np.full(7, v, np.float32)
             for k, v in (("mean", 0.0), ("std", 1.0), ("q01", -2.0), ("q99", 2.0))}
    save_numpy(flat, str(ckpt / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    params = tmp_path / "p.yaml"
    params.write_text(f"oxygen_engine:\n  ros__parameters:\n    model: tiny\n    checkpoint: {ckpt}\n"
                      f"    tokenizer: ''\n    norm_stats: {ckpt}\n    kv_budget_mb: 32.0\n")
    env = dict(os.environ, ROS_DOMAIN_ID="0", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "oxygen_ros.bringup", "--robot", "libero", "--params-file", str(params),
                        "--duration", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "LeRobot cameras -> slots: observation.images.image -> base_0_rgb, " \
           "observation.images.wrist_image -> left_wrist_0_rgb" in out
    assert "state in the prompt: True, as the LeRobot checkpoint was trained (the robot config said False)" in out
