"""The engine end to end: the numerics contract across policies, a 100-frame run, tasks (memory,
streaming, stop strings, sampling; hierarchical language: test_hierarchy_engine.py), and the threaded API."""
import threading
import time

import numpy as np
import pytest
import torch

from conftest import ORACLE, make_observation
from oxygen_ros.engine.requests import Sampling, TextRequest
from oxygen_ros.model import inference
from oxygen_ros.model.checkpoint import load_pi05
from oxygen_ros.model.config import from_oracle_json

# Float32 on the CPU: the shared-KV and batched paths must reproduce the isolated path's actions to this
# bound (same inputs, same noise). In practice they agree bitwise: the action's prefill and denoise loop
# are the same batch-1 computations whatever the policy.
ACTION_TOL = 1e-5
QUESTIONS = ["what is on the table?", "where is the red cup?", "describe the scene.", "is the gripper open?"]


def standalone_reply(engine, obs, question: str, max_tokens: int) -> list[int]:
    """Greedy generation on a fresh contiguous cache: the reference each policy must reproduce."""
    runner = engine.runner
    model = runner.model
    row = engine.preparer.prepare(obs).row
    cache = inference.ContiguousCache(model, model.prefix_length(row) + 64 + max_tokens)
    pre = inference.prefill(model, cache, [row], runner.backend)
    q = engine.question_tokens(question)
    tokens = inference.greedy_generate(model, cache, pre.segments[0], pre.hidden[0], q, max_tokens,
                                       engine.tokenizer.eos_id, runner.backend)
    return tokens[:-1] if tokens and tokens[-1] == engine.tokenizer.eos_id else tokens


def run_policy(engine, frames: int, max_tokens: int, image_size: int, seed: int = 0):
    noise = [torch.randn(engine.horizon, engine.runner.cfg.action_dim,
                         generator=torch.Generator().manual_seed(100 + i)).numpy() for i in range(frames)]
    handles, actions = [], []
    for i in range(frames):
        handles.append(engine.submit(TextRequest(QUESTIONS[i % len(QUESTIONS)], max_tokens=max_tokens)))
        engine.run_cycle(make_observation(i, image_size, seed=seed), noise[i])
        actions.append(engine.latest_chunk().model_actions)
    while engine.active_requests or engine.queued_requests:
        engine.run_cycle(None)
    return np.stack(actions), [h.result(0) for h in handles]


@pytest.mark.parametrize("model_name", ["small", "case_a", "case_c"])
def test_policies_agree_on_actions_and_replies(model_name, small_model, engine_factory):
    if model_name == "small":
        model, image_size, frames, max_tokens = small_model, 56, 6, 10
    else:
        model = load_pi05(ORACLE / model_name, from_oracle_json(ORACLE / model_name / "config.json"))
        image_size, frames, max_tokens = 224, 3, 6
    results = {}
    for policy in ("isolated", "shared_kv", "oxygen"):
        engine = engine_factory(model=model, policy=policy, decode_budget="fixed", tokens_per_frame=2,
                                kv_budget_mb=16.0)
        results[policy] = run_policy(engine, frames, max_tokens, image_size)
        assert engine.runner.pool.blocks.num_used == 0, f"{policy} leaked KV blocks"
    ref_actions, ref_replies = results["isolated"]
    for policy, (actions, replies) in results.items():
        assert np.abs(actions - ref_actions).max() <= ACTION_TOL, policy
        assert all(r.success for r in replies), policy
        assert [r.tokens for r in replies] == [r.tokens for r in ref_replies], policy
    for i, reply in enumerate(ref_replies):
        expected = standalone_reply(engine, make_observation(i, image_size), QUESTIONS[i % len(QUESTIONS)],
                                    max_tokens)
        assert reply.tokens == expected, f"frame {i}: reply differs from a standalone greedy generation"


def test_oxygen_batches_across_frames(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=2)
    frames_of = []
    for i in range(6):
        engine.submit(TextRequest("what is on the table?", max_tokens=9))
        report = engine.run_cycle(obs(i))
        frames_of.append({r.frame.frame_index for r in engine.scheduler.running})
    assert max(len(f) for f in frames_of) >= 3, "one decode batch spans requests of several frames"
    assert report.batch_sizes and max(report.batch_sizes) >= 3


def test_hundred_frames_with_a_request_every_frame_ends_with_an_empty_pool(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=3)
    handles = []
    for i in range(100):
        handles.append(engine.submit(TextRequest(QUESTIONS[i % 4], max_tokens=10)))
        engine.run_cycle(obs(i))
    while engine.active_requests:
        engine.run_cycle(None)
    replies = [h.result(0) for h in handles]
    assert all(r.success and 1 <= len(r.tokens) <= 10 for r in replies)
    snap = engine.stats.snapshot()
    assert snap["frames"] == 100 and snap["avg_batch"] > 2
    assert engine.runner.pool.blocks.num_used == 0
    assert {r.frame_index for r in replies} == set(range(100)), "each request attached to its frame"


def test_memory_captions_are_produced_and_bounded(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=4, memory_every_frames=3,
                            memory_max_tokens=4, memory_log_size=2)
    seen = []
    engine.add_caption_listener(seen.append)
    for i in range(10):
        engine.run_cycle(obs(i))
    while engine.active_requests:
        engine.run_cycle(None)
    assert [c.frame_index for c in seen] == [0, 3, 6, 9]
    assert all(c.text and c.prompt == "Describe the scene." for c in seen)
    assert [c.stamp for c in seen] == [obs(i).stamp_s for i in (0, 3, 6, 9)]
    assert [c.frame_index for c in engine.captions()] == [6, 9]


def test_streaming_partials_and_stop_strings(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=20)
    free = engine.submit(TextRequest("what is on the table?", max_tokens=12))
    engine.run_cycle(obs(0))
    full = free.result(0)
    stream = list(free.partials(timeout=0))
    partials = [p.text for p in stream]
    assert partials and partials[-1] == full.text
    assert [p.tokens for p in stream] == sorted(p.tokens for p in stream) and stream[-1].tokens <= len(full.tokens)
    assert all(b.startswith(a) or len(b) < len(a) for a, b in zip(partials, partials[1:]))
    stop = full.text[len(full.text) // 2:][:2]
    assert stop
    stopped = engine.submit(TextRequest("what is on the table?", max_tokens=12, stop=(stop,)))
    engine.run_cycle(obs(0))
    r = stopped.result(0)
    assert r.finish_reason == "stop" and r.text == full.text[:full.text.find(stop)]


def test_sampling_is_reproducible_per_seed(engine_factory, obs):
    def reply(seed):
        engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=16)
        h = engine.submit(TextRequest("what is on the table?", max_tokens=16,
                                      sampling=Sampling(temperature=1.5, top_p=0.95, seed=seed)))
        engine.run_cycle(obs(0))
        return h.result(0).tokens

    assert reply(5) == reply(5)
    assert reply(5) != reply(6)
    with pytest.raises(ValueError):
        Sampling(top_p=0.0)


def test_threaded_engine_answers_every_request_and_stops_cleanly(engine_factory):
    engine = engine_factory(policy="oxygen", decode_budget="deadline", action_rate_hz=50.0)
    stop = threading.Event()

    def camera():
        i = 0
        while not stop.is_set():
            engine.submit_observation(make_observation(i))
            i += 1
            time.sleep(0.02)

    cam = threading.Thread(target=camera)
    engine.start()
    cam.start()
    try:
        handles = [engine.submit(TextRequest(QUESTIONS[i % 4], max_tokens=6)) for i in range(5)]
        replies = [h.result(timeout=30) for h in handles]
        assert all(r.success for r in replies)
        assert engine.latest_chunk() is not None
        late = engine.submit(TextRequest("one more question", max_tokens=200))
    finally:
        stop.set()
        cam.join()
        engine.stop()
    assert late.result(timeout=5).finish_reason in ("error", "length")   # answered, never left hanging
    assert engine.runner.pool.blocks.num_used == 0


def test_a_fragmented_pool_gives_the_same_results(engine_factory):
    """After churn the allocator hands out scattered blocks; the results must not depend on where in the
    pool a frame or a request lives."""
    results = []
    for fragment in (False, True):
        engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=2, block_size=4)
        alloc = engine.runner.pool.blocks
        if fragment:
            held = [alloc.allocate(1) for _ in range(alloc.num_blocks)]
            order = np.random.default_rng(0).permutation(len(held))
            for i in order[: len(held) // 2]:          # free a random half: no long runs are left
                alloc.decref(held[i])
        noise = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
        h = engine.submit(TextRequest("what is on the table?", max_tokens=8))
        engine.run_cycle(make_observation(0), noise)
        assert engine.active_requests == 1, "still decoding: its frame and own blocks are in use"
        seq = engine.scheduler.running[0]
        for blocks in (list(seq.frame.segment.blocks), list(seq.blocks)):
            consecutive = blocks == list(range(blocks[0], blocks[0] + len(blocks)))
            assert consecutive != fragment, (fragment, blocks)
        while engine.active_requests:
            engine.run_cycle(None)
        results.append((engine.latest_chunk().model_actions, h.result(0).tokens))
    assert np.abs(results[0][0] - results[1][0]).max() <= ACTION_TOL
    assert results[0][1] == results[1][1]
