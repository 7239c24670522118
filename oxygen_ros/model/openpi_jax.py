"""openpi's JAX checkpoints (`params/` written by orbax) read without JAX, as openpi's PyTorch names.

A published openpi checkpoint folder holds `params/` (orbax's OCDBT key-value store of zarr arrays, one per
leaf of the params tree: `params.PaliGemma.llm.layers.attn.q_einsum.w`, ...) and `assets/<asset_id>/
norm_stats.json`. tensorstore (Google's reader of the same formats, what orbax itself reads them with) opens
each array; no JAX, flax, orbax or openpi is imported. A leaf stacked over layers is read one layer at a time
(a tensorstore slice reads only that layer's chunks), so the read is streamed: at most one layer's slice is
held besides the model.

The arrays are mapped onto openpi's PyTorch names exactly as openpi's examples/convert_jax_model_to_pytorch.py
maps them (SigLIP and gemma einsum layouts transposed and reshaped into nn.Linear weights, the expert's adaRMS
Dense norms), so checkpoint.py loads the result as it loads that script's output; test/test_checkpoint_openpi_jax.py
holds a shrunk checkpoint written by orbax and the same converted by the script's functions (difference 0).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .files import CheckpointError, present

PARAMS = "params"
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
                 "float64": torch.float64}
_SAFETENSORS_NAMES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16", "float64": "F64"}
_PG = "paligemma_with_expert.paligemma."
_VIS = _PG + "model.vision_tower.vision_model."
_LM = _PG + "model.language_model."
_EX = "paligemma_with_expert.gemma_expert.model."


def is_jax_checkpoint(path: str | Path) -> bool:
    """An openpi JAX checkpoint folder: `params/` written by orbax (its _METADATA or an OCDBT manifest)."""
    params = Path(path) / PARAMS
    return params.is_dir() and (present(params / "_METADATA") or present(params / "manifest.ocdbt"))


@dataclass(frozen=True)
class _Entry:
    """One openpi PyTorch tensor: its shape and dtype (from the arrays' metadata) and how to read it."""
    shape: tuple[int, ...]
    dtype: str
    read: Callable[[], torch.Tensor]

    def get_shape(self):           # the safetensors slice API checkpoint.check_weights reads headers with
        return list(self.shape)

    def get_dtype(self) -> str:
        return _SAFETENSORS_NAMES.get(self.dtype, self.dtype.upper())


class JaxParams:
    """The tensors of an openpi JAX checkpoint under openpi's PyTorch names, read lazily (safetensors' handle
    API: keys, get_slice, get_tensor), so that checkpoint.py reads it as it reads a PyTorch checkpoint."""

    def __init__(self, folder: str | Path):
        import tensorstore as ts

        self.folder = Path(folder)
        self.params = (self.folder / PARAMS).resolve()
        self._ts = ts
        try:
            store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{self.params}/"}).result()
            keys = [k.decode() for k in store.list().result()]
        except Exception as e:  # noqa: BLE001 - tensorstore reports every problem as ValueError/RuntimeError
            raise CheckpointError(f"{self.params}: not a readable orbax OCDBT checkpoint ({e})") from None
        self.arrays: dict[str, tuple[str, str]] = {}          # "PaliGemma/llm/..." -> (driver, key)
        for key in keys:
            for marker, driver in (("/.zarray", "zarr"), ("/zarr.json", "zarr3")):
                if key.endswith(marker):
                    name = key[:-len(marker)]
                    path = name.split(".")
                    if path and path[0] == "params":
                        path = path[1:]
                    if path and path[-1] == "value":              # nnx.State's leaf wrapper (openpi's training)
                        path = path[:-1]
                    self.arrays["/".join(path)] = (driver, name)
        if not self.arrays:
            raise CheckpointError(f"{self.params}: holds no arrays")
        self._opened: dict[str, object] = {}
        self.entries = self._plan()

    def __str__(self) -> str:
        return str(self.params)

    # the safetensors handle API ---------------------------------------------------------------------------
    def keys(self):
        return list(self.entries)

    def get_slice(self, key: str) -> _Entry:
        return self.entries[key]

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.entries[key].read()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._opened.clear()

    # reading -----------------------------------------------------------------------------------------------
    def _array(self, name: str):
        if name not in self.arrays:
            raise CheckpointError(f"{self.params}: no array {name} (not a π0.5 checkpoint?)")
        if name not in self._opened:
            driver, key = self.arrays[name]
            spec = {"driver": driver, "kvstore": {"driver": "ocdbt", "base": f"file://{self.params}/",
                                                  "path": key + "/"}}
            try:
                self._opened[name] = self._ts.open(spec, open=True, read=True).result()
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{self.params}: array {name} cannot be opened ({e})") from None
        return self._opened[name]

    def _read(self, name: str, index: tuple = ()) -> torch.Tensor:
        array = self._array(name)
        data = np.asarray((array[index] if index else array).read().result())
        dtype = str(array.dtype.numpy_dtype) if hasattr(array.dtype, "numpy_dtype") else str(array.dtype)
        if dtype == "bfloat16":                          # ml_dtypes' bfloat16: the same 2 bytes as torch's
            return torch.from_numpy(np.ascontiguousarray(data).view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(data))

    def _meta(self, name: str) -> tuple[tuple[int, ...], str]:
        array = self._array(name)
        return tuple(array.shape), str(array.dtype.name)

    # openpi's conversion, as a plan of lazy reads ---------------------------------------------------------------
    def _plan(self) -> dict[str, _Entry]:
        plan: dict[str, _Entry] = {}

        def add(key: str, name: str, shape: tuple[int, ...], index: tuple = (),
                transform: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
            _, dtype = self._meta(name)
            plan[key] = _Entry(tuple(shape), dtype, lambda: transform(self._read(name, index)).contiguous())

        # SigLIP
        shape, _ = self._meta("PaliGemma/img/embedding/kernel")            # [p, p, 3, width]
        p, width = shape[0], shape[3]
        add(_VIS + "embeddings.patch_embedding.weight", "PaliGemma/img/embedding/kernel", (width, 3, p, p),
            transform=lambda t: t.permute(3, 2, 0, 1))
        add(_VIS + "embeddings.patch_embedding.bias", "PaliGemma/img/embedding/bias", (width,))
        pos, _ = self._meta("PaliGemma/img/pos_embedding")
        add(_VIS + "embeddings.position_embedding.weight", "PaliGemma/img/pos_embedding", (pos[1], width),
            transform=lambda t: t.reshape(-1, width))
        block = "PaliGemma/img/Transformer/encoderblock/"
        depth, _, mlp = self._meta(block + "MlpBlock_0/Dense_0/kernel")[0]
        for i in range(depth):
            layer = _VIS + f"encoder.layers.{i}."
            for ours, theirs in (("layer_norm1", "LayerNorm_0"), ("layer_norm2", "LayerNorm_1")):
                add(layer + f"{ours}.weight", block + f"{theirs}/scale", (width,), (i,))
                add(layer + f"{ours}.bias", block + f"{theirs}/bias", (width,), (i,))
            add(layer + "mlp.fc1.weight", block + "MlpBlock_0/Dense_0/kernel", (mlp, width), (i,), lambda t: t.T)
            add(layer + "mlp.fc1.bias", block + "MlpBlock_0/Dense_0/bias", (mlp,), (i,))
            add(layer + "mlp.fc2.weight", block + "MlpBlock_0/Dense_1/kernel", (width, mlp), (i,), lambda t: t.T)
            add(layer + "mlp.fc2.bias", block + "MlpBlock_0/Dense_1/bias", (width,), (i,))
            attention = block + "MultiHeadDotProductAttention_0/"
            for ours, theirs in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"), ("out_proj", "out")):
                add(layer + f"self_attn.{ours}.weight", attention + f"{theirs}/kernel", (width, width), (i,),
                    lambda t: t.reshape(-1, width).T)
                add(layer + f"self_attn.{ours}.bias", attention + f"{theirs}/bias", (width,), (i,),
                    lambda t: t.reshape(-1))
        add(_VIS + "post_layernorm.weight", "PaliGemma/img/Transformer/encoder_norm/scale", (width,))
        add(_VIS + "post_layernorm.bias", "PaliGemma/img/Transformer/encoder_norm/bias", (width,))
        head, _ = self._meta("PaliGemma/img/head/kernel")
        add(_PG + "model.multi_modal_projector.linear.weight", "PaliGemma/img/head/kernel", (head[1], head[0]),
            transform=lambda t: t.T)
        add(_PG + "model.multi_modal_projector.linear.bias", "PaliGemma/img/head/bias", (head[1],))
        # The gemma VLM (suffix "") and the action expert (suffix "_1")
        vocab, _ = self._meta("PaliGemma/llm/embedder/input_embedding")
        add(_LM + "embed_tokens.weight", "PaliGemma/llm/embedder/input_embedding", vocab[:2])
        for suffix, prefix in (("", _LM), ("_1", _EX)):
            self._gemma(add, suffix, prefix)
        add(_LM + "norm.weight", "PaliGemma/llm/final_norm/scale", self._meta("PaliGemma/llm/final_norm/scale")[0])
        kernel, _ = self._meta("PaliGemma/llm/final_norm_1/Dense_0/kernel")
        add(_EX + "norm.dense.weight", "PaliGemma/llm/final_norm_1/Dense_0/kernel", kernel[::-1],
            transform=lambda t: t.T)
        add(_EX + "norm.dense.bias", "PaliGemma/llm/final_norm_1/Dense_0/bias", (kernel[1],))
        for name in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"):
            kernel, _ = self._meta(f"{name}/kernel")
            add(f"{name}.weight", f"{name}/kernel", kernel[::-1], transform=lambda t: t.T)
            add(f"{name}.bias", f"{name}/bias", (kernel[1],))
        return plan

    def _gemma(self, add, suffix: str, prefix: str) -> None:
        attn = "PaliGemma/llm/layers/attn/"
        (depth, heads, width, head_dim), _ = self._meta(attn + f"q_einsum{suffix}/w")
        kv, _ = self._meta(attn + f"kv_einsum{suffix}/w")                       # [depth, 2, kv heads, width, hd]
        if kv[2] != 1:
            raise CheckpointError(f"{self.params}: kv_einsum{suffix} has {kv[2]} KV heads; π0.5 has 1")
        gating, _ = self._meta(f"PaliGemma/llm/layers/mlp{suffix}/gating_einsum")   # [depth, 2, width, mlp]
        mlp = gating[3]
        for i in range(depth):
            layer = prefix + f"layers.{i}."
            add(layer + "self_attn.q_proj.weight", attn + f"q_einsum{suffix}/w", (heads * head_dim, width), (i,),
                lambda t: t.permute(0, 2, 1).reshape(heads * head_dim, width))
            add(layer + "self_attn.k_proj.weight", attn + f"kv_einsum{suffix}/w", (head_dim, width), (i, 0, 0),
                lambda t: t.T)
            add(layer + "self_attn.v_proj.weight", attn + f"kv_einsum{suffix}/w", (head_dim, width), (i, 1, 0),
                lambda t: t.T)
            # [heads, hd, width] -> [width, heads * hd] (the script's VLM reshape is this when width = heads * hd,
            # as in gemma_2b; its expert transpose is this always)
            add(layer + "self_attn.o_proj.weight", attn + f"attn_vec_einsum{suffix}/w", (width, heads * head_dim),
                (i,), lambda t: t.reshape(heads * head_dim, width).T)
            mlp_name = f"PaliGemma/llm/layers/mlp{suffix}/"
            add(layer + "mlp.gate_proj.weight", mlp_name + "gating_einsum", (mlp, width), (i, 0), lambda t: t.T)
            add(layer + "mlp.up_proj.weight", mlp_name + "gating_einsum", (mlp, width), (i, 1), lambda t: t.T)
            add(layer + "mlp.down_proj.weight", mlp_name + "linear", (width, mlp), (i,), lambda t: t.T)
            norms = "PaliGemma/llm/layers/"
            if suffix:                                  # the expert's adaRMS norms (pi05): Dense layers
                for ours, theirs in (("input_layernorm", "pre_attention_norm_1"),
                                     ("post_attention_layernorm", "pre_ffw_norm_1")):
                    add(layer + f"{ours}.dense.weight", norms + f"{theirs}/Dense_0/kernel", (3 * width, width), (i,),
                        lambda t: t.T)
                    add(layer + f"{ours}.dense.bias", norms + f"{theirs}/Dense_0/bias", (3 * width,), (i,))
            else:
                add(layer + "input_layernorm.weight", norms + "pre_attention_norm/scale", (width,), (i,))
                add(layer + "post_attention_layernorm.weight", norms + "pre_ffw_norm/scale", (width,), (i,))
