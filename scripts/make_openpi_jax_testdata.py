"""Write test/data/openpi_jax/: a shrunk π0.5 checkpoint as openpi publishes one (params/ written by orbax, OCDBT;
assets/<asset_id>/norm_stats.json) and the same converted by openpi's own conversion functions
(examples/convert_jax_model_to_pytorch.py: slice_paligemma_state_dict, slice_gemma_state_dict), the reference
test/test_checkpoint_openpi_jax.py compares the JAX-free reader with.

Run in a side environment with JAX on the CPU, orbax-checkpoint and safetensors (not this package's venv), given
a checkout of openpi (its conversion functions are executed from that file, not copied):
    python3.12 -m venv <side>/orbax && <side>/orbax/bin/pip install "jax[cpu]" orbax-checkpoint safetensors
    <side>/orbax/bin/python scripts/make_openpi_jax_testdata.py <openpi checkout>

The shapes are openpi's (gemma and SigLIP einsum layouts, pi05's adaRMS Dense norms) at a small size; the VLM's
width equals heads x head_dim as in gemma_2b (the conversion's o_proj reshape assumes it); weights are stored in
bfloat16 as the published checkpoints are, restored in float32 as the conversion restores them.
"""
from __future__ import annotations

import ast
import json
import shutil
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "test" / "data" / "openpi_jax"
# The shrunk model (test/test_checkpoint_openpi_jax.py builds the same Pi05Config).
VLM = dict(width=32, depth=2, mlp=64, heads=2, kv_heads=1, head_dim=16)
EXPERT = dict(width=16, depth=2, mlp=32, heads=2, kv_heads=1, head_dim=16)
VISION = dict(width=16, depth=2, mlp=32, heads=2, patch=14, tokens=4)
VOCAB, ACTION_DIM = 64, 8


def openpi_params(rng: np.random.Generator) -> dict:
    """openpi's pi05 params tree (Pi0.init with pi05=True), random values."""
    def a(*shape):
        return rng.normal(0, 0.2, shape).astype(np.float32)

    v, g, e = VISION, VLM, EXPERT
    dv = v["width"] // v["heads"]
    block = {
        "LayerNorm_0": {"scale": a(v["depth"], v["width"]), "bias": a(v["depth"], v["width"])},
        "LayerNorm_1": {"scale": a(v["depth"], v["width"]), "bias": a(v["depth"], v["width"])},
        "MlpBlock_0": {"Dense_0": {"kernel": a(v["depth"], v["width"], v["mlp"]), "bias": a(v["depth"], v["mlp"])},
                       "Dense_1": {"kernel": a(v["depth"], v["mlp"], v["width"]), "bias": a(v["depth"], v["width"])}},
        "MultiHeadDotProductAttention_0": {
            **{n: {"kernel": a(v["depth"], v["width"], v["heads"], dv), "bias": a(v["depth"], v["heads"], dv)}
               for n in ("query", "key", "value")},
            "out": {"kernel": a(v["depth"], v["heads"], dv, v["width"]), "bias": a(v["depth"], v["width"])}},
    }
    img = {"embedding": {"kernel": a(v["patch"], v["patch"], 3, v["width"]), "bias": a(v["width"])},
           "pos_embedding": a(1, v["tokens"], v["width"]),
           "Transformer": {"encoderblock": block,
                           "encoder_norm": {"scale": a(v["width"]), "bias": a(v["width"])}},
           "head": {"kernel": a(v["width"], g["width"]), "bias": a(g["width"])}}

    def attn(c, suffix):
        return {f"q_einsum{suffix}": {"w": a(c["depth"], c["heads"], c["width"], c["head_dim"])},
                f"kv_einsum{suffix}": {"w": a(c["depth"], 2, c["kv_heads"], c["width"], c["head_dim"])},
                f"attn_vec_einsum{suffix}": {"w": a(c["depth"], c["heads"], c["head_dim"], c["width"])}}

    def dense(c, *depth):
        return {"Dense_0": {"kernel": a(*depth, c["width"], 3 * c["width"]), "bias": a(*depth, 3 * c["width"])}}

    layers = {"attn": {**attn(g, ""), **attn(e, "_1")},
              "mlp": {"gating_einsum": a(g["depth"], 2, g["width"], g["mlp"]), "linear": a(g["depth"], g["mlp"], g["width"])},
              "mlp_1": {"gating_einsum": a(e["depth"], 2, e["width"], e["mlp"]),
                        "linear": a(e["depth"], e["mlp"], e["width"])},
              "pre_attention_norm": {"scale": a(g["depth"], g["width"])},
              "pre_ffw_norm": {"scale": a(g["depth"], g["width"])},
              "pre_attention_norm_1": dense(e, e["depth"]), "pre_ffw_norm_1": dense(e, e["depth"])}
    llm = {"embedder": {"input_embedding": a(VOCAB, g["width"])}, "layers": layers,
           "final_norm": {"scale": a(g["width"])}, "final_norm_1": dense(e)}
    projections = {"action_in_proj": {"kernel": a(ACTION_DIM, e["width"]), "bias": a(e["width"])},
                   "action_out_proj": {"kernel": a(e["width"], ACTION_DIM), "bias": a(ACTION_DIM)},
                   "time_mlp_in": {"kernel": a(e["width"], e["width"]), "bias": a(e["width"])},
                   "time_mlp_out": {"kernel": a(e["width"], e["width"]), "bias": a(e["width"])}}
    return {"PaliGemma": {"img": img, "llm": llm}, **projections}


def conversion_functions(openpi: Path) -> types.SimpleNamespace:
    """slice_paligemma_state_dict and slice_gemma_state_dict from openpi's conversion script, executed as
    written, with numpy standing in for torch.from_numpy (the only torch call they make)."""
    source = (openpi / "examples" / "convert_jax_model_to_pytorch.py").read_text()
    tree = ast.parse(source)
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name in ("slice_paligemma_state_dict", "slice_gemma_state_dict")]
    namespace = {"torch": types.SimpleNamespace(from_numpy=np.asarray, Tensor=type(None)), "np": np}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(openpi / "examples" / "convert_jax_model_to_pytorch.py"),
                 "exec"), namespace)
    return types.SimpleNamespace(**{n.name: namespace[n.name] for n in wanted})


def flatten(tree: dict, sep: str = "/", prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, sep, prefix + key + sep))
        else:
            out[prefix + key] = value
    return out


def main(openpi: Path) -> None:
    rng = np.random.default_rng(0)
    params = openpi_params(rng)
    folder = OUT / "pi05_tiny"       # "pi05" in the name: the conversion reads the adaRMS norms by the folder's name
    shutil.rmtree(folder, ignore_errors=True)
    stored = {k: jnp.asarray(v, dtype=jnp.bfloat16) for k, v in flatten(params, "\0").items()}
    tree: dict = {}
    for key, value in stored.items():
        node = tree
        parts = key.split("\0")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    with ocp.PyTreeCheckpointer() as checkpointer:           # what openpi's checkpoints.save_state writes
        checkpointer.save((folder / "params").resolve(), {"params": tree})
    # orbax's commit marker names the absolute folder it wrote: kept without the machine's path
    (folder / "params" / "commit_success.txt").write_text("Checkpoint commit was successful to params")
    assets = folder / "assets" / "tiny_robot"
    assets.mkdir(parents=True)
    stats = {"norm_stats": {key: {"mean": [0.1] * ACTION_DIM, "std": [2.0] * ACTION_DIM, "q01": [-1.5] * ACTION_DIM,
                                  "q99": [2.5] * ACTION_DIM} for key in ("state", "actions")}}
    (assets / "norm_stats.json").write_text(json.dumps(stats, indent=2))

    # Restored as the conversion restores them (openpi.models.model.restore_params, dtype float32), then its
    # functions, then its projection transposes (convert_pi0_checkpoint).
    with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore((folder / "params").resolve())["params"]
    restored = {k: np.asarray(v, dtype=np.float32) for k, v in flatten(restored, "\0").items()}
    paligemma = {k.split("\0", 1)[1].replace("\0", "/"): v for k, v in restored.items() if k.startswith("PaliGemma\0")}
    fns = conversion_functions(openpi)
    vision = types.SimpleNamespace(hidden_size=VISION["width"], num_hidden_layers=VISION["depth"])
    text = types.SimpleNamespace(hidden_size=VLM["width"], num_hidden_layers=VLM["depth"],
                                 num_attention_heads=VLM["heads"], head_dim=VLM["head_dim"])
    converted, expert = fns.slice_paligemma_state_dict(paligemma, types.SimpleNamespace(vision_config=vision,
                                                                                         text_config=text))
    expert_config = types.SimpleNamespace(width=EXPERT["width"], depth=EXPERT["depth"], num_heads=EXPERT["heads"],
                                          head_dim=EXPERT["head_dim"])
    converted.update(fns.slice_gemma_state_dict(expert, expert_config, num_expert=1, checkpoint_dir=str(folder),
                                                pi05=True))
    for name in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"):
        converted[f"{name}.weight"] = restored[f"{name}\0kernel"].T
        converted[f"{name}.bias"] = restored[f"{name}\0bias"]
    reference = OUT / "pi05_tiny_converted"
    shutil.rmtree(reference, ignore_errors=True)
    reference.mkdir(parents=True)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in converted.items()},
              str(reference / "model.safetensors"), metadata={"format": "pt"})
    print(folder, sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()), "bytes;",
          reference, len(converted), "tensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
