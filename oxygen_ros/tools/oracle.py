"""Run this package's π0.5 on an oracle case and write its outputs under the case's array names.

    python -m oxygen_ros.tools.oracle CASE_DIR --out OUT.npz

CASE_DIR holds config.json, model.safetensors (loaded through the real checkpoint loader) and inputs.npz
(see ../shared/oracle/README.md). Written arrays, in the case's padded layouts:
  actions, denoise_x_t, denoise_v_t, denoise_time, first_step_velocity,
  prefix_kv_key_{l} / prefix_kv_value_{l} [B, kv_heads, P, head_dim] (valid positions filled, zeros at
  masked ones: this package never computes masked tokens), prefix_pad_mask, prefix_position_ids,
  prefill_len, prefix_last_valid_index, prefix_last_valid_logits (log-softmax),
  and, when the case generates text, text_tokens_correct / text_logprobs_correct: greedy tokens whose first
  logits come from the last *valid* prefix token (the OxyGen reference reads them at prefill_len - 1 of the
  padded prefix, inside a masked camera slot whenever one is absent; we implement the correct behaviour).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.kernels.meta import token_slots
from oxygen_ros.model import inference
from oxygen_ros.model.checkpoint import load_pi05
from oxygen_ros.model.config import from_oracle_json
from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.model.preprocess import to_pixels


def run_case(case_dir: str | Path, backend: str | None = None) -> dict[str, np.ndarray]:
    case_dir = Path(case_dir)
    cfg = from_oracle_json(case_dir / "config.json")
    raw = json.loads((case_dir / "config.json").read_text())
    model = load_pi05(case_dir, cfg)
    inp = dict(np.load(case_dir / "inputs.npz"))
    slots = cfg.camera_slots
    batch, max_len = inp["tokenized_prompt"].shape
    n_img = cfg.image_tokens
    padded_len = len(slots) * n_img + max_len

    rows, pad_masks = [], []
    for b in range(batch):
        valid_slots = [s for s in slots if bool(inp[f"image_mask_{s}"][b])]
        images = torch.stack([to_pixels(inp[f"image_{s}"][b], cfg.vision.image_size) for s in valid_slots]) \
            if valid_slots else torch.zeros(0, 3, cfg.vision.image_size, cfg.vision.image_size)
        token_mask = inp["tokenized_prompt_mask"][b].astype(bool)
        tokens = torch.tensor(inp["tokenized_prompt"][b][token_mask], dtype=torch.long)
        rows.append(PrefixRow(images, tokens))
        pad = np.concatenate([np.full(n_img, bool(inp[f"image_mask_{s}"][b])) for s in slots] + [token_mask])
        pad_masks.append(pad)
    pad_masks = np.stack(pad_masks)

    total = sum(model.prefix_length(r) for r in rows)
    n_text = int(raw.get("num_text_tokens", 0))
    cache = inference.ContiguousCache(model, total + batch * (n_text + 1) + 64)
    pre = inference.prefill(model, cache, rows, backend)
    record: list = []
    noise = torch.from_numpy(inp["noise"]).float()
    actions = inference.sample_actions(model, cache, pre.segments, noise, cfg.num_denoise_steps, backend, record)

    out: dict[str, np.ndarray] = {
        "actions": actions.numpy(),
        "denoise_time": np.array([t for t, _, _ in record], dtype=np.float32),
        "denoise_x_t": np.stack([x.numpy() for _, x, _ in record]),
        "denoise_v_t": np.stack([v.numpy() for _, _, v in record]),
        "first_step_velocity": record[0][2].numpy(),
        "prefix_pad_mask": pad_masks,
        "prefix_position_ids": np.cumsum(pad_masks, axis=1) - 1,
        "prefill_len": pad_masks.sum(1).astype(np.int64),
        "prefix_last_valid_index": np.array([np.nonzero(m)[0][-1] for m in pad_masks], dtype=np.int64),
        "prefix_last_valid_logits": torch.log_softmax(model.logits(pre.hidden), dim=-1).numpy(),
    }
    kvh, hd, bs = cfg.vlm.num_kv_heads, cfg.vlm.head_dim, cache.kv.block_size
    for layer in range(cfg.vlm.depth):
        for name, store in (("key", cache.kv.k), ("value", cache.kv.v)):
            padded = np.zeros((batch, kvh, padded_len, hd), dtype=np.float32)
            flat = store[layer].reshape(-1, kvh, hd)
            for b, seg in enumerate(pre.segments):
                slots_idx = token_slots(seg.blocks, bs, 0, seg.length)
                padded[b][:, np.nonzero(pad_masks[b])[0]] = flat[slots_idx].permute(1, 0, 2).numpy()
            out[f"prefix_kv_{name}_{layer}"] = padded

    if n_text:
        eos = int(raw.get("eos_token", -1))
        tokens, logprobs = [], []
        for b, seg in enumerate(pre.segments):
            logits: list = []
            toks = inference.greedy_generate(model, cache, seg, pre.hidden[b], [], n_text,
                                             eos if eos >= 0 else None, backend, logits)
            tokens.append(toks + [eos] * (n_text - len(toks)))
            lp = torch.log_softmax(torch.stack(logits), dim=-1).numpy()
            logprobs.append(np.concatenate([lp, np.zeros((n_text - len(lp), lp.shape[1]), np.float32)]))
        out["text_tokens_correct"] = np.array(tokens, dtype=np.int64)
        out["text_logprobs_correct"] = np.stack(logprobs)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case_dir", help="oracle case folder (config.json, model.safetensors, inputs.npz)")
    parser.add_argument("--out", required=True, help="output .npz")
    parser.add_argument("--backend", choices=["torch", "triton"], default=None,
                        help="attention implementation (default: triton on CUDA, torch on the CPU)")
    args = parser.parse_args(argv)
    torch.set_float32_matmul_precision("highest")
    out = run_case(args.case_dir, args.backend)
    np.savez(args.out, **out)
    print(f"wrote {len(out)} arrays to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
