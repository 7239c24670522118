"""Write test/data/lora/: PEFT LoRA adapters on the tiny LeRobot pi05 checkpoint (test/data/lerobot_model) and
PEFT's own merged weights, the reference test/test_checkpoint_lora.py compares the engine's merge with.

Run in a side environment that has peft (with its transformers and accelerate), beside this package's torch:
    python -m pip install --target <side>/peft_pkgs --no-deps peft==0.21.2 transformers accelerate regex tokenizers psutil
    PYTHONPATH=<side>/peft_pkgs python scripts/make_lora_testdata.py

LeRobot itself is not needed (and is heavy): PEFT sees a module tree with LeRobot's PI05Policy names
(`model.paligemma_with_expert.gemma_expert.model.layers.0.self_attn.q_proj`, ...) built from the checkpoint's
keys, nn.Linear where LeRobot has one, which is all PEFT's target matching, LoRA layers and merge look at.
Each adapter's B is random (PEFT initialises it to 0, a no-op merge) so that the merge is exercised.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "test" / "data" / "lerobot_model"
OUT = ROOT / "test" / "data" / "lora"
BASE_ID = "lerobot-tests/pi05_tiny_base"      # the adapters' base_model_name_or_path (served by the tests' hub)
LEROBOT_PI05_TARGETS = (r"(.*\.gemma_expert\..*\.self_attn\.(q|v)_proj|model\.(state_proj|action_in_proj|"
                        r"action_out_proj|action_time_mlp_in|action_time_mlp_out))")   # PI05Policy's default


class Leaf(nn.Module):
    """A module holding plain parameters (norms, embeddings, the patch conv): not a LoRA target here."""


def module_tree(state: dict[str, torch.Tensor]) -> nn.Module:
    root = nn.Module()
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        module, _, param = key.rpartition(".")
        modules.setdefault(module, {})[param] = value
    for name, params in sorted(modules.items()):
        parent = root
        parts = name.split(".")
        for part in parts[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        weight = params.get("weight")
        if weight is not None and weight.dim() == 2 and set(params) <= {"weight", "bias"} \
                and "embed_tokens" not in name and "lm_head" not in name and "position_embedding" not in name:
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in params)
        else:
            layer = Leaf()
            for p in params:
                layer.register_parameter(p, nn.Parameter(torch.empty_like(params[p])))
        parent.add_module(parts[-1], layer)
    root.load_state_dict(state, strict=True)
    return root


def write(name: str, config: LoraConfig, seed: int) -> None:
    state = load_file(str(BASE / "model.safetensors"))
    tree = module_tree(state).float()
    tree.name_or_path = BASE_ID                   # what LeRobot's wrap_with_peft sets: the adapter's base
    model = get_peft_model(tree, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_" in key or "modules_to_save" in key:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(str(folder))
    (folder / "README.md").unlink()              # PEFT's model card template
    for f in BASE.iterdir():                       # LeRobot saves the policy's config and processors beside it
        if f.name != "model.safetensors" and f.name != "reference.npz":
            shutil.copy(f, folder / f.name)
    merged = model.merge_and_unload().state_dict()
    save_file({k: v.contiguous() for k, v in merged.items()}, str(folder / "peft_merged.safetensors"),
              metadata={"peft": peft.__version__, "torch": torch.__version__})
    print(folder, sorted(p.name for p in folder.iterdir()))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    # LeRobot's pi05 default: the expert's q/v and the action projections (a regex string), with per-module
    # ranks and alphas and a module trained in full.
    write("lerobot_default", LoraConfig(
        r=4, lora_alpha=8, target_modules=LEROBOT_PI05_TARGETS, modules_to_save=["model.time_mlp_in"],
        rank_pattern={"action_out_proj": 2}, alpha_pattern={r"layers\.1\.self_attn\.v_proj": 3}, revision="main"), seed=1)
    # A list of module names (suffix match), rank-stabilised scaling, VLM and vision layers too.
    write("rslora_list", LoraConfig(
        r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "o_proj", "down_proj", "fc1", "linear"]), seed=2)
    for folder in OUT.iterdir():
        config = json.loads((folder / "adapter_config.json").read_text())
        print(folder.name, {k: config[k] for k in ("peft_type", "r", "lora_alpha", "use_rslora", "target_modules")})


if __name__ == "__main__":
    main()
