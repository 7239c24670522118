"""LeRobot pi05 directories: processor norm stats and their modes (refused when unknown or without their
statistics), which statistics and pipeline serve them, relative actions, camera order, state in the prompt,
and the embedding that LeRobot 0.6.1 fine-tunes apart from the text head (split across shards). Agreement
with LeRobot's own numbers: test_lerobot_reference.py."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file
from test_checkpoint import CFG, EMBED, LM_HEAD, openpi_tensors, random_model

from oxygen_ros.model.checkpoint import lerobot_policy, load_pi05
from oxygen_ros.model.normalize import LeRobotNormalizer, Normalizer, load_normalizer
from oxygen_ros.model.preprocess import lerobot_pixels, to_pixels
from oxygen_ros.robot.errors import ConfigError, InputError
from oxygen_ros.robot.policy_io import RobotIOConfig, build_policy_io
from ros_harness import private_domain  # a domain of this test process: no other bringup on it

REF = Path(__file__).parent / "data" / "lerobot_ref"     # LeRobot 0.6.1's own directories (test_lerobot_reference)

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


def test_processor_stats_without_configs_follow_config_json(tmp_path):
    """A directory with the statistics but no processor configs: the modes are config.json's
    normalization_mapping (pi05's default, QUANTILES, when absent), computed by LeRobot's rule in float32."""
    default = load_normalizer(_lerobot_stats(tmp_path / "default"))
    assert isinstance(default, LeRobotNormalizer) and default.modes == {"STATE": "QUANTILES", "ACTION": "QUANTILES",
                                                                        "VISUAL": "IDENTITY"}
    q01, q99 = np.float32(STATE["q01"]), np.float32(STATE["q99"])
    x = np.array([0.3, -1.0, 0.45])
    expected = np.float32(2.0) * (x.astype(np.float32) - q01) / (q99 - q01) - np.float32(1.0)
    np.testing.assert_array_equal(default.normalize_state(x), expected)
    assert default.normalize_state(x).dtype == np.float32

    mean_std = _lerobot_stats(tmp_path / "mean_std")
    (mean_std / "config.json").write_text(json.dumps({"type": "pi05", "normalization_mapping": {
        "VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MIN_MAX"}}))
    with pytest.raises(ValueError, match=r"feature 'action' \(ACTION\) is normalised with MIN_MAX, but "
                                         r"policy_preprocessor_step_3_normalizer_processor.safetensors has no "
                                         r"min or max for it"):
        load_normalizer(mean_std)
    flat = load_numpy(str(mean_std / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    flat |= {"action.min": np.float32([-1, -2, -3, -4]), "action.max": np.float32([1, 2, 3, -4])}
    save_numpy(flat, str(mean_std / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    norm = load_normalizer(mean_std)
    mean, std = np.float32(STATE["mean"]), np.float32(STATE["std"])
    np.testing.assert_array_equal(norm.normalize_state(x), (x.astype(np.float32) - mean) / (std + np.float32(1e-8)))
    # MIN_MAX's inverse; a constant dimension (min = max) has the span eps.
    a = np.array([[-1.0, 0.0, 1.0, 0.5]], np.float32)
    np.testing.assert_allclose(norm.unnormalize_actions(a), [[-1.0, 0.0, 3.0, -4.0 + 0.75e-8]], rtol=0, atol=1e-7)


def test_mean_std_divides_by_std_plus_lerobots_epsilon(tmp_path):
    """LeRobot's MEAN_STD is (x - mean) / (std + 1e-8) (NormalizerProcessorStep, eps 1e-8): the epsilon
    matters for a constant dimension (std 0) and a tiny std, where the values are checked against numbers
    worked out by hand from that formula (float32: rtol 1e-6)."""
    flat = {"observation.state.mean": np.float32([0.25, 0.0, 1.0]), "observation.state.std": np.float32([0.0, 3e-8, 2.0]),
            "action.mean": np.zeros(4, np.float32), "action.std": np.ones(4, np.float32)}
    tmp_path.mkdir(exist_ok=True)
    save_numpy(flat, str(tmp_path / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"type": "pi05", "normalization_mapping": {
        "VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}}))
    state = load_normalizer(tmp_path).normalize_state(np.array([0.5, 0.1, 2.0]))
    # 0.25 / 1e-8, 0.1 / 4e-8, 1 / 2.00000001
    np.testing.assert_allclose(state, [2.5e7, 2.5e6, 0.5], rtol=1e-6, atol=0)


def test_processor_stats_without_state_or_actions_are_refused(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    save_numpy({"observation.images.x.mean": np.zeros(3, np.float32)},
               str(tmp_path / "policy_preprocessor_step_1_normalizer_processor.safetensors"))
    with pytest.raises(ValueError, match=r"feature 'action' \(ACTION\) is normalised with QUANTILES, but .* "
                                         r"has no q01 or q99"):
        load_normalizer(tmp_path)
    with pytest.raises(ValueError, match="a LeRobot policy directory, not openpi statistics"):
        Normalizer.load(tmp_path)


def _reference_copy(tmp_path, name):
    return Path(shutil.copytree(REF / name, tmp_path / name))


def _edit_json(file, edit):
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def _normalizer_step(data, name="normalizer_processor"):
    return next(s for s in data["steps"] if s["registry_name"] == name)["config"]


def test_an_unknown_mode_is_refused_at_load_in_one_line(tmp_path):
    case = _reference_copy(tmp_path, "quantiles")
    _edit_json(case / "policy_preprocessor.json",
               lambda d: _normalizer_step(d)["norm_map"].__setitem__("STATE", "LOG_STD"))
    with pytest.raises(ValueError) as err:
        load_normalizer(case)
    message = str(err.value)
    assert "feature observation.state (STATE) has normalisation mode 'LOG_STD'" in message and "\n" not in message
    # Through the engine's builder too: the start is refused, not served with another rule.
    with pytest.raises(ValueError, match="LOG_STD"):
        build_policy_io(RobotIOConfig(), checkpoint=case, image_size=64)


@pytest.mark.parametrize("mode, stat", [("MEAN_STD", "std"), ("QUANTILE10", "q90"), ("MIN_MAX", "min")])
def test_missing_statistics_for_a_mode_are_refused_at_load_in_one_line(tmp_path, mode, stat):
    case = _reference_copy(tmp_path, "quantiles")
    _edit_json(case / "policy_postprocessor.json",
               lambda d: _normalizer_step(d, "unnormalizer_processor")["norm_map"].__setitem__("ACTION", mode))
    stats_file = case / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
    save_numpy({k: v for k, v in load_numpy(str(stats_file)).items() if k != f"action.{stat}"}, str(stats_file))
    with pytest.raises(ValueError) as err:
        load_normalizer(case)
    message = str(err.value)
    assert f"feature 'action' (ACTION) is normalised with {mode}, but {stats_file.name} has no" in message
    assert stat in message.rsplit("has no", 1)[1] and "\n" not in message


def test_a_config_json_that_differs_from_the_processors_is_said(tmp_path, caplog):
    """LeRobot serves a directory with its processor files; a hand-edited config.json does not change that."""
    case = _reference_copy(tmp_path, "mean_std")
    _edit_json(case / "config.json", lambda d: d["normalization_mapping"].__setitem__("STATE", "QUANTILES"))
    with caplog.at_level(logging.WARNING):
        norm = load_normalizer(case)
    assert norm.state.mode == "MEAN_STD"
    assert any("STATE: processors MEAN_STD, config.json QUANTILES" in r.message for r in caplog.records)


def test_the_norm_stats_parameter_overrides_the_folders_own(tmp_path):
    """norm_stats given: those statistics with their own rule (openpi's for a norm_stats.json); the pipeline
    (resize, relative actions) still follows the checkpoint."""
    case = REF / "mixed_relative"
    with pytest.raises(ConfigError, match="2 cameras .* the model 0 slots"):     # VISUAL MEAN_STD needs slots
        build_policy_io(RobotIOConfig(), checkpoint=case, image_size=64)
    own = build_policy_io(RobotIOConfig(), checkpoint=case, image_size=64, camera_slots=("a", "b"))
    assert "norm stats: the LeRobot folder's own (norm_stats is empty): LeRobot processors in" in own.description
    assert "STATE MIN_MAX, ACTION QUANTILES, VISUAL MEAN_STD" in own.description
    assert "relative actions on dims [0, 1, 2, 3, 4, 5]" in own.description
    openpi_file = tmp_path / "norm_stats.json"
    as_list = lambda d: {k: [float(x) for x in v] for k, v in d.items()}  # noqa: E731
    openpi_file.write_text(json.dumps({"norm_stats": {"state": as_list(STATE), "actions": as_list(ACTIONS)}}))
    other = build_policy_io(RobotIOConfig(), checkpoint=case, norm_stats=openpi_file, image_size=64,
                            camera_slots=("a", "b"))
    assert isinstance(other.normalizer, Normalizer) and other.lerobot is not None
    assert f"norm stats from the norm_stats parameter: {openpi_file} (openpi rule, quantiles)" in other.description
    x = np.array([0.3, -1.0, 0.45])
    np.testing.assert_allclose(other.model_inputs({}, x).state_normalized,
                               (x - STATE["q01"]) / (np.subtract(STATE["q99"], STATE["q01"]) + 1e-6) * 2 - 1)
    # No checkpoint, no norm_stats: identity, openpi's pipeline.
    none = build_policy_io(RobotIOConfig())
    assert none.lerobot is None and "norm stats: none" in none.description


def test_openpi_checkpoints_keep_openpis_resize():
    """The same camera image: openpi's antialiased resize for an openpi (or no) checkpoint, LeRobot's for a
    LeRobot one; they differ visibly when shrinking."""
    img = np.random.default_rng(0).integers(0, 256, (120, 90, 3), dtype=np.uint8)
    openpi = build_policy_io(RobotIOConfig(), image_size=64).image("base_0_rgb", img)
    lerobot = build_policy_io(RobotIOConfig(), checkpoint=REF / "identity", image_size=64).image("base_0_rgb", img)
    assert torch.equal(openpi, to_pixels(img, 64))
    assert torch.equal(lerobot, lerobot_pixels(img, 64, 64))
    assert (openpi - lerobot).abs().max() > 0.3


def test_relative_actions_from_config_json(tmp_path):
    """Without processor configs, relative actions are read as LeRobot builds them from config.json: every
    action dimension without action names; the robot config's delta_action_mask is not used, and said."""
    folder = _lerobot_stats(tmp_path / "rel")
    (folder / "config.json").write_text(json.dumps({
        "type": "pi05", "use_relative_actions": True, "normalization_mapping": {"STATE": "IDENTITY", "ACTION": "IDENTITY"},
        "input_features": {"observation.state": {"type": "STATE", "shape": [4]}},
        "output_features": {"action": {"type": "ACTION", "shape": [4]}}}))
    policy = lerobot_policy(folder)
    assert policy.relative_mask == (True,) * 4 and policy.action_dim == 4
    _edit_json(folder / "config.json", lambda d: d.update(action_feature_names=["a", "Gripper_L", "b", "c"]))
    assert lerobot_policy(folder).relative_mask == (True, False, True, True)   # "gripper" excluded by default
    io = build_policy_io(RobotIOConfig(delta_action_mask=(True,)), checkpoint=folder)
    assert "relative actions on dims [0, 2, 3]" in io.description
    assert "the robot config's delta_action_mask [True] is not used" in io.description
    chunk = np.zeros((2, 32), np.float32)
    np.testing.assert_array_equal(io.robot_actions(chunk, np.array([1.0, 2.0, 3.0, 4.0])), [[1.0, 0.0, 3.0, 4.0]] * 2)
    with pytest.raises(InputError, match="delta actions need"):
        io.robot_actions(chunk)
    # A LeRobot folder without any processor statistics is refused unless norm_stats names others.
    bare = _config(tmp_path / "bare", {})
    with pytest.raises(ValueError, match="no LeRobot normaliser or unnormaliser found"):
        build_policy_io(RobotIOConfig(), checkpoint=bare)


def test_settings_that_contradict_the_lerobot_checkpoint_are_refused():
    with pytest.raises(ConfigError) as err:
        build_policy_io(RobotIOConfig(robot_action_dim=9), checkpoint=REF / "quantiles", image_size=224)
    assert "robot_action_dim 9 exceeds the LeRobot checkpoint's 7 action dims" in str(err.value)
    assert "image_resolution [64, 64] is not the model's 224 px" in str(err.value)


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
    starts, maps the cameras, puts the state in the prompt as LeRobot trained it (libero's config says
    no), and serves it with LeRobot's pipeline and the folder's own statistics (norm_stats empty), saying so."""
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
                      f"    tokenizer: ''\n    norm_stats: ''\n    kv_budget_mb: 32.0\n")
    env = dict(os.environ, ROS_DOMAIN_ID=str(private_domain(95)), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "oxygen_ros.bringup", "--robot", "libero", "--params-file", str(params),
                        "--duration", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "LeRobot cameras -> slots: observation.images.image -> base_0_rgb, " \
           "observation.images.wrist_image -> left_wrist_0_rgb" in out
    assert "state in the prompt: True, as the LeRobot checkpoint was trained (the robot config said False)" in out
    assert "policy I/O: LeRobot pipeline (checkpoint " in out and "LeRobot's resize-with-pad" in out
    assert f"norm stats: the LeRobot folder's own (norm_stats is empty): LeRobot processors in {ckpt}" in out
