"""Reference arrays for LeRobot checkpoints: what LeRobot 0.6.1's own pi05 processors compute.

Runs against LeRobot itself (not a dependency of this package; it needs Python 3.12):

    python3.12 -m venv /work/side/lerobot061 && /work/side/lerobot061/bin/pip install 'lerobot[pi]==0.6.1'
    /work/side/lerobot061/bin/python scripts/lerobot_reference.py --out test/data/lerobot_ref

For each case (a normalization_mapping, relative actions or not, camera sizes) it builds a pi05 config
with random dataset statistics, LeRobot's pre/post-processors for it (make_pi05_pre_post_processors),
saves both with LeRobot's own save_pretrained (config.json, policy_{pre,post}processor.json and the
(un)normaliser safetensors: a LeRobot policy directory without model weights, which the package's
robot side does not read), loads them back the way LeRobot serves a checkpoint (make_pre_post_processors
with pretrained_path), and runs LeRobot's inference path on random inputs:
  observation (uint8 HWC images, state) -> prepare_observation_for_inference -> preprocessor
      -> normalised state, the prompt's discretised state;
  PI05Policy._preprocess_images on the preprocessed batch -> the model's images (LeRobot's resize);
  model-space actions [H, 32] -> trimmed to the action feature (as predict_action_chunk does)
      -> postprocessor -> robot actions (un-normalised, relative -> absolute).
Written beside the directory files: reference.npz with the inputs (state float64 robot units, LeRobot
gets them as float32 like its dataset frames; image_<feature> uint8 [h, w, 3] at camera size;
model_actions float32 [H, 32]) and LeRobot's outputs (state_normalized float32, state_tokens int64,
pixels_<feature> float32 [S, S, 3] in [-1, 1], robot_actions float32 [H, action_dim]).

The model weights are never built: only the image preprocessing method of PI05Policy runs (on a stand-in
`self` holding the config). The PaliGemma tokenizer is replaced by a small offline one: only the prompt's
text (which holds the discretised state) is compared, never token ids.
"""
from __future__ import annotations

import argparse
import json
import shutil
import types
from pathlib import Path

import numpy as np
import torch

MODEL_SIZE = 64          # the image_resolution of every case (the package's tiny preset): small files
CHUNK = 6
STATE_DIM, ACTION_DIM = 8, 7
CONSTANT_DIM = 2         # a joint that never moved in the data set: q01 = q99 = min = max, std = 0
ACTION_NAMES = ["x", "y", "z", "roll", "pitch", "yaw", "gripper"]
TASK = "pick up the red cube"

# name -> (normalization_mapping, use_relative_actions, {camera feature: (height, width)})
CASES = {
    "quantiles": ({"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}, False,
                  {"observation.images.base": (48, 80), "observation.images.wrist": (MODEL_SIZE, MODEL_SIZE)}),
    "mean_std": ({"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}, False,
                 {"observation.images.base": (120, 90)}),
    "min_max": ({"VISUAL": "IDENTITY", "STATE": "MIN_MAX", "ACTION": "MIN_MAX"}, False,
                {"observation.images.base": (37, 101)}),
    "quantile10": ({"VISUAL": "IDENTITY", "STATE": "QUANTILE10", "ACTION": "QUANTILE10"}, False,
                   {"observation.images.base": (96, 128)}),
    "identity": ({"VISUAL": "IDENTITY", "STATE": "IDENTITY", "ACTION": "IDENTITY"}, False,
                 {"observation.images.base": (32, 40)}),
    # Mixed modes, mean/std-normalised images, and relative actions (the gripper stays absolute).
    "mixed_relative": ({"VISUAL": "MEAN_STD", "STATE": "MIN_MAX", "ACTION": "QUANTILES"}, True,
                       {"observation.images.base": (50, 70), "observation.images.wrist": (MODEL_SIZE, MODEL_SIZE)}),
}


def dataset_stats(rng: np.random.Generator, dim: int) -> dict[str, np.ndarray]:
    """Statistics as LeRobot's compute_stats gives them (float64 here; LeRobot stores float32)."""
    x = rng.normal(rng.uniform(-2, 2, dim), rng.uniform(0.2, 3.0, dim), size=(500, dim))
    x[:, CONSTANT_DIM] = 0.1 + 0.2         # 0.30000000000000004: not a float32 number
    q = {f"q{p:02d}": np.quantile(x, p / 100, axis=0) for p in (1, 10, 90, 99)}
    return {"mean": x.mean(0), "std": x.std(0), "min": x.min(0), "max": x.max(0), **q}


def image_stats(rng: np.random.Generator) -> dict[str, np.ndarray]:
    mean, std = rng.uniform(0.3, 0.6, (3, 1, 1)), rng.uniform(0.15, 0.3, (3, 1, 1))
    return {"mean": mean, "std": std, "min": np.zeros((3, 1, 1)), "max": np.ones((3, 1, 1)),
            "q01": mean - 2 * std, "q10": mean - std, "q90": mean + std, "q99": mean + 2 * std}


class _OfflineTokenizer:
    """Stands in for AutoTokenizer: the PaliGemma tokenizer cannot be downloaded here, and only the
    prompt's text is compared."""

    @staticmethod
    def from_pretrained(name, *args, **kwargs):
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def make_case(name: str, out: Path, seed: int) -> None:
    import lerobot
    from lerobot.configs import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors
    from lerobot.policies.utils import prepare_observation_for_inference

    mapping, relative, cameras = CASES[name]
    rng = np.random.default_rng(seed)
    inputs = {name: PolicyFeature(FeatureType.VISUAL, (3, MODEL_SIZE, MODEL_SIZE)) for name in cameras}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE_DIM,))
    config = PI05Config(
        input_features=inputs, output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))},
        normalization_mapping={k: NormalizationMode(v) for k, v in mapping.items()},
        image_resolution=(MODEL_SIZE, MODEL_SIZE), chunk_size=CHUNK, n_action_steps=CHUNK, device="cpu",
        use_relative_actions=relative, action_feature_names=ACTION_NAMES if relative else None)
    stats = {"observation.state": dataset_stats(rng, STATE_DIM), "action": dataset_stats(rng, ACTION_DIM)}
    stats |= {camera: image_stats(rng) for camera in cameras}

    case = out / name
    shutil.rmtree(case, ignore_errors=True)
    case.mkdir(parents=True)
    pre, post = make_pi05_pre_post_processors(config, dataset_stats=stats)
    config._save_pretrained(case)
    pre.save_pretrained(case)
    post.save_pretrained(case)

    # Served as LeRobot serves a checkpoint directory.
    config = PreTrainedConfig.from_pretrained(case)
    pre, post = make_pre_post_processors(config, pretrained_path=str(case))

    state = stats["observation.state"]["mean"] + rng.normal(0, 2.0, STATE_DIM)   # some outside the range
    state[CONSTANT_DIM] = 0.1 + 0.2
    images = {camera: rng.integers(0, 256, (*size, 3), dtype=np.uint8) for camera, size in cameras.items()}
    model_actions = rng.uniform(-1.3, 1.3, (CHUNK, 32)).astype(np.float32)

    # LeRobot's robot path builds float32 frames (build_dataset_frame), then this.
    observation = {"observation.state": state.astype(np.float32)} | {k: v.copy() for k, v in images.items()}
    batch = pre(prepare_observation_for_inference(observation, torch.device("cpu"), TASK))
    state_normalized = batch["observation.state"][0].numpy()
    prompt = batch["task"][0]
    state_tokens = np.array(prompt.split("State: ")[1].split(";")[0].split(), dtype=np.int64)
    stand_in = types.SimpleNamespace(config=config, parameters=lambda: iter([torch.zeros(1)]))
    pixels, _ = PI05Policy._preprocess_images(stand_in, batch)
    actions = torch.from_numpy(model_actions)[None, :, :config.output_features["action"].shape[0]]
    robot_actions = post(actions)[0].numpy()

    arrays = {"lerobot_version": np.array(lerobot.__version__), "task": np.array(TASK), "state": state,
              "model_actions": model_actions, "state_normalized": state_normalized, "state_tokens": state_tokens,
              "robot_actions": robot_actions}
    for camera, px in zip(config.image_features, pixels, strict=True):
        arrays[f"image_{camera}"] = images[camera]
        arrays[f"pixels_{camera}"] = px[0].permute(1, 2, 0).numpy()
    np.savez_compressed(case / "reference.npz", **arrays)
    print(f"{name}: {json.dumps(mapping)}, relative={relative}, cameras={cameras}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="test/data/lerobot_ref", help="output folder (one sub-folder per case)")
    args = parser.parse_args(argv)
    import lerobot
    import lerobot.processor.tokenizer_processor as tokenizer_processor

    if lerobot.__version__ != "0.6.1":
        raise SystemExit(f"the reference is LeRobot 0.6.1, this is {lerobot.__version__}")
    tokenizer_processor.AutoTokenizer = _OfflineTokenizer
    torch.set_num_threads(1)
    out = Path(args.out)
    for i, name in enumerate(CASES):
        make_case(name, out, seed=100 + i)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
