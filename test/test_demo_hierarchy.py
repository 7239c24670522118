"""The hierarchical demo: multi-step tasks judged from the simulator's state, the expert's labels (subtask,
progress memory) against the simulator along its episodes, and the joint format's training rows computing
what the serving path computes (forks of the frame's prompt, the actions over the prompt and the subtask span)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from oxygen_ros.model import pi052
from oxygen_ros.model.attention import ActionAttention, CachedAttention, CachedRow, Segment
from oxygen_ros.model.config import preset
from oxygen_ros.model.inference import ContiguousCache, prefill
from oxygen_ros.model.normalize import Normalizer
from oxygen_ros.model.pi05 import Pi05, PrefixRow
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.sim.expert import expert_chunk, inverse_kinematics
from oxygen_ros.sim.scene import COLOURS, TOUCH_RADIUS, Layout, ReachScene, touch_point
from oxygen_ros.sim.tasks import (StepJudge, draw_multistep_episode, draw_task, named_task, progress_memory,
                                  spatial_task, subtask_text)
from oxygen_ros.training import data as datagen
from oxygen_ros.training.attention import TrainActionAttention
from oxygen_ros.training.batches import make_joint_batch, norm_stats, patch_colours, task_of
from oxygen_ros.training.train import init_weights

CFG = preset("demo")
LAYOUT = Layout(("red", "green", "blue"), np.array([[0.25, 0.12, 0.025], [0.22, -0.1, 0.025], [0.28, 0.0, 0.025]]),
                np.array([0.0, 0.2, 1.2]))


@pytest.fixture(scope="module")
def scene():
    s = ReachScene(64)
    yield s
    s.close()


def _tip_at(scene: ReachScene, cube: int | None) -> int | None:
    """Put the tip on cube `cube` (None: up in the air) and return what the scene says it touches."""
    q = LAYOUT.start if cube is None else inverse_kinematics(touch_point(LAYOUT.positions[cube]))
    scene.set_joints(q)
    return scene.touching()


def test_steps_are_judged_from_the_simulator_in_order_and_wrong_cubes_do_not_count(scene):
    scene.reset(LAYOUT)
    task = named_task(LAYOUT, (2, 0, 1))
    assert task.text == "touch the blue cube, then the red one, then the green one"
    judge = StepJudge(task)
    tick = 0

    def visit(cube):
        nonlocal tick
        tick += 1
        return judge.update(_tip_at(scene, cube), tick)

    assert not visit(None) and not visit(0) and judge.done == 0 and judge.wrong_touches == 1   # red before blue
    assert not visit(0) and judge.wrong_touches == 1       # staying on it is one touch
    assert visit(2) and judge.done == 1 and judge.target == 0
    assert not visit(2) and judge.done == 1 and judge.wrong_touches == 1    # a done cube is no wrong touch
    assert not visit(1) and judge.wrong_touches == 2        # green is the third step, not the second
    assert visit(0) and visit(1) and judge.finished and judge.target is None
    assert judge.step_ticks == [4, 7, 8]


def test_spatial_tasks_follow_the_camera_left_to_right_and_labels_name_the_progress():
    # left = +y as the base camera sees it: red (0.12), blue (0.0), green (-0.1)
    assert spatial_task(LAYOUT, "left_to_right").order == (0, 2, 1)
    assert spatial_task(LAYOUT, "right_to_left").order == (1, 2, 0)
    task = spatial_task(LAYOUT, "left_to_right")
    assert task.text == "touch every cube from left to right"
    assert [subtask_text(LAYOUT, task, k) for k in range(4)] == [
        "touch the red cube", "touch the blue cube", "touch the green cube", ""]
    assert [progress_memory(LAYOUT, task, k) for k in range(4)] == [
        "", "red touched; next: blue", "red, blue touched; next: green", "red, blue, green touched; done"]
    with pytest.raises(ValueError, match="min_steps must be in 1..3"):
        draw_task(LAYOUT, np.random.default_rng(0), min_steps=4)


def test_multistep_episodes_are_seeded_and_draw_every_kind_of_task():
    tasks = [draw_multistep_episode(1000, k).task for k in range(60)]
    assert [t.text for t in tasks[:5]] == [draw_multistep_episode(1000, k).task.text for k in range(5)]
    assert {t.kind for t in tasks} == {"named", "left_to_right", "right_to_left"}
    assert {t.steps for t in tasks} == {2, 3}
    assert all(len(set(t.order)) == t.steps for t in tasks)


def test_a_touched_cube_darkens_in_the_image_and_keeps_its_colour_label(scene):
    scene.reset(LAYOUT)
    _tip_at(scene, None)
    before = scene.render("base")
    scene.mark_touched(0)
    after = scene.render("base")
    changed = np.abs(before.astype(int) - after.astype(int)).sum(-1) > 60
    assert changed.sum() >= 6, "the touched cube looks different"
    red = np.array(COLOURS["red"]) * 255
    assert np.abs(before[changed] - red).max(-1).mean() < np.abs(after[changed] - red).max(-1).mean()
    labels = patch_colours(np.stack([before, after]), 16)
    seen = set(labels[0][labels[0] > 0].tolist())
    assert 1 in seen and set(labels[1][labels[1] > 0].tolist()) == seen     # red is red, touched or not
    touched = np.array([[False] * 4, [True, False, False, False]])
    assert np.array_equal(patch_colours(np.stack([before, after]), 16, touched=touched),
                          np.where(labels == 1, [[1], [5]], labels)), "the probe's touched red: class 5"
    scene.reset(LAYOUT)
    assert np.array_equal(scene.render("base"), before), "a reset restores every colour"


def test_the_expert_labels_follow_the_simulator_along_multistep_episodes(scene):
    """The expert, closed loop: at every tick the label (subtask, memory) is checked against what the simulator
    shows independently: which cubes are dark, in the order the tip came within TOUCH_RADIUS of them."""
    rng = np.random.default_rng(5)
    for _ in range(4):
        layout = Layout.random(rng, 3)
        task = draw_task(layout, rng, min_steps=3)
        scene.reset(layout)
        judge, visited = StepJudge(task), []
        for k in range(110 * task.steps):
            if judge.update(scene.touching(), k):
                scene.mark_touched(task.order[judge.done - 1])
            tip = scene.tip()
            for i, p in enumerate(layout.positions):
                near = np.linalg.norm(tip - touch_point(p)) <= TOUCH_RADIUS
                expected = task.order[len(visited)] if len(visited) < task.steps else None
                if near and i == expected:
                    visited.append(i)
            dark = [i for i in range(3) if scene.model.geom_rgba[scene._cube_geoms[i]][:3].max()
                    < max(COLOURS[layout.colours[i]]) * 0.5]
            assert sorted(dark) == sorted(visited)
            done = len(visited)
            if done < task.steps:
                assert subtask_text(layout, task, judge.done) == f"touch the {layout.colours[task.order[done]]} cube"
            names = [layout.colours[i] for i in visited]
            assert progress_memory(layout, task, judge.done) == ("" if not names else ", ".join(names) + " touched; "
                                                                + ("done" if done == task.steps else
                                                                   f"next: {layout.colours[task.order[done]]}"))
            if judge.finished:
                break
            if k % 10 == 0:     # ten rows of each chunk, as the evaluation executes them
                goal = inverse_kinematics(touch_point(layout.positions[judge.target]))
                chunk = expert_chunk(scene.joints(), goal, 20)
            scene.step(chunk[k % 10])
        assert judge.finished and judge.wrong_touches == 0, f"the expert finishes {task.text!r} cleanly"


@pytest.fixture(scope="module")
def multistep_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_hier_data")
    return datagen.load(datagen.generate(out, 120, seed=0, shard_size=60, multistep=True, log=lambda *_: None))


def test_multistep_samples_head_for_their_labelled_cube(multistep_data):
    d = multistep_data
    assert d["image"].shape == (120, 64, 64, 3) and {"order", "done", "kind"} <= set(d)
    # sampled twice as often once a step is done: more than half the samples (at one rate: 41 of 120 here)
    assert (d["done"] > 0).sum() > 60, "samples after a first step done"
    for i in range(120):
        layout, task = _layout(d, i), task_of(d, i)
        assert d["target"][i] == task.order[d["done"][i]], "the chunk's cube is the subtask's"
        goal = inverse_kinematics(touch_point(layout.positions[task.order[d["done"][i]]]))
        np.testing.assert_allclose(d["chunk"][i], expert_chunk(d["state"][i].astype(np.float64), goal, 20), atol=1e-5)


def _layout(d, i):
    from oxygen_ros.training.batches import layout_of
    return layout_of(d, i)


def _served_hiddens(model, cache, frame: Segment, tokens: list[int]) -> torch.Tensor:
    """Teacher-forced causal continuation of a frame's prefix, one token at a time as the engine decodes:
    the final-norm hidden state after each token [len(tokens), width]."""
    blocks = cache.allocate(len(tokens))
    out = []
    for n, token in enumerate(tokens, 1):
        attn = CachedAttention(cache.kv, [CachedRow(1, Segment(blocks, n), frame)], "torch", "cpu")
        out.append(model.extend(torch.tensor([token]), attn))
    return torch.cat(out)


@torch.no_grad()
def test_joint_training_rows_compute_what_the_serving_path_computes(multistep_data, tmp_path, monkeypatch):
    """Same weights and frames: the training forward of joint rows gives, at every text target, the hidden
    state of the serving path's fork (prefill of image + prompt through "Assistant:", then the fork's tokens
    decoded one by one: the subtask from the frame's last position, the question, the memory request: none
    sees the span or another fork), and the expert's velocity over the trunk equals the serving path's over
    the frame's prefix extended as the engine extends it before the denoise (ModelRunner.extend_spans: the
    subtask's tokens causal, then [EOS, "\\n"] seeing each other) (float32; hiddens 1e-5, velocity 1e-6)."""
    from oxygen_ros.training import batches

    monkeypatch.setattr(batches, "TASK_ONLY_RATE", 0.0)
    g = torch.Generator().manual_seed(0)
    model = init_weights(Pi05(CFG), 0)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.02)
    (tmp_path / "norm_stats.json").write_text(json.dumps(norm_stats(multistep_data)))
    norm, tok = Normalizer.load(tmp_path / "norm_stats.json"), Tokenizer.tiny()
    index = np.flatnonzero(multistep_data["done"] > 0)[:3]         # rows with a memory fork too
    batch = make_joint_batch(multistep_data, index, tok, norm, np.random.default_rng(1), 64, CFG.image_tokens,
                             CFG.max_token_len)
    attn, n_image = batch.attention, CFG.image_tokens
    assert [len(f) for f in attn.forks] == [2, 2, 2]
    hidden = model.prefill(batch.rows, attn)
    cache = ContiguousCache(model, 4096)
    served, extended, offset = {}, [], 0
    for r, row in enumerate(batch.rows):
        tokens = row.tokens.tolist()
        bidir, trunk = attn.bidir[r], attn.prefix[r]
        prompt, span = tokens[:bidir - n_image], tokens[bidir - n_image:trunk - n_image]
        assert tok.decode(prompt).endswith(";\nAssistant:") and span[-2:] == [tok.eos_id] + tok.encode("\n")
        pre = prefill(model, cache, [PrefixRow(row.images, torch.tensor(prompt))], backend="torch")
        frame = pre.segments[0]
        served[offset + bidir - 1] = pre.hidden[0]             # the subtask's first token: the frame's last
        start, rest = trunk, tokens[trunk - n_image:]
        pieces = [(bidir, span)]
        for length in attn.forks[r]:
            pieces.append((start, rest[:length]))
            start, rest = start + length, rest[length:]
        for at, piece in pieces:
            for j, h in enumerate(_served_hiddens(model, cache, frame, piece)):
                served[offset + at + j] = h
        # the engine's way: the frame's own segment extended by the subtask (causal), then EOS and "\\n" (a block)
        total = frame.length + len(span)
        own = Segment(frame.blocks + cache.allocate(total - len(frame.blocks) * cache.kv.block_size), total)
        for new, end, block in ((span[:-2], total - 2, 0), (span[-2:], total, 2)):
            model.extend(torch.tensor(new), CachedAttention(cache.kv, [CachedRow(len(new), Segment(own.blocks, end),
                                                                                 bidir=block)], "torch", "cpu"))
        extended.append(own)
        offset += attn.lengths[r]
    expected = torch.stack([served[p] for p in attn.last_token.tolist()])
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    noise = torch.randn(len(index), CFG.action_horizon, CFG.action_dim, generator=g)
    t = torch.tensor([0.9, 0.5, 0.1])
    v_train = model.denoise_step(noise, t, TrainActionAttention(attn, CFG.action_horizon))
    v = model.denoise_step(noise, t, ActionAttention(cache.kv, extended, CFG.action_horizon, "torch", "cpu"))
    # 1e-6: measured 1.2e-7; EOS blind to the newline after it (an all-causal span) moves it by 6.3e-6
    torch.testing.assert_close(v_train, v, atol=1e-6, rtol=0)



def test_fine_tuning_the_whole_model_from_trained_weights_trains_every_part(multistep_data, tmp_path):
    """--init without --train expert: the loader's serving model has no gradients; every part must train."""
    from oxygen_ros.robot.configs import demo_checkpoint
    from oxygen_ros.training.train import Trainer

    torch.manual_seed(0)
    trainer = Trainer(CFG, multistep_data, tmp_path, 4, 10, 1e-3, 0, init=demo_checkpoint(), joint=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.step = 50           # past the warm-up: a full learning rate
    trainer.train_step()
    moved = {n.split(".")[0] for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert {"vision", "embed_tokens", "vlm_layers", "expert_layers", "action_out_proj"} <= moved

