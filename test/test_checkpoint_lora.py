"""PEFT LoRA adapters merged at load (model/lora.py) against PEFT's own merge_and_unload on adapters PEFT wrote
(test/data/lora/, scripts/make_lora_testdata.py) for the tiny LeRobot checkpoint; the base named by the adapter
is fetched from a hub served on 127.0.0.1; every refusal in one line naming the field."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from oxygen_ros.model.checkpoint import check_weights, checkpoint_settings, lerobot_name, load_pi05
from oxygen_ros.model.download import resolve_checkpoint
from oxygen_ros.model.files import CheckpointError
from test_checkpoint_sources import LEROBOT, LEROBOT_CONFIG, FakeHub

LORA = Path(__file__).parent / "data" / "lora"
BASE_ID = "lerobot-tests/pi05_tiny_base"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The adapters' base on a hub (HF_ENDPOINT), cached under tmp_path."""
    from huggingface_hub import constants

    fake = FakeHub({BASE_ID: LEROBOT, "someone/pi05_lora": LORA / "lerobot_default"})
    monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    yield fake
    fake.close()


def adapter_copy(tmp_path: Path, name: str = "lerobot_default", **config_changes) -> Path:
    folder = tmp_path / name
    shutil.copytree(LORA / name, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(config_changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", ["lerobot_default", "rslora_list"])
def test_the_merge_equals_peft_merge_and_unload(hub, name):
    """Difference 0: the same float32 operations as PEFT's merge, W + (B @ A) * scale; LeRobot's default
    targets (a regex string, with rank_pattern, alpha_pattern and modules_to_save) and a rank-stabilised list."""
    merged = load_pi05(LORA / name, LEROBOT_CONFIG)
    reference = load_file(str(LORA / name / "peft_merged.safetensors"))
    base = load_file(str(LEROBOT / "model.safetensors"))
    changed = 0
    for local, param in merged.named_parameters():
        key = lerobot_name(local)
        assert torch.equal(param, reference[key]), key
        changed += not torch.equal(reference[key], base[key])
    # lerobot_default: the expert's q/v in 2 layers, action_in/out_proj, time_mlp_in's weight and bias;
    # rslora_list: q_proj (VLM 2, expert 2, vision 1), o_proj (2 + 2), down_proj (2 + 2), fc1, the projector.
    assert changed == {"lerobot_default": 8, "rslora_list": 15}[name]


def test_an_adapter_named_on_the_hub_loads_with_its_base(hub):
    folder = resolve_checkpoint("someone/pi05_lora")
    assert (folder / "adapter_model.safetensors").is_file() and not (folder / "peft_merged.safetensors").exists()
    a, b = load_pi05(folder, LEROBOT_CONFIG), load_pi05(LORA / "lerobot_default", LEROBOT_CONFIG)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_the_adapter_folders_config_is_the_policys(hub, tmp_path):
    folder = adapter_copy(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["chunk_size"] = 7
    (folder / "config.json").write_text(json.dumps(config))
    assert checkpoint_settings(folder)["action_horizon"] == 7
    assert checkpoint_settings(LEROBOT)["action_horizon"] == 10


@pytest.mark.parametrize("changes, message", [
    ({"use_dora": True}, "use_dora = True: DoRA"),
    ({"peft_type": "LOHA"}, "peft_type 'LOHA': only LoRA adapters"),
    ({"bias": "lora_only"}, "bias = 'lora_only': trained biases"),
    ({"layers_to_transform": [0]}, "layers_to_transform = \\[0\\]: layer selections"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out = True"),
    ({"kasa_config": {"rank": 4}}, "kasa_config = \\{'rank': 4\\}: KaSA adapters"),
    ({"base_model_name_or_path": None}, "base_model_name_or_path is empty"),
    ({"target_modules": "all-linear"}, "target_modules must be a regular expression or a list"),
    ({"target_modules": r".*\.gemma_expert\..*\.self_attn\.q_proj|model\.action_(in|out)_proj"},
     "gemma_expert.model.layers.1.self_attn.v_proj, which target_modules does not select"),
    ({"target_modules": ["q_proj", "v_proj", "action_in_proj", "action_out_proj"]},
     "selects .*vision_model.encoder.layers.0.self_attn.q_proj but the adapter holds no weights for it"),
    ({"rank_pattern": {}}, "action_out_proj: lora_A \\[2, 32\\] and lora_B \\[32, 2\\], expected \\[4, 32\\]"),
    ({"modules_to_save": []}, "model.time_mlp_in.bias is neither a LoRA weight nor in modules_to_save"),
])
def test_adapters_the_merge_does_not_implement_are_refused_in_one_line(hub, tmp_path, changes, message):
    folder = adapter_copy(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message) as e:
        check_weights(folder, LEROBOT_CONFIG)
    assert "\n" not in str(e.value)


def test_lora_weights_for_a_module_the_model_does_not_merge_are_refused(hub, tmp_path):
    folder = adapter_copy(tmp_path, target_modules=["lm_head", "q_proj", "o_proj", "down_proj", "fc1", "linear"])
    weights = load_file(str(folder / "adapter_model.safetensors"))
    head = "base_model.model.model.paligemma_with_expert.paligemma.lm_head"
    weights[head + ".lora_A.weight"] = torch.zeros(4, 64)
    weights[head + ".lora_B.weight"] = torch.zeros(1000, 4)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match="paligemma.lm_head, which is not a linear layer the model merges"):
        check_weights(folder, LEROBOT_CONFIG)


def test_an_adapter_folder_with_full_weights_too_is_ambiguous(hub, tmp_path):
    folder = adapter_copy(tmp_path)
    shutil.copy(LEROBOT / "model.safetensors", folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="both model.safetensors and a PEFT adapter"):
        check_weights(folder, LEROBOT_CONFIG)


def test_a_given_base_replaces_the_one_the_adapter_names(tmp_path):
    """checkpoint_base: the adapter's base from a local copy (its adapter_config.json names a repo nobody can
    reach here: no hub is served): the merge equals PEFT's, as with the named base; a base given for a
    checkpoint that is not an adapter is refused in one line."""
    folder = adapter_copy(tmp_path, base_model_name_or_path="nobody/unreachable_base")
    merged = load_pi05(folder, LEROBOT_CONFIG, base=LEROBOT)
    reference = load_file(str(LORA / "lerobot_default" / "peft_merged.safetensors"))
    for local, param in merged.named_parameters():
        assert torch.equal(param, reference[lerobot_name(local)]), local
    assert check_weights(folder, LEROBOT_CONFIG, LEROBOT)[1]
    with pytest.raises(CheckpointError, match="not a PEFT LoRA adapter"):
        check_weights(LEROBOT, LEROBOT_CONFIG, LEROBOT)


def test_the_engine_node_fetches_the_base_an_adapter_names_as_its_own_download(hub, tmp_path):
    """An adapter folder whose base is a hub id: the engine node fetches the base before the load, as it fetches
    the checkpoint (its status `checkpoint_base download` in /diagnostics), and serves the merged weights."""
    from test_checkpoint_sources import Published, engine_node

    config = tmp_path / "model.json"
    config.write_text(json.dumps(LEROBOT_CONFIG.to_dict()))
    with engine_node({"checkpoint": str(LORA / "lerobot_default"), "model": str(config)}) as node:
        node._diag_pub = published = Published()
        node.trigger_configure()
        assert node.engine is not None, node.failure
        node._publish_diagnostics()
        merged = dict(node.engine.runner.model.named_parameters())
    statuses = [s for _, s in published.statuses("oxygen_ros: checkpoint_base download")]
    assert statuses and statuses[-1][2].startswith(f"downloaded {BASE_ID}"), statuses
    reference = load_file(str(LORA / "lerobot_default" / "peft_merged.safetensors"))
    for local, param in merged.items():
        assert torch.equal(param.float(), reference[lerobot_name(local)]), local
