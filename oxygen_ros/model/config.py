"""Sizes and constants of a π0.5 model: presets, and configs read from files.

Three sources of a config, one dataclass:
- presets: `pi05` (the paper's sizes), `bench` (a ~210 M-parameter model for CPU benchmarks), `tiny`
  (a few million parameters: the tests) and `demo` (the model trained for the MuJoCo demo,
  oxygen_ros/training/);
- an oracle case's config.json (../shared/oracle/*/config.json), see `from_oracle_json`;
- a YAML/JSON file with the same field names as `Pi05Config` (nested `vlm`, `expert`, `vision`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

from .files import MAX_JSON_BYTES, read_bytes

CAMERA_SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
PREFIX_MODES = ("bidirectional", "causal")


@dataclass(frozen=True)
class Limit:
    minimum: int
    maximum: int

    def __str__(self) -> str:
        return f"[{self.minimum}, {self.maximum}]"


# The bounds of the model settings that a parameter, a model config file or a checkpoint's config.json may
# set: the one place they are declared (the engine node's parameters and a checkpoint's config.json are
# checked against these). Beyond them the engine does not run in any useful time or memory: 10^8 denoise
# steps never produce a chunk.
SIZE = Limit(1, 1 << 31)        # any other size of the model (widths, depths, heads, vocabulary)
LIMITS = {"action_dim": Limit(1, 1024), "action_horizon": Limit(1, 1000), "max_token_len": Limit(1, 8192),
          "num_denoise_steps": Limit(1, 1000)}


@dataclass(frozen=True)
class GemmaConfig:
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10_000.0


@dataclass(frozen=True)
class VisionConfig:
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    patch_size: int = 14
    image_size: int = 224
    layer_norm_eps: float = 1e-6

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class Pi05Config:
    vlm: GemmaConfig
    expert: GemmaConfig
    vision: VisionConfig
    vocab_size: int
    action_dim: int = 32
    action_horizon: int = 10
    max_token_len: int = 200
    num_denoise_steps: int = 10
    # Upstream openpi (what the official checkpoints were trained with) lets the whole valid prefix attend
    # bidirectionally; the OxyGen code makes language tokens causal. Same weights, different actions.
    prefix_language_attention: str = "bidirectional"
    time_min_period: float = 4e-3
    time_max_period: float = 4.0
    camera_slots: tuple[str, ...] = CAMERA_SLOTS
    # Trained with prefix conditioning (training-time RTC, Black et al. 2025): the expert takes some leading
    # action rows as given (clean, flow time 0) and continues them. Recorded in the checkpoint's config.json.
    prefix_conditioning: bool = False

    def __post_init__(self):
        # The sizes' values first: the structural checks below divide by them.
        sizes = (_value_problems(self.vlm, "vlm.") + _value_problems(self.expert, "expert.")
                 + _value_problems(self.vision, "vision."))
        problems = sizes + _value_problems(self)
        if not isinstance(self.prefix_conditioning, bool):
            problems.append(f"prefix_conditioning must be true or false, got {self.prefix_conditioning!r}")
        if self.prefix_language_attention not in PREFIX_MODES:
            problems.append(f"prefix_language_attention must be one of {PREFIX_MODES}, "
                            f"got {self.prefix_language_attention!r}")
        if not sizes:
            problems += self._structure_problems()
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))

    def _structure_problems(self) -> list[str]:
        problems = []
        # The expert's queries attend to the VLM's cached K/V at every layer (mixture of transformers).
        for name in ("depth", "num_kv_heads", "head_dim"):
            if getattr(self.vlm, name) != getattr(self.expert, name):
                problems.append(f"expert {name} ({getattr(self.expert, name)}) must equal the VLM's "
                                f"({getattr(self.vlm, name)})")
        for part in (self.vlm, self.expert):
            if part.num_heads % part.num_kv_heads:
                problems.append(f"num_heads {part.num_heads} is not a multiple of num_kv_heads {part.num_kv_heads}")
            if part.head_dim % 2:
                problems.append(f"head_dim {part.head_dim} must be even (RoPE)")
        if self.vision.width % self.vision.num_heads:
            problems.append(f"vision width {self.vision.width} is not a multiple of its {self.vision.num_heads} heads")
        if self.vision.image_size % self.vision.patch_size:
            problems.append("vision image_size must be a multiple of patch_size")
        if self.expert.width % 2:
            problems.append("expert width must be even (sin/cos time embedding)")
        return problems

    @property
    def image_tokens(self) -> int:
        return self.vision.num_patches

    def replace(self, **changes) -> "Pi05Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Pi05Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {unknown}")
        d = dict(d)
        missing = sorted({"vlm", "expert", "vision", "vocab_size"} - set(d))
        if missing:
            raise ValueError(f"model config lacks {missing}")
        for part, kind in (("vlm", GemmaConfig), ("expert", GemmaConfig), ("vision", VisionConfig)):
            sub = d[part]
            if not isinstance(sub, dict):
                raise ValueError(f"model config '{part}' must be a mapping")
            unknown = sorted(set(sub) - {f.name for f in dataclasses.fields(kind)})
            if unknown:
                raise ValueError(f"unknown model config keys in '{part}': {unknown}")
            d[part] = kind(**sub)
        if "camera_slots" in d:
            d["camera_slots"] = tuple(d["camera_slots"])
        return cls(**d)


def _value_problems(part, prefix: str = "") -> list[str]:
    """Every int field a positive integer (within LIMITS where it has one), every float field finite and
    positive: a float or a boolean where an integer is needed is refused, not truncated."""
    problems = []
    for f in dataclasses.fields(part):
        value = getattr(part, f.name)
        if f.type == "int":
            limit = LIMITS.get(f.name, SIZE) if not prefix else SIZE
            if not (isinstance(value, numbers.Integral) and not isinstance(value, bool)
                    and limit.minimum <= value <= limit.maximum):
                problems.append(f"{prefix}{f.name} must be an integer in {limit}, got {value!r}")
        elif f.type == "float":
            if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
                    and value > 0):
                problems.append(f"{prefix}{f.name} must be a positive finite number, got {value!r}")
    return problems


def num_parameters(cfg: Pi05Config) -> int:
    """Parameter count of the model as this package builds it (tied embedding counted once)."""
    def gemma(c: GemmaConfig, ada: bool) -> int:
        attn = c.width * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
        mlp = 3 * c.width * c.mlp_dim
        norm = 2 * (c.width * 3 * c.width + 3 * c.width) if ada else 2 * c.width
        final = (c.width * 3 * c.width + 3 * c.width) if ada else c.width
        return c.depth * (attn + mlp + norm) + final

    v = cfg.vision
    vision = (3 * v.patch_size**2 * v.width + v.width + v.num_patches * v.width
              + v.depth * (4 * (v.width * v.width + v.width) + 2 * v.width * v.mlp_dim + v.mlp_dim + v.width
                           + 4 * v.width) + 2 * v.width)
    projector = v.width * cfg.vlm.width + cfg.vlm.width
    we = cfg.expert.width
    action_io = (cfg.action_dim * we + we) + (we * cfg.action_dim + cfg.action_dim) + 2 * (we * we + we)
    return (vision + projector + cfg.vocab_size * cfg.vlm.width + gemma(cfg.vlm, False)
            + gemma(cfg.expert, True) + action_io)


PRESETS: dict[str, Pi05Config] = {
    # Paper sizes: PaliGemma (SigLIP So400m + Gemma 2B) and the Gemma 300M action expert.
    "pi05": Pi05Config(
        vlm=GemmaConfig(width=2048, depth=18, mlp_dim=16384, num_heads=8, num_kv_heads=1, head_dim=256),
        expert=GemmaConfig(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256),
        vision=VisionConfig(width=1152, depth=27, mlp_dim=4304, num_heads=16),
        vocab_size=257152, action_dim=32, action_horizon=10, max_token_len=200,
    ),
    # Big enough that the weights (~0.8 GB in float32) do not fit in CPU caches, so decode is
    # memory-bound as on a GPU; small enough for a benchmark of a few minutes on 2 cores.
    "bench": Pi05Config(
        vlm=GemmaConfig(width=1024, depth=8, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=128),
        expert=GemmaConfig(width=512, depth=8, mlp_dim=2048, num_heads=8, num_kv_heads=1, head_dim=128),
        vision=VisionConfig(width=384, depth=6, mlp_dim=1536, num_heads=6),
        vocab_size=32768, action_dim=32, action_horizon=10, max_token_len=100,
    ),
    # A few million parameters: runs the whole demo on 2 CPU cores within the 143 ms a 10-action chunk
    # lasts at 70 Hz (depth 2: the expert's 10 denoise steps are Python-overhead bound on a CPU).
    # Vocabulary = the shipped tokenizer's.
    "tiny": Pi05Config(
        vlm=GemmaConfig(width=256, depth=2, mlp_dim=1024, num_heads=4, num_kv_heads=1, head_dim=64),
        expert=GemmaConfig(width=128, depth=2, mlp_dim=512, num_heads=4, num_kv_heads=1, head_dim=64),
        vision=VisionConfig(width=128, depth=2, mlp_dim=512, num_heads=4),
        vocab_size=1000, action_dim=32, action_horizon=10, max_token_len=96,
    ),
    # The demo model, trained from scratch on 1 CPU thread (oxygen_ros/training/train.py; weights in
    # oxygen_ros/model/assets/demo/): trained on the base camera alone (the other slots stay absent),
    # 64x64 in 16x16 patches (16 image tokens: with 64 the text ignored the image for 700+ steps),
    # 3 layers, the arm's 3 joints as actions at 70 Hz, 20 per chunk. Vocabulary = the shipped tokenizer's.
    "demo": Pi05Config(
        vlm=GemmaConfig(width=128, depth=3, mlp_dim=512, num_heads=4, num_kv_heads=1, head_dim=32),
        expert=GemmaConfig(width=64, depth=3, mlp_dim=256, num_heads=4, num_kv_heads=1, head_dim=32),
        vision=VisionConfig(width=128, depth=2, mlp_dim=256, num_heads=4, patch_size=16, image_size=64),
        vocab_size=1000, action_dim=3, action_horizon=20, max_token_len=48,
    ),
}


def preset(name: str) -> Pi05Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None


def from_oracle_json(path: str | Path) -> Pi05Config:
    """Config of an oracle case (../shared/oracle/<case>/config.json)."""
    c = json.loads(Path(path).read_text())

    def gemma(g: dict) -> GemmaConfig:
        return GemmaConfig(width=g["width"], depth=g["depth"], mlp_dim=g["mlp_dim"], num_heads=g["num_heads"],
                           num_kv_heads=g["num_kv_heads"], head_dim=g["head_dim"], rms_eps=g["rms_norm_eps"],
                           rope_theta=g["rope_theta"])

    v = c["vision"]
    return Pi05Config(
        vlm=gemma(c["vlm"]), expert=gemma(c["expert"]),
        vision=VisionConfig(width=v["hidden_size"], depth=v["num_hidden_layers"], mlp_dim=v["intermediate_size"],
                            num_heads=v["num_attention_heads"], patch_size=v["patch_size"],
                            image_size=v["image_size"], layer_norm_eps=v["layer_norm_eps"]),
        vocab_size=c["vocab_size"], action_dim=c["action_dim"], action_horizon=c["action_horizon"],
        max_token_len=c["max_token_len"], num_denoise_steps=c["num_denoise_steps"],
        prefix_language_attention=c["prefix_language_attention"],
        time_min_period=c["time_embedding"]["min_period"], time_max_period=c["time_embedding"]["max_period"],
        camera_slots=tuple(c["image_keys"]),
    )


def load_config(path: str | Path) -> Pi05Config:
    """A model config file: JSON or YAML with Pi05Config's field names."""
    import yaml  # safe_load only: config files never execute code

    path = Path(path)
    text = read_bytes(path, MAX_JSON_BYTES)
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: not valid {'YAML' if path.suffix != '.json' else 'JSON'} ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a model config must be a mapping")
    try:
        return Pi05Config.from_dict(data)
    except (ValueError, TypeError) as e:      # TypeError: a missing or misspelt field of vlm/expert/vision
        raise ValueError(f"{path}: {e}") from None
