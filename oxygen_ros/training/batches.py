"""Training batches: per sample, the π0.5 prefix (image + "Task: touch the <colour> cube, State: ...;
\\nAction: "), one scene question with its ground-truth answer (next-token loss on the answer and EOS), and
the expert's action chunk as deltas from the state, normalised (flow-matching loss). `make_joint_batch`: the
hierarchical demo model's rows (pi052's joint format: subtask, progress memory and questions as forks)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oxygen_ros.model import pi052
from oxygen_ros.model.normalize import EPS, Normalizer
from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.model.preprocess import to_pixels
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.sim.expert import expert_chunk, inverse_kinematics
from oxygen_ros.sim.questions import scene_questions
from oxygen_ros.sim.scene import COLOUR_NAMES, COLOURS, TOUCHED_SHADE, Layout, task_prompt, touch_point
from oxygen_ros.sim.tasks import ORDERS, MultiStepTask, named_task, progress_memory, spatial_task, subtask_text

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
    patch_colours: torch.Tensor      # [B, patches] 0 = no cube, else a class of patch_colours
    given_rows: torch.Tensor | None = None   # [B] prefix conditioning: leading rows of `actions` given clean


# Prefix conditioning (training-time RTC): the rows a robot plays while a chunk computes come from the chunk
# planned one observation earlier, which is not the plan of this observation: it started from where the
# arm was then (and the arm lags its commands), aimed where that frame said, now and then at another cube.
STALE_START_NOISE = 0.06       # rad per joint: where the earlier plan started, relative to this state
STALE_GOAL_NOISE = 0.10        # rad per joint: where it aimed, relative to the named cube
STALE_WRONG_CUBE = 0.2         # how often it aimed at another cube of the scene
TURN_ROWS = 4                  # rows over which the continuation turns from the earlier plan's velocity


def conditioned_chunk(state: np.ndarray, goal: np.ndarray, other_goals: list[np.ndarray], delay: int,
                      horizon: int, rng: np.random.Generator) -> np.ndarray:
    """A chunk [horizon, 3] of joint targets for prefix conditioning: its first `delay` rows are an earlier
    plan's (the scripted expert's line from a perturbed start toward a perturbed, sometimes wrong, goal), the
    rest turn from that plan's velocity to the expert's toward the named cube over TURN_ROWS rows (velocity
    mixed linearly, then the expert re-planning from each row). The expert's own chunk continues its first
    rows in a straight line, so a model trained on it learns to extrapolate the given rows and ignore the
    image (measured: it follows a prefix aimed at another cube); a stale plan and a continuation that turns
    to the named cube teach it to continue the rows it is given and still go where the image and the prompt
    say, and the turn keeps the velocity continuous where the given rows end."""
    if delay == 0:
        return expert_chunk(state, goal, horizon)
    aim = other_goals[int(rng.integers(len(other_goals)))] if other_goals and rng.random() < STALE_WRONG_CUBE else goal
    start = state + rng.normal(0.0, STALE_START_NOISE, size=state.shape)
    earlier = np.concatenate([start[None], expert_chunk(start, aim + rng.normal(0.0, STALE_GOAL_NOISE,
                                                                                 size=state.shape), delay)])
    velocity, rows = earlier[-1] - earlier[-2], [earlier[-1]]
    for k in range(horizon - delay):
        w = min(1.0, (k + 1) / (TURN_ROWS + 1))
        expert_step = expert_chunk(rows[-1], goal, 1)[0] - rows[-1]
        rows.append(rows[-1] + (1 - w) * velocity + w * expert_step)
    return np.concatenate([earlier[1:], rows[1:]])


def patch_colours(images: np.ndarray, patch: int, min_pixels: int = 3,
                  touched: np.ndarray | None = None) -> np.ndarray:
    """Which cube colour each image patch shows (0: none, else 1 + COLOUR_NAMES index), read from the rendered
    pixels: the cubes are the only saturated colours in the scene (a touched cube of a multi-step task is
    darker, still its colour). `touched` [N, colours] (bool, from the samples' truth): a patch of a touched
    colour is labelled 1 + len(COLOUR_NAMES) + index instead, so that the image tokens say which cubes are
    done. [N, H, W, 3] uint8 -> [N, patches] (row-major, as SigLIP)."""
    n, h, w, _ = images.shape
    rgb = np.array([COLOURS[c] for c in COLOUR_NAMES]) * 255.0
    rgb = np.concatenate([rgb, rgb * TOUCHED_SHADE])
    pixels = images.astype(np.float32)
    close = np.abs(pixels[:, :, :, None, :] - rgb).max(-1) < 70      # [N, H, W, 2C]
    # The dark shades are near the arm's greys: a touched cube's pixels are also strongly coloured.
    close[..., len(COLOUR_NAMES):] &= (pixels.max(-1) - pixels.min(-1) > 50)[..., None]
    counts = close.reshape(n, h // patch, patch, w // patch, patch, 2, -1).sum(axis=(2, 4, 5))
    counts = counts.reshape(n, -1, len(COLOUR_NAMES))
    colour = counts.argmax(-1)
    labels = np.where(counts.max(-1) >= min_pixels, colour + 1, 0)
    if touched is not None:
        labels = np.where((labels > 0) & np.take_along_axis(touched, colour, 1), labels + len(COLOUR_NAMES), labels)
    return labels


def make_batch(data: dict[str, np.ndarray], index: np.ndarray, tok: Tokenizer, norm: Normalizer,
               rng: np.random.Generator, image_size: int, image_tokens: int, max_token_len: int,
               prefix_delay_max: int = 0) -> Batch:
    """prefix_delay_max > 0: each sample's chunk is a conditioned_chunk whose first d rows (d uniform in
    0..prefix_delay_max, `given_rows`) the expert is given (training/train.py: flow_matching_loss)."""
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
    chunks, given = data["chunk"][index], None
    if prefix_delay_max:
        given = rng.integers(0, prefix_delay_max + 1, size=len(index))
        chunks = np.stack([conditioned_chunk(data["state"][i].astype(np.float64), *_goals(data, i), int(d),
                                             chunks.shape[1], rng) for i, d in zip(index, given)])
    actions = normalize_actions(norm, action_deltas({"chunk": chunks, "state": data["state"][index]}))
    patch = data["image"].shape[1] * image_size // data["image"].shape[1] // int(image_tokens ** 0.5)
    return Batch(rows, TrainPrefixAttention(lengths, bidir, prefix, torch.tensor(read)), torch.tensor(targets),
                 torch.tensor(actions, dtype=torch.float32),
                 torch.tensor(patch_colours(data["image"][index], patch)),
                 None if given is None else torch.tensor(given))


def _goals(data: dict[str, np.ndarray], i: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The joint angles that touch sample i's named cube, and those of the scene's other cubes."""
    layout = layout_of(data, i)
    goals = [inverse_kinematics(touch_point(p)) for p in layout.positions]
    target = int(data["target"][i])
    return goals[target], goals[:target] + goals[target + 1:]


# The joint hierarchical format (LeRobot pi052's joint recipe, model/pi052.py), the hierarchical demo model's:
# one prefill per frame, every text a causal fork at the end of its prompt.
TASK_ONLY_RATE = 0.15       # samples whose actions read the task as their span: what the engine serves before a
                            # robot's first subtask exists (LeRobot's fallback), and the task-only comparison


def task_of(data: dict[str, np.ndarray], i: int) -> MultiStepTask:
    """Sample i's multi-step task (data.generate_multistep_shard's labels)."""
    layout = layout_of(data, i)
    kind = ORDERS[int(data["kind"][i])]
    if kind == "named":
        return named_task(layout, tuple(int(c) for c in data["order"][i] if c >= 0))
    return spatial_task(layout, kind)


def make_joint_batch(data: dict[str, np.ndarray], index: np.ndarray, tok: Tokenizer, norm: Normalizer,
                     rng: np.random.Generator, image_size: int, image_tokens: int, max_token_len: int) -> Batch:
    """Per sample one row, in the joint recipe's blocks as the engine serves them: the trunk is the images and
    the bidirectional prompt `"User: {task}, State: ...;\\nAssistant:"` (the subtask request's prompt), the
    subtask's tokens (causal), then EOS and `"\\n"`, which see each other (`pi052.joint_tokens`); the actions
    read the whole trunk (the task instead of the subtask for TASK_ONLY_RATE of the samples). The subtask's
    tokens and EOS are its text targets, the subtask request forked from the prompt. Then forks
    (training/attention.py): a scene question and its answer; when a step is done, the memory request
    (pi052's memory turns continuing the header, `pi052.joint_request`) and the progress memory."""
    rows, lengths, bidir, prefix, forks, tails, read, targets = [], [], [], [], [], [], [], []
    offset = 0
    for i in index:
        layout, task, done = layout_of(data, i), task_of(data, i), int(data["done"][i])
        subtask = subtask_text(layout, task, done)
        state = pi052.state_text(norm.normalize_state(data["state"][i]))
        prompt = tok.encode(pi052.joint_prompt(task.text, state) + pi052.GENERATION_PROMPT, bos=True)
        if len(prompt) > max_token_len:
            raise ValueError(f"task {task.text!r}: its prompt is {len(prompt)} tokens, the model reads {max_token_len}")
        n_prompt = image_tokens + len(prompt)
        task_only = rng.random() < TASK_ONLY_RATE
        conditioning = task.text if task_only else subtask
        joint = pi052.joint_tokens(tok, task.text, state, conditioning)
        if joint.tokens[:joint.bidir] != prompt:
            raise ValueError(f"the joint prompt of {conditioning!r} does not begin with the subtask request's tokens")
        span = joint.tokens[joint.bidir:]
        if not task_only:     # the subtask and EOS, each predicted from the token before it
            first = offset + n_prompt - 1
            read.extend(range(first, first + joint.causal + 1))
            targets.extend(span[:joint.causal + 1])
        row_forks, fork_tokens, start = [], [], n_prompt + len(span)
        question = scene_questions(layout, data["tip"][i].astype(np.float64), rng)
        q = question[int(rng.integers(len(question)))]
        text_forks = [(tok.encode(QUESTION_TEMPLATE.format(text=q.text)), tok.encode(q.answer) + [tok.eos_id])]
        if done:
            request = pi052.joint_request(pi052.memory_messages(task.text, progress_memory(layout, task, done - 1),
                                                                subtask_text(layout, task, done - 1)))
            text_forks.append((tok.encode(request), tok.encode(" " + progress_memory(layout, task, done))
                               + [tok.eos_id]))
        for asked, answer in text_forks:
            first = offset + start + len(asked) - 1
            read.extend(range(first, first + len(answer)))
            targets.extend(answer)
            fork_tokens += asked + answer
            row_forks.append(len(asked) + len(answer))
            start += len(asked) + len(answer)
        rows.append(PrefixRow(to_pixels(data["image"][i], image_size)[None], torch.tensor(prompt + span + fork_tokens)))
        lengths.append(start)
        bidir.append(n_prompt)
        prefix.append(n_prompt + len(span))
        forks.append(row_forks)
        tails.append(joint.tail)
        offset += start
    actions = normalize_actions(norm, action_deltas({"chunk": data["chunk"][index], "state": data["state"][index]}))
    patch = int(image_size / image_tokens ** 0.5)
    touched = np.zeros((len(index), len(COLOUR_NAMES)), dtype=bool)
    for row, i in enumerate(index):
        for cube in data["order"][i][:int(data["done"][i])]:
            touched[row, data["colours"][i][cube]] = True
    labels = patch_colours(data["image"][index], patch, touched=touched)
    return Batch(rows, TrainPrefixAttention(lengths, bidir, prefix, torch.tensor(read), forks, tails),
                 torch.tensor(targets), torch.tensor(actions, dtype=torch.float32), torch.tensor(labels))
