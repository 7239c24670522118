"""openpi's JAX checkpoints served without JAX (model/openpi_jax.py): a shrunk π0.5 written by orbax
(test/data/openpi_jax/pi05_tiny: params/ OCDBT, assets/<asset_id>/norm_stats.json) loads equal, difference 0, to
the same checkpoint converted by openpi's own conversion functions (pi05_tiny_converted; both made by
scripts/make_openpi_jax_testdata.py), is streamed a layer at a time, and imports nothing from JAX or openpi."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oxygen_ros.model.checkpoint import check_weights, load_pi05
from oxygen_ros.model.config import GemmaConfig, Pi05Config, VisionConfig
from oxygen_ros.model.files import CheckpointError
from oxygen_ros.model.openpi_jax import JaxParams, is_jax_checkpoint

DATA = Path(__file__).parent / "data" / "openpi_jax"
JAX = DATA / "pi05_tiny"
CONVERTED = DATA / "pi05_tiny_converted"
CONFIG = Pi05Config(
    vlm=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16),
    expert=GemmaConfig(width=16, depth=2, mlp_dim=32, num_heads=2, num_kv_heads=1, head_dim=16),
    vision=VisionConfig(width=16, depth=2, mlp_dim=32, num_heads=2, patch_size=14, image_size=28),
    vocab_size=64, action_dim=8, action_horizon=4, max_token_len=16, num_denoise_steps=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_to_openpis_conversion(dtype):
    """The stored bfloat16 values, mapped as the conversion maps them, then cast to the serving dtype: equal to
    the conversion's float32 output cast the same way (transposes and reshapes only: difference 0)."""
    assert is_jax_checkpoint(JAX) and not is_jax_checkpoint(CONVERTED)
    ours, theirs = load_pi05(JAX, CONFIG, dtype=dtype), load_pi05(CONVERTED, CONFIG, dtype=dtype)
    assert ours.time_grid == theirs.time_grid == "openpi"
    pairs = list(zip(ours.named_parameters(), theirs.named_parameters()))
    assert len(pairs) == 91                       # every tensor of the converted file is a parameter
    for (name, a), (_, b) in pairs:
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_layers_are_read_one_at_a_time():
    """A tensor stacked over layers is read as that layer's slice (the read streams: one layer held)."""
    params = JaxParams(JAX)
    read = []
    real = params._read
    params._read = lambda name, index=(): read.append((name, index)) or real(name, index)
    q1 = params.get_tensor("paligemma_with_expert.paligemma.model.language_model.layers.1.self_attn.q_proj.weight")
    assert read == [("PaliGemma/llm/layers/attn/q_einsum/w", (1,))]
    assert tuple(q1.shape) == (32, 32)


def test_its_assets_statistics_are_read_with_openpis_rule():
    """norm_stats = the checkpoint folder, asset_id = its assets/<asset_id>: openpi's quantile rule."""
    import numpy as np

    from oxygen_ros.model.normalize import load_normalizer

    normalizer = load_normalizer(JAX, "tiny_robot")
    # openpi: (x - q01) / (q99 - q01 + 1e-6) * 2 - 1
    assert np.allclose(normalizer.normalize_state(np.array([-1.5, 2.5, 0.5] + [0.5] * 5)), [-1, 1, 0] + [0] * 5,
                       atol=1e-6)


def test_a_wrong_config_or_damaged_params_is_refused_in_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="do not match the model config") as e:
        check_weights(JAX, CONFIG.replace(vocab_size=65))
    assert "\n" not in str(e.value)
    damaged = tmp_path / "pi05_tiny"
    shutil.copytree(JAX, damaged)
    (damaged / "params" / "manifest.ocdbt").write_bytes(b"not a manifest")
    with pytest.raises(CheckpointError, match="not a readable orbax OCDBT checkpoint") as e:
        check_weights(damaged, CONFIG)
    assert "\n" not in str(e.value)


def test_nothing_from_jax_or_openpi_is_imported():
    code = ("import sys; from pathlib import Path; from oxygen_ros.model.checkpoint import load_pi05; "
            "from test_checkpoint_openpi_jax import CONFIG, JAX; load_pi05(JAX, CONFIG); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'orbax', 'openpi')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_a_jax_checkpoint_on_the_hub_is_fetched_whole_and_served(tmp_path):
    """params/ (nested OCDBT files) and assets/ are among the files fetched for a hub id."""
    from test_checkpoint_sources import FakeHub

    from oxygen_ros.model.download import resolve_checkpoint

    hub = FakeHub({"someone/pi05_jax": JAX})
    try:
        folder = resolve_checkpoint("someone/pi05_jax", hub_cache=tmp_path, endpoint=hub.endpoint)
    finally:
        hub.close()
    expected = sorted(str(p.relative_to(JAX)) for p in JAX.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == \
        [name for name in expected if name.startswith(("params/", "assets/"))]
    for (name, a), (_, b) in zip(load_pi05(folder, CONFIG).named_parameters(),
                                 load_pi05(CONVERTED, CONFIG).named_parameters()):
        assert torch.equal(a, b), name
