"""PEFT LoRA adapters (what LeRobot's `--peft` fine-tunes save), merged into their base's weights at load.

An adapter folder holds adapter_config.json and adapter_model.safetensors beside the policy's own config.json and
processor statistics (LeRobot saves them there: they, not the base's, are the policy's). Its base is
`base_model_name_or_path` at `revision` (a hub id or a folder: model/download.py). The weights PEFT saves are
named after LeRobot's PI05Policy modules under `base_model.model.`:
- `<module>.lora_A.weight` (r x in) and `<module>.lora_B.weight` (out x r) for each adapted nn.Linear: merged as
  PEFT's merge_and_unload does, W + (B @ A) * scale in float32, scale = alpha / r (alpha / sqrt(r) with
  `use_rslora`), r and alpha per module from `rank_pattern` / `alpha_pattern` (PEFT's get_pattern_key);
- `<module>.weight` / `.bias` of `modules_to_save`: they replace the base's tensors.
Which modules are adapted is computed from `target_modules` (a regex string matched in full, or a list of
names matched as suffixes: PEFT's check_target_module_exists) over the model's own module names, and must be
exactly those the file holds weights for. Adapter kinds and options the merge does not implement (DoRA, other
PEFT types, LoRA biases, layer selections, ...) are refused in one line naming the field.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .download import parse_name
from .files import CheckpointError, JsonObject, present, regular_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# adapter_config.json fields whose non-default value changes what the adapter computes, beyond the merge here.
UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA) adapters are not merged",
    "fan_in_fan_out": "Conv1D-style (fan_in_fan_out) weights are not merged",
    "lora_bias": "LoRA biases are not merged",
    "use_qalora": "QALoRA adapters are not merged",
    "use_bdlora": "BD-LoRA adapters are not merged",
    "layers_to_transform": "layer selections are not merged",
    "layers_pattern": "layer selections are not merged",
    "layer_replication": "layer replication is not merged",
    "target_parameters": "parameter-targeted LoRA is not merged",
    "trainable_token_indices": "trainable tokens are not merged",
    "alora_invocation_tokens": "activated LoRA (aLoRA) adapters are not merged",
    "megatron_config": "Megatron-parallel adapters are not merged",
    "kasa_config": "KaSA adapters (singular-value scaled) are not merged",
    "monteclora_config": "MonteCLoRA adapters are not merged",
    "arrow_config": "Arrow routing between adapters is not merged",
}


def is_adapter(path: str | Path) -> bool:
    path = Path(path)
    return present((path if path.is_dir() else path.parent) / ADAPTER_CONFIG)


def _pattern_key(patterns, module: str) -> str | None:
    """PEFT's get_pattern_key: the first pattern matching the module's name or a dotted suffix of it."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


@dataclass
class LoraAdapter:
    folder: Path
    base: str                                  # the base checkpoint's name: a hub id or a folder
    revision: str | None
    targets: str | list[str]
    excluded: str | list[str] | None
    rank: int
    alpha: float
    rslora: bool
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    modules_to_save: list[str] = field(default_factory=list)
    # Read from the weights file: {module: (lora_A key, lora_B key)} and {parameter key: file key}.
    lora: dict[str, tuple[str, str]] = field(default_factory=dict)
    saved: dict[str, str] = field(default_factory=dict)

    @property
    def base_name(self) -> str:
        """The base as a checkpoint name (model/download.py): a hub id at the adapter's revision, or as written."""
        hub = self.revision is not None and parse_name(self.base).kind == "hub"
        return f"{self.base}@{self.revision}" if hub else self.base

    @property
    def weights(self) -> Path:
        return self.folder / ADAPTER_WEIGHTS

    def targeted(self, module: str) -> bool:
        """PEFT's check_target_module_exists for a module name (exclude_modules and modules_to_save first)."""
        if self.excluded:
            if isinstance(self.excluded, str):
                if re.fullmatch(self.excluded, module):
                    return False
            elif module in self.excluded or any(module.endswith("." + m) for m in self.excluded):
                return False
        if any(re.match(rf"(^|.*\.){m}($|\..*)", module) for m in self.modules_to_save):
            return False
        if isinstance(self.targets, str):
            return re.fullmatch(self.targets, module) is not None
        return module in self.targets or any(module.endswith("." + t) for t in self.targets)

    def scale(self, module: str) -> tuple[int, float]:
        """(rank, scale) of a module: alpha / r, or alpha / sqrt(r) rank-stabilised."""
        key = _pattern_key(self.rank_pattern, module)
        rank = self.rank_pattern[key] if key is not None else self.rank
        key = _pattern_key(self.alpha_pattern, module)
        alpha = self.alpha_pattern[key] if key is not None else self.alpha
        return rank, alpha / math.sqrt(rank) if self.rslora else alpha / rank

    def check(self, linears: dict[str, tuple[int, int]], parameters: dict[str, tuple[int, ...]],
              ignored=lambda module: False) -> None:
        """Against the model: `linears` {LeRobot module name: (out, in)} of the adaptable weights,
        `parameters` {LeRobot parameter key: shape} of every weight. Every problem in one CheckpointError."""
        problems = []
        expected = {m for m in linears if self.targeted(m)}
        held = {m for m in self.lora if not ignored(m)}
        for module in sorted(held - set(linears)):
            problems.append(f"adapter weights for {module}, which is not a linear layer the model merges "
                            f"(LoRA on embeddings, the LM head or convolutions is not merged)")
        for module in sorted(expected - held):
            problems.append(f"target_modules selects {module} but the adapter holds no weights for it")
        for module in sorted((held & set(linears)) - expected):
            problems.append(f"adapter weights for {module}, which target_modules does not select")
        with safe_open(str(self.weights), framework="pt") as f:
            for module in sorted(held & set(linears)):
                a_key, b_key = self.lora[module]
                out_dim, in_dim = linears[module]
                rank, _ = self.scale(module)
                a, b = f.get_slice(a_key).get_shape(), f.get_slice(b_key).get_shape()
                if list(a) != [rank, in_dim] or list(b) != [out_dim, rank]:
                    problems.append(f"{module}: lora_A {list(a)} and lora_B {list(b)}, expected {[rank, in_dim]} "
                                    f"and {[out_dim, rank]} (r {rank} from r / rank_pattern)")
            for key, file_key in sorted(self.saved.items()):
                if key not in parameters:
                    if not ignored(key.rsplit(".", 1)[0]):
                        problems.append(f"modules_to_save tensor {file_key} is not a parameter of the model")
                elif tuple(f.get_slice(file_key).get_shape()) != parameters[key]:
                    problems.append(f"modules_to_save tensor {file_key} has shape "
                                    f"{list(f.get_slice(file_key).get_shape())}, the model {list(parameters[key])}")
        if problems:
            raise CheckpointError(f"{self.weights}: " + "; ".join(problems))

    def merged(self, key: str, weight: torch.Tensor, handle) -> torch.Tensor:
        """The base's tensor `weight` for LeRobot parameter `key` with the adapter applied (float32), or as it
        is when the adapter does not touch it. `handle`: the adapter file, open."""
        if key in self.saved:
            return handle.get_tensor(self.saved[key]).float()
        module, _, kind = key.rpartition(".")
        if kind != "weight" or module not in self.lora:
            return weight
        a_key, b_key = self.lora[module]
        _, scale = self.scale(module)
        a, b = handle.get_tensor(a_key).float(), handle.get_tensor(b_key).float()
        return weight.float() + (b @ a) * scale


def read_adapter(path: str | Path) -> LoraAdapter:
    """The adapter in folder `path` (its config checked, its weight names read); CheckpointError naming the
    field or key otherwise."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    config_file = folder / ADAPTER_CONFIG
    config = JsonObject.load(config_file)
    kind = config.string("peft_type")
    if kind != "LORA":
        raise CheckpointError(f"{config_file}: peft_type {kind!r}: only LoRA adapters (\"LORA\") are merged")
    for name, why in UNSUPPORTED.items():
        value = config.raw(name)
        if value not in (None, False, [], {}, ""):
            raise CheckpointError(f"{config_file}: {name} = {value!r}: {why}")
    bias = config.string("bias")
    if bias not in (None, "none"):
        raise CheckpointError(f"{config_file}: bias = {bias!r}: trained biases (\"all\", \"lora_only\") are not "
                              f"merged")
    rank = config.integer("r", 1, 1 << 16)
    alpha = config.number("lora_alpha", 0, 1e9)
    if rank is None or alpha is None:
        raise CheckpointError(f"{config_file}: r and lora_alpha are required")
    targets = config.raw("target_modules")
    if targets == "all-linear":              # PEFT's shorthand for every linear layer but the output head
        raise CheckpointError(f"{config_file}: target_modules must be a regular expression or a list of module "
                              f"names; 'all-linear' is not merged (its meaning depends on the model class)")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise CheckpointError(f"{config_file}: target_modules is not a valid regular expression ({e})") from None
    elif not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise CheckpointError(f"{config_file}: target_modules must be a regular expression or a list of module "
                              f"names, got {targets!r}")
    patterns = {}
    for name, minimum in (("rank_pattern", 1), ("alpha_pattern", 0)):
        table = config.object(name)
        patterns[name] = {}
        for key in table.keys() if table else ():
            patterns[name][key] = (table.integer(key, 1, 1 << 16) if name == "rank_pattern"
                                   else table.number(key, minimum, 1e9))
    base = config.string("base_model_name_or_path")
    if not base:
        raise CheckpointError(f"{config_file}: base_model_name_or_path is empty: the adapter does not say which "
                              f"checkpoint it was trained on (LeRobot would load random weights here)")
    adapter = LoraAdapter(folder, base, config.string("revision"), targets, config.raw("exclude_modules"),
                          rank, float(alpha), bool(config.boolean("use_rslora")), patterns["rank_pattern"],
                          patterns["alpha_pattern"], list(config.strings("modules_to_save") or []))
    weights = regular_file(folder / ADAPTER_WEIGHTS)
    try:
        handle = safe_open(str(weights), framework="pt")
    except Exception as e:  # noqa: BLE001 - SafetensorError is not exported
        raise CheckpointError(f"{weights}: not a readable safetensors file ({e})") from None
    halves: dict[str, dict[str, str]] = {}
    with handle as f:
        for key in f.keys():
            if not key.startswith(PEFT_PREFIX):
                raise CheckpointError(f"{weights}: key {key} is not under {PEFT_PREFIX!r} (not a PEFT adapter file)")
            name = key[len(PEFT_PREFIX):]
            match = re.fullmatch(r"(?P<module>.+)\.(?P<half>lora_A|lora_B)\.weight", name)
            if match:
                halves.setdefault(match["module"], {})[match["half"]] = key
            elif re.search(r"\.lora_\w+", name):
                raise CheckpointError(f"{weights}: {key}: only lora_A / lora_B weights are merged "
                                      f"(LoRA embeddings, magnitudes or biases are not)")
            elif any(re.match(rf"(^|.*\.){m}\.(weight|bias)$", name) for m in adapter.modules_to_save):
                adapter.saved[name] = key
            else:
                raise CheckpointError(f"{weights}: {key} is neither a LoRA weight nor in modules_to_save")
    for module, pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise CheckpointError(f"{weights}: {module} has {', '.join(sorted(pair))} without its other half")
        adapter.lora[module] = (pair["lora_A"], pair["lora_B"])
    return adapter
