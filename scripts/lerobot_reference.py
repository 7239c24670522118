"""Reference arrays for LeRobot checkpoints: what LeRobot 0.6.1's own pi05 processors compute.

Runs against LeRobot itself (not a dependency of this package; it needs Python 3.12):

    python3.12 -m venv ../lerobot061 && ../lerobot061/bin/pip install 'lerobot[pi]==0.6.1'
    ../lerobot061/bin/python scripts/lerobot_reference.py --out test/data/lerobot_ref

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

The processor cases never build model weights: only the image preprocessing method of PI05Policy runs (on
a stand-in `self` holding the config). Their PaliGemma tokenizer is replaced by a small offline one: only
the prompt's text (which holds the discretised state) is compared, never token ids.

--model-out (default test/data/lerobot_model): LeRobot's whole pi05 policy end to end, on a small
random-weight checkpoint that LeRobot itself writes (PI05Policy.save_pretrained and its processors) and
loads back (PI05Policy.from_pretrained, make_pre_post_processors): raw observation -> preprocessor ->
predict_action_chunk with fixed noise -> postprocessor. LeRobot builds only its two Gemma sizes
(gemma_300m/gemma_2b, with SigLIP-so400m and a 257152-token vocabulary: 3.3 B parameters, 13 GB in float32),
so the script shrinks the sizes LeRobot reads (get_gemma_config, and the SigLIP/vocabulary fields of the
PaliGemma config it builds) to MODEL_SIZES; every computation stays LeRobot's code. The PaliGemma tokenizer
is the package's shipped small SentencePiece model (PaliGemma's special ids; BOS + text, padded right as
the PaliGemma tokenizer does), so both sides see the same token ids. Written: LeRobot's directory
(config.json, model.safetensors, processors) and reference.npz: the inputs (state float64, image uint8
[h, w, 3], task, noise float32 [H, 32]), LeRobot's token ids and mask, its model-space actions [H, action_dim]
and its robot actions [H, action_dim] (post-processed).
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


# ---------------------------------------------------------------------------------- the whole policy
# Sizes of the small model (LeRobot's own code, these widths): the package's Pi05Config for it is in
# test/test_lerobot_end_to_end.py. About 0.2 M parameters: the checkpoint stays under 1 MB.
MODEL_SIZES = {
    "vlm": dict(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=16),
    "expert": dict(width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=1, head_dim=16),
    "vision": dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2, patch_size=14),
    "vocab_size": 1000,           # the shipped tokenizer's
}
MODEL_IMAGE = 56                  # 4x4 patches
MODEL_CHUNK = 10
MODEL_TOKENS = 48                 # tokenizer_max_length
MODEL_STATE, MODEL_ACTION = 6, 6


def shrink_lerobot_pi05() -> None:
    """Make LeRobot's pi05 build MODEL_SIZES instead of gemma_2b/gemma_300m + SigLIP-so400m."""
    from lerobot.policies.pi05 import modeling_pi05 as m

    def gemma_config(variant: str):
        return m.GemmaConfig(**MODEL_SIZES["vlm" if variant == "gemma_2b" else "expert"])

    paligemma = m.PaliGemmaForConditionalGenerationWithPiGemma

    def small_paligemma(config):
        for k, v in MODEL_SIZES["vision"].items():
            setattr(config.vision_config, k, v)
        config.vision_config.projection_dim = MODEL_SIZES["vlm"]["width"]
        config.text_config.vocab_size = MODEL_SIZES["vocab_size"]
        config._vocab_size = MODEL_SIZES["vocab_size"]
        return paligemma(config=config)

    expert = m.PiGemmaForCausalLM

    def small_expert(config):
        config.vocab_size = MODEL_SIZES["vocab_size"]    # its text head, which pi05 never uses
        return expert(config=config)

    m.get_gemma_config = gemma_config
    m.PaliGemmaForConditionalGenerationWithPiGemma = small_paligemma
    m.PiGemmaForCausalLM = small_expert


class _SentencePieceTokenizer:
    """The PaliGemma tokenizer's call as LeRobot's TokenizerProcessorStep makes it, on a SentencePiece
    model: BOS + the text's pieces, truncated and padded (id 0) on the right to max_length."""

    path: Path | None = None

    def __init__(self):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))

    @classmethod
    def from_pretrained(cls, name, *args, **kwargs):
        return cls()

    def __call__(self, text, max_length, truncation, padding, padding_side, return_tensors):
        assert padding == "max_length" and padding_side == "right" and return_tensors == "pt"
        texts = [text] if isinstance(text, str) else list(text)
        ids = torch.zeros(len(texts), max_length, dtype=torch.long)
        mask = torch.zeros(len(texts), max_length, dtype=torch.long)
        for i, t in enumerate(texts):
            row = ([self.sp.bos_id()] + self.sp.encode(t))[:max_length if truncation else None]
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def random_weights(policy, seed: int) -> None:
    """Deterministic weights with every parameter random (LeRobot's init leaves norms at 0 or 1 and biases
    at 0): linear weights ~ N(0, 1/fan_in), SigLIP's LayerNorm scales 1 + N(0, 0.1), other vectors N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(policy.named_parameters()):
        if p.ndim >= 2:
            value = torch.randn(p.shape, generator=g) * (p[0].numel() ** -0.5)
        elif "vision_tower" in name and ("layer_norm" in name or "layernorm" in name) and name.endswith("weight"):
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            value = 0.1 * torch.randn(p.shape, generator=g)
        p.copy_(value.to(p.dtype))


def make_model_case(out: Path, tokenizer: Path, seed: int) -> None:
    import lerobot
    import lerobot.processor.tokenizer_processor as tokenizer_processor
    from lerobot.configs import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors
    from lerobot.policies.utils import prepare_observation_for_inference

    shrink_lerobot_pi05()
    _SentencePieceTokenizer.path = tokenizer
    tokenizer_processor.AutoTokenizer = _SentencePieceTokenizer
    rng = np.random.default_rng(seed)
    camera = "observation.images.base"
    config = PI05Config(
        input_features={camera: PolicyFeature(FeatureType.VISUAL, (3, MODEL_IMAGE, MODEL_IMAGE)),
                        "observation.state": PolicyFeature(FeatureType.STATE, (MODEL_STATE,))},
        output_features={"action": PolicyFeature(FeatureType.ACTION, (MODEL_ACTION,))},
        normalization_mapping={"VISUAL": NormalizationMode.IDENTITY, "STATE": NormalizationMode.QUANTILES,
                               "ACTION": NormalizationMode.QUANTILES},
        image_resolution=(MODEL_IMAGE, MODEL_IMAGE), chunk_size=MODEL_CHUNK, n_action_steps=MODEL_CHUNK,
        tokenizer_max_length=MODEL_TOKENS, device="cpu", dtype="float32")
    state_stats = dataset_stats(rng, MODEL_STATE)
    # Robot actions of magnitude ~4-20 (q01 ~ 4, q99 ~ 20: the scale where the two time grids' difference
    # was measured); the model's actions (noise minus the integrated velocity) reach beyond [-1, 1].
    action_stats = dataset_stats(rng, MODEL_ACTION)
    action_stats |= {"q01": 4.0 + rng.uniform(0, 1, MODEL_ACTION), "q99": 20.0 - rng.uniform(0, 1, MODEL_ACTION)}
    stats = {"observation.state": state_stats, "action": action_stats, camera: image_stats(rng)}

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    torch.manual_seed(seed)
    policy = PI05Policy(config)
    random_weights(policy, seed)
    policy.save_pretrained(out)
    pre, post = make_pi05_pre_post_processors(config, dataset_stats=stats)
    pre.save_pretrained(out)
    post.save_pretrained(out)

    # Served as LeRobot serves a checkpoint directory.
    config = PreTrainedConfig.from_pretrained(out)
    policy = PI05Policy.from_pretrained(out, config=config).eval()
    pre, post = make_pre_post_processors(config, pretrained_path=str(out))

    state = state_stats["q01"] + rng.uniform(0, 1, MODEL_STATE) * (state_stats["q99"] - state_stats["q01"])
    image = rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)
    noise = rng.standard_normal((MODEL_CHUNK, config.max_action_dim)).astype(np.float32)
    observation = {"observation.state": state.astype(np.float32), camera: image.copy()}
    batch = pre(prepare_observation_for_inference(observation, torch.device("cpu"), TASK))
    model_actions = policy.predict_action_chunk(batch, noise=torch.from_numpy(noise)[None].clone())
    robot_actions = post(model_actions)[0].numpy()
    arrays = {"lerobot_version": np.array(lerobot.__version__), "task": np.array(TASK), "state": state,
              "image": image, "noise": noise, "tokens": batch["observation.language.tokens"][0].numpy(),
              "token_mask": batch["observation.language.attention_mask"][0].numpy().astype(bool),
              "model_actions": model_actions[0].numpy(), "robot_actions": robot_actions,
              "num_inference_steps": np.array(config.num_inference_steps)}
    np.savez_compressed(out / "reference.npz", **arrays)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"model: {sum(p.numel() for p in policy.parameters())} parameters, {size} bytes in {out}; model actions "
          f"in [{model_actions.min():.2f}, {model_actions.max():.2f}], robot actions in [{robot_actions.min():.2f}, "
          f"{robot_actions.max():.2f}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="test/data/lerobot_ref", help="output folder (one sub-folder per case)")
    parser.add_argument("--model-out", default="test/data/lerobot_model",
                        help="output folder of the whole-policy case (LeRobot's checkpoint and reference.npz)")
    parser.add_argument("--tokenizer", default="oxygen_ros/model/assets/tiny_tokenizer.model",
                        help="SentencePiece model standing in for PaliGemma's tokenizer in the whole-policy case")
    parser.add_argument("--only", choices=("processors", "model"), help="make one kind of case only")
    args = parser.parse_args(argv)
    import lerobot
    import lerobot.processor.tokenizer_processor as tokenizer_processor

    if lerobot.__version__ != "0.6.1":
        raise SystemExit(f"the reference is LeRobot 0.6.1, this is {lerobot.__version__}")
    torch.set_num_threads(1)
    if args.only != "model":
        tokenizer_processor.AutoTokenizer = _OfflineTokenizer
        out = Path(args.out)
        for i, name in enumerate(CASES):
            make_case(name, out, seed=100 + i)
    if args.only != "processors":
        make_model_case(Path(args.model_out), Path(args.tokenizer), seed=200)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
