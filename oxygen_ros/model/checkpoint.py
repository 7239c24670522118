"""Load π0.5 weights from openpi PyTorch and LeRobot pi05 checkpoints (safetensors only, strict).

Formats (detected from the key names):
- openpi: `model.safetensors` holding `PI0Pytorch(pi05=True).state_dict()` names
  (`paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.q_proj.weight`, ...). The tied
  embedding is stored once, as `paligemma_with_expert.paligemma.lm_head.weight`.
- LeRobot: the same module under `model.` (every key prefixed); the embedding is present under both
  names, `language_model.embed_tokens` (what LeRobot embeds with) and `lm_head` (its text logits). They
  start tied but LeRobot 0.6.1 fine-tunes them apart: the embedding is always read from `embed_tokens`
  when it is there (whatever the shard order), and a differing `lm_head` is kept for text logits, logged.
- openpi's JAX checkpoints (a folder with `params/` written by orbax), read without JAX and mapped as openpi's
  conversion script maps them (model/openpi_jax.py): then loaded as that script's output.
- A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, LeRobot's `--peft` output): its
  base's weights with the adapter merged in at load (model/lora.py); config and statistics are the adapter
  folder's. The base is fetched by name when it is a hub id (model/download.py).
Older openpi conversions name the time MLP `action_time_mlp_{in,out}`; accepted as aliases.
Ignored on purpose (never used by π0.5 inference): the expert's LM head.

Any other unexpected key, any missing key and any shape mismatch is an error that names the keys.
Weights are materialised one tensor at a time straight into the target dtype and device, on a model
built on the meta device, so a full-size checkpoint is never held twice.
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import LIMITS, Pi05Config
from .files import (LEROBOT_POSTPROCESSOR, LEROBOT_PREPROCESSOR, CheckpointError, JsonObject, is_file_name,
                    present, processor_steps, regular_file)
from .download import resolve_checkpoint
from .lora import is_adapter, read_adapter
from .openpi_jax import JaxParams, is_jax_checkpoint
from .pi05 import Pi05, param_dtype
from .pi052 import Pi052Format, checkpoint_format

_PG = "paligemma_with_expert.paligemma."
_VIS = _PG + "model.vision_tower.vision_model."
_LM = _PG + "model.language_model."
_EX = "paligemma_with_expert.gemma_expert."
_GEMMA_LINEARS = [("q_proj", "self_attn.q_proj"), ("k_proj", "self_attn.k_proj"), ("v_proj", "self_attn.v_proj"),
                  ("o_proj", "self_attn.o_proj"), ("gate_proj", "mlp.gate_proj"), ("up_proj", "mlp.up_proj"),
                  ("down_proj", "mlp.down_proj")]

# (this package's parameter name, openpi name); {i} = layer index, {p} = weight|bias.
NAME_TABLE: list[tuple[str, str]] = [
    ("vision.patch_embedding.{p}", _VIS + "embeddings.patch_embedding.{p}"),
    ("vision.position_embedding", _VIS + "embeddings.position_embedding.weight"),
    ("vision.layers.{i}.layer_norm1.{p}", _VIS + "encoder.layers.{i}.layer_norm1.{p}"),
    ("vision.layers.{i}.layer_norm2.{p}", _VIS + "encoder.layers.{i}.layer_norm2.{p}"),
    *[(f"vision.layers.{{i}}.{n}.{{p}}", _VIS + f"encoder.layers.{{i}}.self_attn.{n}.{{p}}")
      for n in ("q_proj", "k_proj", "v_proj", "out_proj")],
    ("vision.layers.{i}.fc1.{p}", _VIS + "encoder.layers.{i}.mlp.fc1.{p}"),
    ("vision.layers.{i}.fc2.{p}", _VIS + "encoder.layers.{i}.mlp.fc2.{p}"),
    ("vision.post_layernorm.{p}", _VIS + "post_layernorm.{p}"),
    ("projector.{p}", _PG + "model.multi_modal_projector.linear.{p}"),
    ("embed_tokens.weight", _PG + "lm_head.weight"),
    ("vlm_layers.{i}.input_norm.weight", _LM + "layers.{i}.input_layernorm.weight"),
    ("vlm_layers.{i}.post_attention_norm.weight", _LM + "layers.{i}.post_attention_layernorm.weight"),
    *[(f"vlm_layers.{{i}}.{a}.weight", _LM + f"layers.{{i}}.{b}.weight") for a, b in _GEMMA_LINEARS],
    ("vlm_norm.weight", _LM + "norm.weight"),
    ("expert_layers.{i}.input_norm.dense.{p}", _EX + "model.layers.{i}.input_layernorm.dense.{p}"),
    ("expert_layers.{i}.post_attention_norm.dense.{p}", _EX + "model.layers.{i}.post_attention_layernorm.dense.{p}"),
    *[(f"expert_layers.{{i}}.{a}.weight", _EX + f"model.layers.{{i}}.{b}.weight") for a, b in _GEMMA_LINEARS],
    ("expert_norm.dense.{p}", _EX + "model.norm.dense.{p}"),
    *[(f"{n}.{{p}}", f"{n}.{{p}}") for n in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")],
]
# Other names for the same tensor (the tied embedding; the time MLP of older openpi conversions).
EMBED_TOKENS = _LM + "embed_tokens.weight"      # the embedding, when stored under its own name
LM_HEAD = _PG + "lm_head.weight"                # openpi's single name of the tied embedding / LeRobot's head
ALIASES = {
    EMBED_TOKENS: LM_HEAD,
    "action_time_mlp_in.weight": "time_mlp_in.weight", "action_time_mlp_in.bias": "time_mlp_in.bias",
    "action_time_mlp_out.weight": "time_mlp_out.weight", "action_time_mlp_out.bias": "time_mlp_out.bias",
}
IGNORED = re.compile(r"^paligemma_with_expert\.gemma_expert\.(lm_head\.weight|model\.embed_tokens\.weight)$")


log = logging.getLogger(__name__)


MAX_IMAGE_SIDE = 4096      # the largest image side a LeRobot checkpoint may resize its cameras to
# Weights are read in these dtypes (then cast to the serving dtype); an integer, boolean or 8-bit float
# tensor is not a π0.5 weight (a quantised checkpoint needs its scales), whatever its shape.
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")


def _template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
    return re.compile("^" + pattern + "$")


_TO_LOCAL = [(_template_regex(theirs), ours) for ours, theirs in NAME_TABLE]
_TO_OPENPI = [(_template_regex(ours), theirs) for ours, theirs in NAME_TABLE]


def _convert(name: str, rules) -> str | None:
    for regex, target in rules:
        m = regex.match(name)
        if m:
            return target.format(**m.groupdict())
    return None


def openpi_name(local: str) -> str:
    name = _convert(local, _TO_OPENPI)
    if name is None:
        raise KeyError(local)
    return name


def folder_of(path: str | Path) -> Path:
    """The checkpoint's directory: `path` itself, or the folder of a weights file given directly."""
    path = Path(path)
    return path if path.is_dir() else path.parent


def _files(path: Path) -> list[Path]:
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        is_dir = False
    if not is_dir:
        return [regular_file(path)]               # the weights file itself, or a CheckpointError naming it
    index = path / "model.safetensors.index.json"
    if present(index):  # sharded checkpoint
        return [path / s for s in _shard_names(index)]
    single = path / "model.safetensors"
    if present(single):
        return [regular_file(single)]
    raise CheckpointError(f"{path}: no model.safetensors in it (π0.5 checkpoints are loaded from safetensors only)")


def _shard_names(index: Path) -> list[str]:
    """The shard files an index names: bare file names beside it (never `../` or an absolute path)."""
    weight_map = JsonObject.load(index).object("weight_map")
    if weight_map is None:
        raise CheckpointError(f"{index}: has no weight_map object")
    names = list(weight_map.data.values())
    for name in names:
        if not is_file_name(name):
            raise CheckpointError(f"{index}: shard name {name!r} is not a file name in {index.parent}")
        if not present(index.parent / name):
            raise CheckpointError(f"{index}: shard {name} not found in {index.parent}")
        regular_file(index.parent / name)
    return sorted(set(names))


def _open(f: Path):
    """safe_open with a CheckpointError naming the file when it is not a readable safetensors file (a FIFO
    or a directory is refused before it is opened: opening a FIFO blocks)."""
    if isinstance(f, JaxParams):
        return f
    regular_file(f)
    try:
        return safe_open(str(f), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - SafetensorError (not exported) or OSError: the file is unusable
        raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None


def _listing(names, limit: int = 12) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f" ... and {len(names) - limit} more" if len(names) > limit else "")


def read_key_map(path: str | Path) -> tuple[str, dict[str, tuple[Path, str]]]:
    """Detect the format and map every needed parameter to (file, key in file); "lm_head.weight" too when
    the file holds a head apart from the embedding. Raises CheckpointError naming unexpected keys (and
    hints when the file is a π0, not π0.5, checkpoint)."""
    keys: dict[str, Path | JaxParams] = {}
    if is_jax_checkpoint(path):             # openpi's params/ (orbax), as openpi's conversion names it
        params = JaxParams(path)
        keys = {k: params for k in params.keys()}
    else:
        for f in _files(Path(path)):
            with _open(f) as sf:
                for k in sf.keys():
                    keys[k] = f
    prefixed = [k.startswith("model.") for k in keys]
    if any(prefixed) and not all(prefixed):
        raise CheckpointError(f"{path}: mixes LeRobot-style 'model.' keys with unprefixed keys: "
                              f"{_listing(k for k in keys if not k.startswith('model.'))}")
    fmt = "lerobot" if all(prefixed) and keys else "openpi"
    mapping: dict[str, tuple[Path, str]] = {}
    embeddings: dict[bool, tuple[Path, str]] = {}   # stored as embed_tokens (True) / as lm_head (False)
    unexpected = []
    for key, f in keys.items():
        name = key[len("model."):] if fmt == "lerobot" else key
        name = ALIASES.get(name, name)
        if IGNORED.match(name):
            continue
        local = _convert(name, _TO_LOCAL)
        if local is None:
            unexpected.append(key)
        elif local == "embed_tokens.weight":
            embeddings[key.endswith(EMBED_TOKENS)] = (f, key)
        elif local not in mapping:
            mapping[local] = (f, key)
    if embeddings:
        # Embed with embed_tokens when present; lm_head is then the text head ("lm_head.weight").
        mapping["embed_tokens.weight"] = embeddings.get(True) or embeddings[False]
        if True in embeddings and False in embeddings:
            mapping["lm_head.weight"] = embeddings[False]
    if unexpected:
        hint = ""
        if any("state_proj" in k or "action_time_mlp" in k for k in unexpected):
            hint = " (state_proj / action_time_mlp_* with a state token: this looks like a π0, not a π0.5, checkpoint)"
        elif any(k.endswith("layernorm.weight") and "gemma_expert" in k for k in unexpected):
            hint = " (expert RMSNorm weights: π0.5's expert uses adaRMSNorm, this checkpoint was not trained with it)"
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected key(s){hint}: {_listing(unexpected)}")
    return fmt, mapping


# A checkpoint's config.json keys that set a model setting (openpi's conversion writes action_horizon and
# action_dim; LeRobot's the others), bounded as the model config bounds the setting (config.LIMITS).
RECORDED = {"action_horizon": "action_horizon", "action_dim": "action_dim", "chunk_size": "action_horizon",
            "max_action_dim": "action_dim", "tokenizer_max_length": "max_token_len",
            "num_inference_steps": "num_denoise_steps"}


def checkpoint_settings(path: str | Path) -> dict:
    """Model settings recorded next to the weights, in Pi05Config field names: openpi's conversion writes
    config.json with action_horizon/action_dim; LeRobot's has chunk_size, max_action_dim,
    tokenizer_max_length and num_inference_steps; ours may add prefix_conditioning (a bool). Empty when there
    is no such file. Each value is checked against the model config's bounds (config.LIMITS): a
    CheckpointError names the file and every key that is wrong, one line each."""
    config = folder_of(path) / "config.json"
    if not present(config):
        return {}
    data = JsonObject.load(config)
    settings, problems = {}, []
    for theirs, ours in RECORDED.items():
        limit = LIMITS[ours]
        try:
            value = data.integer(theirs, limit.minimum, limit.maximum)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if value is None:
            continue
        if ours in settings and settings[ours][1] != value:
            problems.append(f"{config}: {theirs} {value} contradicts {settings[ours][0]} {settings[ours][1]} "
                            f"(both set {ours})")
        settings.setdefault(ours, (theirs, value))
    try:
        conditioned = data.boolean("prefix_conditioning")   # written by oxygen_ros.training.train --prefix-delay-max
    except CheckpointError as e:
        problems.append(str(e))
        conditioned = None
    if problems:
        raise CheckpointError("\n".join(problems))
    settings = {ours: value for ours, (_, value) in settings.items()}
    if conditioned is not None:
        settings["prefix_conditioning"] = conditioned
    return settings


@dataclass(frozen=True)
class LeRobotPolicy:
    """What a LeRobot pi05 directory says about serving it (config.json, and the processor configs LeRobot
    serves it with): the pipeline around the model follows LeRobot's, not openpi's."""

    cameras: tuple[str, ...]      # image features, in input_features order: the order they enter the prefix
    state_in_prompt: bool = True  # LeRobot's pi05 processor always puts the discretised state in the prompt
    action_dim: int | None = None                 # the action feature's size: the model's chunk is cut to it
    image_resolution: tuple[int, int] | None = None   # (height, width) LeRobot resizes camera images to
    relative_mask: tuple[bool, ...] = ()          # relative actions: action dims that get the state added back
    pi052: Pi052Format | None = None              # a pi052 checkpoint's language format (model/pi052.py)

    def camera_slots(self, slots: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
        """({feature: model slot}, problems). LeRobot feeds its cameras in input_features order, so the
        i-th feature takes the i-th slot; a feature named after another slot contradicts that."""
        problems = []
        if len(self.cameras) > len(slots):
            problems.append(f"the LeRobot checkpoint has {len(self.cameras)} cameras {list(self.cameras)}, the "
                            f"model {len(slots)} slots {list(slots)}")
        mapping = dict(zip(self.cameras, slots))
        for feature, slot in mapping.items():
            named = feature.rsplit(".", 1)[-1]
            if named in slots and named != slot:
                problems.append(f"LeRobot camera '{feature}' is fed at position {slots.index(slot)} (slot {slot}), "
                                f"but is named after slot {named}: reorder input_features in its config.json "
                                f"or rename the feature, so that position and name agree")
        return mapping, problems


def lerobot_policy(path: str | Path) -> LeRobotPolicy | None:
    """The LeRobot pi05 settings of a checkpoint directory (config.json with "type": "pi05", or "pi052": the same
    model and processors, plus its language format); None otherwise.
    Relative actions as LeRobot 0.6.1 serves them: the post-processor's absolute_actions_processor adds the
    (raw) state back on the dimensions its pre-processor's relative_actions_processor marks: all of them,
    except those whose name in `action_names` contains one of `exclude_joints` (default "gripper"). A
    directory without processor configs is read as LeRobot would build them from config.json
    (use_relative_actions, relative_exclude_joints, action_feature_names)."""
    folder = folder_of(path)
    config = folder / "config.json"
    if not present(config):
        return None
    data = JsonObject.load(config)
    if data.raw("type") not in ("pi05", "pi052"):
        return None
    try:
        text_format = checkpoint_format(data.data)
    except ValueError as e:
        raise CheckpointError(f"{config}: {e}") from None
    features = data.object("input_features")
    cameras = []
    for name in features.keys() if features else ():
        feature = features.object(name)
        if feature is not None and feature.string("type") == "VISUAL":
            cameras.append(name)
    action = (data.object("output_features") or JsonObject({}, config)).object("action")
    shape = action.integers("shape", 1, 1, LIMITS["action_dim"].maximum) if action is not None else None
    action_dim = shape[0] if shape else None
    resolution = data.integers("image_resolution", 2, 1, MAX_IMAGE_SIDE)
    relative = _relative_step(folder, data)
    mask: tuple[bool, ...] = ()
    if relative is not None:
        if action_dim is None:
            raise CheckpointError(f"{config}: relative actions need the action feature's size "
                                  f"(output_features.action.shape)")
        mask = _relative_mask(action_dim, *relative)
    return LeRobotPolicy(tuple(cameras), action_dim=action_dim,
                         image_resolution=tuple(resolution) if resolution else None, relative_mask=mask,
                         pi052=text_format)


def _relative_step(folder: Path, config: JsonObject) -> tuple[list[str], list[str] | None] | None:
    """(exclude_joints, action_names) when the directory's actions are relative; None when absolute."""
    pre, post = folder / LEROBOT_PREPROCESSOR, folder / LEROBOT_POSTPROCESSOR
    if not present(pre) and not present(post):
        if not config.boolean("use_relative_actions"):
            return None
        excluded = config.strings("relative_exclude_joints") if "relative_exclude_joints" in config.data \
            else ["gripper"]                                  # LeRobot's default
        return list(excluded or []), config.strings("action_feature_names")

    def step(pipeline: Path, name: str) -> JsonObject | None:
        found = processor_steps(pipeline, name) if present(pipeline) else []
        return (found[0].object("config") or JsonObject({}, pipeline)) if found else None

    absolute = step(post, "absolute_actions_processor")
    if absolute is None or not absolute.boolean("enabled"):
        return None
    relative = step(pre, "relative_actions_processor")
    if relative is None:
        raise CheckpointError(f"{folder}: the post-processor adds the state to the actions (absolute_actions_"
                              f"processor) but the pre-processor has no relative_actions_processor to say where")
    return list(relative.strings("exclude_joints") or []), relative.strings("action_names")


def _relative_mask(action_dim: int, exclude_joints: list[str], action_names: list[str] | None) -> tuple[bool, ...]:
    """LeRobot 0.6.1's RelativeActionsProcessorStep._build_mask."""
    tokens = [str(name).lower() for name in exclude_joints if name]
    if not tokens or action_names is None:
        return (True,) * action_dim
    mask = [not any(t == str(name).lower() or t in str(name).lower() for t in tokens)
            for name in action_names[:action_dim]]
    return tuple(mask + [True] * (action_dim - len(mask)))


def check_weights(path: str | Path, cfg: Pi05Config, base: str | Path | None = None
                  ) -> tuple[str, dict[str, tuple[Path, str]]]:
    """The checkpoint's format and key map (read_key_map), once its files' headers (no tensor is read) show
    every weight of `cfg` in its shape and in a floating dtype: otherwise a CheckpointError naming the keys.
    Cheap: the engine node runs it at configure, with its other checks, before anything is loaded. A PEFT
    LoRA adapter folder (model/lora.py) maps its base's weights (fetched by name when it is a hub id) and is
    checked against them: targets, ranks, shapes; `base`: another base than the one it names."""
    fmt, mapping, adapter = _weights_and_adapter(path, cfg, base)
    return fmt, mapping


def _weights_and_adapter(path: str | Path, cfg: Pi05Config, base: str | Path | None = None):
    """`base`: a LoRA adapter's base when not the one its adapter_config.json names (a local copy, a mirror)."""
    adapter = read_adapter(path) if is_adapter(path) else None
    if adapter is None and base:
        raise CheckpointError(f"{folder_of(path)}: a base checkpoint ({base}) is given, but this is not a PEFT LoRA "
                              f"adapter (no adapter_config.json): only an adapter has a base")
    if adapter is not None:
        named = base or adapter.base_name
        base = resolve_checkpoint(named)
        if is_adapter(base):
            raise CheckpointError(f"{adapter.folder}: its base {named} is itself an adapter")
        if present(folder_of(path) / "model.safetensors"):
            raise CheckpointError(f"{folder_of(path)}: holds both model.safetensors and a PEFT adapter: which "
                                  f"weights are the policy's is ambiguous")
        path = base
    fmt, mapping = read_key_map(path)
    files = {f for f, _ in mapping.values()}
    where = files.pop() if len(files) == 1 else path          # the weights file, when there is one
    with torch.device("meta"):
        model = Pi05(cfg)
    expected = {name: tuple(param.shape) for name, param in model.named_parameters()}
    prefix = "model." if fmt == "lerobot" else ""
    missing = [prefix + openpi_name(n) for n in expected if n not in mapping]
    if missing:
        raise CheckpointError(f"{where} ({fmt} format): {len(missing)} missing key(s): {_listing(missing)}")
    if "lm_head.weight" in mapping:                     # a text head apart from the embedding: its shape
        expected["lm_head.weight"] = expected["embed_tokens.weight"]
    mismatched, not_weights = [], []
    handles = {}
    try:
        for name, shape in expected.items():
            f, key = mapping[name]
            if f not in handles:
                handles[f] = _open(f)
            found = handles[f].get_slice(key)
            if found.get_dtype() not in WEIGHT_DTYPES:
                not_weights.append(f"{key} is {found.get_dtype()}")
            elif tuple(found.get_shape()) != shape:
                mismatched.append(f"{key} has shape {list(found.get_shape())}, the config expects {list(shape)}")
    finally:
        handles.clear()
    if not_weights:
        raise CheckpointError(f"{where}: {len(not_weights)} tensor(s) are not floating-point weights "
                              f"({', '.join(WEIGHT_DTYPES)}): " + _first(not_weights))
    if mismatched:
        raise CheckpointError(f"{where}: {len(mismatched)} tensor(s) do not match the model config "
                              f"(wrong preset or sizes?): " + _first(mismatched))
    if adapter is not None:
        shapes = {lerobot_name(n): shape for n, shape in expected.items() if n != "lm_head.weight"}
        linears = {key[:-len(".weight")]: shape for key, shape in shapes.items()
                   if len(shape) == 2 and key.endswith(".weight") and not key.endswith(EMBED_TOKENS)}
        adapter.check(linears, shapes, ignored=lambda module: bool(IGNORED.match(module[len("model."):] + ".weight")))
    return fmt, mapping, adapter


def lerobot_name(local: str) -> str:
    """A parameter's name in LeRobot's PI05Policy (what a PEFT adapter of it names): the embedding is its
    language model's embed_tokens (openpi names the tied tensor lm_head)."""
    return "model." + (EMBED_TOKENS if local == "embed_tokens.weight" else openpi_name(local))


def _first(problems: list[str], shown: int = 8) -> str:
    return "; ".join(problems[:shown]) + (f" ... and {len(problems) - shown} more" if len(problems) > shown else "")


class LoadStopped(Exception):
    """The load was stopped (load_pi05's `stop` set: Ctrl-C while a process starts)."""


def load_pi05(path: str | Path, cfg: Pi05Config, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, islands: bool = True, stop=None,
              base: str | Path | None = None) -> Pi05:
    """Build the model for `cfg` and fill it from the checkpoint at `path` (directory or file), in `dtype`
    except openpi's float32 islands (pi05.FLOAT32_ISLANDS) unless `islands` is False. `stop` (a
    threading.Event): checked before each tensor, LoadStopped once it is set (a full π0.5 takes minutes to
    read; a Ctrl-C must not wait for the rest). `base`: a LoRA adapter's base, when not the one it names."""
    fmt, mapping, adapter = _weights_and_adapter(path, cfg, base)
    started = time.monotonic()
    with torch.device("meta"):
        model = Pi05(cfg)
    state, handles, headers = {}, {}, {}
    try:
        if adapter is not None:
            handles[adapter.weights] = _open(adapter.weights)
        for name in dict(model.named_parameters()):
            if stop is not None and stop.is_set():
                raise LoadStopped(f"loading {path} stopped")
            f, key = mapping[name]
            if f not in handles:
                handles[f] = _open(f)
            target = param_dtype(name, dtype, islands)
            tensor = _read_tensor(handles[f], f, key, device, target, headers, mapped=adapter is None)
            if adapter is not None:
                tensor = adapter.merged(lerobot_name(name), tensor, handles[adapter.weights])
            state[name] = tensor.to(device=device, dtype=target)
        if "lm_head.weight" in mapping:
            f, key = mapping["lm_head.weight"]
            if f not in handles:
                handles[f] = _open(f)
            head = _read_tensor(handles[f], f, key, device, dtype, headers).to(device=device, dtype=dtype)
    finally:
        handles.clear()
    model.load_state_dict(state, strict=True, assign=True)
    if "lm_head.weight" in mapping:
        diff = _max_difference(head, model.embed_tokens.weight)
        if diff > 0:
            model.lm_head = head
            log.warning(f"{path}: lm_head and embed_tokens differ (max |diff| {diff:.3g}): embedding with "
                        f"embed_tokens (as LeRobot does), text logits with lm_head")
    model.time_grid = fmt           # denoised on its format's flow-time grid (pi05.TIME_GRIDS)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info(f"{path}: {len(state)} tensors ({held / 1e9:.2f} GB in {dtype}, {fmt} format"
             f"{', LoRA merged' if adapter is not None else ''}) loaded in {time.monotonic() - started:.1f} s")
    return model.eval().requires_grad_(False)


_SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def _read_tensor(handle, f, key: str, device, dtype: torch.dtype, headers: dict, mapped: bool = True) -> torch.Tensor:
    """Tensor `key` of file `f`, to be served on `device` in `dtype`. On the CPU in the file's own dtype: a view
    of the file's memory map (no copy; its pages are read on first use). Otherwise it is read with pread into
    memory of its own, so that no mapped page stays resident once its tensor is converted (through the map, a
    float32 file served in bfloat16, or on a GPU, would hold the whole file resident until the load ends)."""
    if isinstance(f, JaxParams):
        return handle.get_tensor(key)
    info = handle.get_slice(key)
    stored = _SAFETENSORS_DTYPES[info.get_dtype()]
    if mapped and torch.device(device).type == "cpu" and stored == dtype:
        return handle.get_tensor(key)
    out = torch.empty(list(info.get_shape()), dtype=stored)
    view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    offset = _data_offset(f, key, headers)
    with open(f, "rb", buffering=0) as file:
        done = 0
        while done < len(view):
            n = os.preadv(file.fileno(), [view[done:]], offset + done)
            if not n:
                raise CheckpointError(f"{f}: {key} is cut short")
            done += n
    return out


def _data_offset(f: Path, key: str, headers: dict) -> int:
    """Where tensor `key`'s bytes start in safetensors file `f` (its header read once per load, in `headers`)."""
    if f not in headers:
        with open(f, "rb") as file:
            size = int.from_bytes(file.read(8), "little")
            headers[f] = (8 + size, json.loads(file.read(size)))
    base, entries = headers[f]
    return base + entries[key]["data_offsets"][0]


def _max_difference(a: torch.Tensor, b: torch.Tensor, rows: int = 4096) -> float:
    """max |a - b| in float32, a block of rows at a time (a full vocabulary is 2 GB in float32: never whole)."""
    return max(((a[i:i + rows].float() - b[i:i + rows].float()).abs().max().item()
                for i in range(0, a.shape[0], rows)), default=0.0)


def save_checkpoint(model: Pi05, path: str | Path, fmt: str = "openpi") -> Path:
    """Write `model` in openpi or LeRobot layout (what real checkpoints look like; used by tests and the
    demo). openpi stores the tied embedding once (as lm_head); LeRobot prefixes `model.` and stores both."""
    if fmt not in ("openpi", "lerobot"):
        raise ValueError(f"unknown checkpoint format {fmt!r}")
    tensors = {openpi_name(n): p.detach().contiguous() for n, p in model.named_parameters()}
    if fmt == "lerobot":
        tensors[_LM + "embed_tokens.weight"] = tensors[_PG + "lm_head.weight"].clone()
        tensors = {"model." + k: v for k, v in tensors.items()}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out = path / "model.safetensors"
    save_file(tensors, str(out), metadata={"format": "pt"})
    return out


@torch.no_grad()
def init_random_weights(model: Pi05, seed: int = 0) -> Pi05:
    """Deterministic random weights with no parameter left at 0 or 1 (the oracle cases' scheme): the
    embedded demo model and the tests' models. Linear weights ~ N(0, 1/fan_in) with the oracle's gains
    (VLM q/k x2, attention v/o x2, MLP down x4), so greedy text does not just repeat its input."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=torch.float64).mul_(std).to(torch.float32)

    for name, p in sorted(model.named_parameters()):
        if name.startswith("vision.") and ("layer_norm" in name or "post_layernorm" in name):
            value = (1.0 + normal(p.shape, 0.1)) if name.endswith("weight") else normal(p.shape, 0.1)
        elif name == "vision.position_embedding":
            value = normal(p.shape, 0.3)
        elif name == "vision.patch_embedding.weight":
            value = normal(p.shape, (3 * p.shape[-1] * p.shape[-2]) ** -0.5)
        elif name == "embed_tokens.weight":
            value = normal(p.shape, p.shape[1] ** -0.5)
        elif name.endswith("norm.weight"):
            value = normal(p.shape, 0.1)                       # applied as (1 + w)
        elif name.endswith("bias"):
            value = normal(p.shape, 0.2 if ".dense." in name else 0.1)
        else:
            gain = 1.0
            if name.startswith("vlm_layers") and (".q_proj" in name or ".k_proj" in name):
                gain = 2.0
            elif ".v_proj" in name or ".o_proj" in name:
                gain = 2.0
            elif ".down_proj" in name:
                gain = 4.0
            value = normal(p.shape, gain / p.shape[1] ** 0.5)
        p.copy_(value.to(p.dtype))
    return model
