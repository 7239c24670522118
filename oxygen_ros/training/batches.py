"""Training batches: per sample, the π0.5 prefix (image + "Task: touch the <colour> cube, State: ...;
\\nAction: "), one scene question with its ground-truth answer (next-token loss on the answer and EOS), and
the expert's action chunk as deltas from the state, normalised (flow-matching loss)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oxygen_ros.model.normalize import EPS, Normalizer
from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.model.preprocess import to_pixels
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.sim.questions import scene_questions
from oxygen_ros.sim.scene import COLOUR_NAMES, COLOURS, Layout, task_prompt

from .attention import TrainPrefixAttention

QUESTION_TEMPLATE = "{text}\n"      # the engine's default question_template


def layout_of(data: dict[str, np.ndarray], i: int) -> Layout:
    n = int((data["colours"][i] >= 0).sum())
    return Layout(tuple(COLOUR_NAMES[c] for c in data["colours"][i][:n]), data["positions"][i][:n].astype(np.float64),
                  data["state"][i].astype(np.float64))


def action_deltas(data: dict[str, np.ndarray]) -> np.ndarray:
    """[N, H, 3] chunk minus the state it starts from (the model predicts deltas; delta_action_mask)."""
    return data["chunk"] - data["state"][:, None, :]


def norm_stats(data: dict[str, np.ndarray]) -> dict:
    """openpi norm_stats.json content for the state and the action deltas (quantiles: π0.5)."""
    def stats(x):
        x = x.reshape(-1, x.shape[-1]).astype(np.float64)
        return {"mean": x.mean(0).tolist(), "std": x.std(0).tolist(),
                "q01": np.quantile(x, 0.01, axis=0).tolist(), "q99": np.quantile(x, 0.99, axis=0).tolist()}
    return {"norm_stats": {"state": stats(data["state"]), "actions": stats(action_deltas(data))}}


def normalize_actions(norm: Normalizer, x: np.ndarray) -> np.ndarray:
    """The inverse of Normalizer.unnormalize_actions (quantiles)."""
    s = norm.actions
    return (x - s.q01) / (s.q99 - s.q01 + EPS) * 2.0 - 1.0


@dataclass
class Batch:
    rows: list[PrefixRow]
    attention: TrainPrefixAttention
    answer_targets: torch.Tensor     # [n] token ids predicted at attention.last_token
    actions: torch.Tensor            # [B, H, action_dim] normalised deltas
    patch_colours: torch.Tensor      # [B, patches] 0 = no cube, 1 + COLOUR_NAMES index


def patch_colours(images: np.ndarray, patch: int, min_pixels: int = 3) -> np.ndarray:
    """Which cube colour each image patch shows (0: none), read from the rendered pixels: the cubes are
    the only saturated colours in the scene. [N, H, W, 3] uint8 -> [N, patches] (row-major, as SigLIP)."""
    n, h, w, _ = images.shape
    rgb = np.array([COLOURS[c] for c in COLOUR_NAMES]) * 255.0
    close = np.abs(images[:, :, :, None, :].astype(np.float32) - rgb).max(-1) < 70      # [N, H, W, C]
    counts = close.reshape(n, h // patch, patch, w // patch, patch, -1).sum(axis=(2, 4)).reshape(n, -1, len(rgb))
    return np.where(counts.max(-1) >= min_pixels, counts.argmax(-1) + 1, 0)


def make_batch(data: dict[str, np.ndarray], index: np.ndarray, tok: Tokenizer, norm: Normalizer,
               rng: np.random.Generator, image_size: int, image_tokens: int, max_token_len: int) -> Batch:
    rows, lengths, bidir, prefix, read, targets = [], [], [], [], [], []
    offset = 0
    for i in index:
        layout = layout_of(data, i)
        colour = layout.colours[int(data["target"][i])]
        state = norm.normalize_state(data["state"][i])
        prompt = tok.action_prompt(task_prompt(colour), state, max_token_len).tokens
        question = scene_questions(layout, data["tip"][i].astype(np.float64), rng)
        q = question[int(rng.integers(len(question)))]
        q_tokens = tok.encode(QUESTION_TEMPLATE.format(text=q.text))
        answer = tok.encode(q.answer) + [tok.eos_id]
        tokens = prompt + q_tokens + answer
        n_prefix = image_tokens + len(prompt)
        n = n_prefix + len(q_tokens) + len(answer)
        # The hidden state at position p predicts token p + 1: the answer's tokens from the one before each.
        first = offset + n - len(answer) - 1
        read.extend(range(first, first + len(answer)))
        targets.extend(answer)
        rows.append(PrefixRow(to_pixels(data["image"][i], image_size)[None], torch.tensor(tokens)))
        lengths.append(n)
        bidir.append(n_prefix)          # upstream π0.5: the whole prefix is bidirectional; Q&A causal
        prefix.append(n_prefix)
        offset += n
    actions = normalize_actions(norm, action_deltas({k: data[k][index] for k in ("chunk", "state")}))
    patch = data["image"].shape[1] * image_size // data["image"].shape[1] // int(image_tokens ** 0.5)
    return Batch(rows, TrainPrefixAttention(lengths, bidir, prefix, torch.tensor(read)), torch.tensor(targets),
                 torch.tensor(actions, dtype=torch.float32),
                 torch.tensor(patch_colours(data["image"][index], patch)))
