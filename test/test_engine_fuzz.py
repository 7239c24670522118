"""Fuzz at the engine API: random and malformed requests, observations, cancellations, clock jumps and
model faults for a bounded time (synchronous cycles, a simulated clock, a seeded generator: a failure
replays). Invariants: run_cycle never raises, every request resolves exactly once, the KV pool returns to
empty, and the engine still produces chunks and replies afterwards."""
import time

import numpy as np
import pytest

from conftest import SimClock, make_observation
from oxygen_ros.engine.requests import Sampling, TextRequest

FUZZ_SECONDS = 6.0


GOOD_TEXT = ["what is on the table?", "describe the scene.", "is the gripper open?", "où est la tasse ?"]
BAD = {
    "text": ["", "hi" + "\0" * 10_000, "x" * 5_000, b"\xff\xfe", "\ud800 broken surrogate", 7],
    "max_tokens": [0, -5, 10_000, 2.5, True],
    "stop": [("x" * 200,), ("the",) * 40, "the", (3,)],
    "timeout_s": [float("nan"), float("inf"), -1.0, 0.0, 1e12],
    "kind": ["subtask", "?"],
}


def random_request(rng):
    """A valid request (random sampling, stops, timeout), or with probability 0.4 one with a bad field."""
    sampling = Sampling()
    if rng.random() < 0.4:
        sampling = Sampling(temperature=float(rng.choice([0.5, 1.0, 2.0])), top_p=float(rng.choice([1.0, 0.9])),
                            seed=int(rng.integers(100)))
    fields = dict(text=str(rng.choice(GOOD_TEXT)), max_tokens=int(rng.choice([1, 3, 8, 16])), sampling=sampling,
                  stop=tuple(rng.choice(["", "the", ".", "\n"], size=int(rng.choice([0, 1, 3])))),
                  timeout_s=float(rng.choice([0.05, 0.5, 5.0, 30.0])), kind="conversation")
    if rng.random() < 0.4:
        name = str(rng.choice(list(BAD)))
        options = BAD[name]
        fields[name] = options[int(rng.integers(len(options)))]
    return TextRequest(**fields)


def random_observation(rng, i):
    obs = make_observation(i, cameras=tuple(bool(b) for b in rng.integers(0, 2, 3)),
                           state_dim=int(rng.choice([8, 8, 8, 0, 3])))
    fault = rng.integers(10)
    if fault == 0 and len(obs.state):
        obs.state[0] = np.nan
    elif fault == 1:
        obs.stamp_s = float(rng.choice([np.nan, np.inf]))
    elif fault == 2:
        obs.images["base_0_rgb"] = np.zeros((1, 500, 3), np.uint8)
    elif fault == 3:
        obs.images["base_0_rgb"] = np.zeros((8, 8), np.float64) + np.nan
    elif fault == 4:
        obs.state = [[1.0, 2.0]]
    return obs


@pytest.mark.parametrize("seed", [0, 1])
def test_random_and_malformed_traffic_keeps_every_invariant(engine_factory, seed):
    rng = np.random.default_rng(seed)
    clock = SimClock()
    engine = engine_factory(clock=clock, policy="oxygen", decode_budget="fixed", tokens_per_frame=3,
                            max_active_requests=8, max_queued_requests=16, memory_every_frames=7,
                            memory_max_tokens=4, kv_budget_mb=0.3, block_size=8, max_tokens_limit=64)
    real_extend = engine.runner.extend

    def sometimes_nan(rows):
        logits = real_extend(rows)
        if rng.random() < 0.05:
            logits = logits.clone()
            logits[int(rng.integers(len(rows)))] = float("nan")
        return logits

    engine.runner.extend = sometimes_nan
    answers: dict[int, int] = {}
    handles = []

    def watch(h):
        handles.append(h)
        h.add_done_callback(lambda reply, hid=h.id: answers.__setitem__(hid, answers.get(hid, 0) + 1))
        if rng.random() < 0.05:
            h.add_done_callback(lambda reply: 1 / 0)        # a client bug

    end, i = time.monotonic() + FUZZ_SECONDS, 0
    while time.monotonic() < end:
        for _ in range(int(rng.integers(0, 4))):
            watch(engine.submit(random_request(rng)))
        if handles and rng.random() < 0.2:
            handles[int(rng.integers(len(handles)))].cancel()
        clock.advance(float(rng.choice([0.0, 0.01, 0.07, 0.6])))
        engine.run_cycle(random_observation(rng, i) if rng.random() < 0.7 else None)   # never raises
        i += 1
    engine.runner.extend = real_extend
    for j in range(400):
        if not (engine.active_requests or engine.queued_requests):
            break
        clock.advance(0.07)
        engine.run_cycle(make_observation(10_000 + j))
    assert not (engine.active_requests or engine.queued_requests), "the engine drained"
    assert all(h.done() for h in handles)
    assert all(answers.get(h.id) == 1 for h in handles), "every request resolved exactly once"
    assert engine.stats.snapshot()["pool_blocks_used"] == 0
    reasons = {h.result(0).finish_reason for h in handles}
    assert {"refused", "length"} <= reasons, reasons                # the fuzz reached both paths
    assert engine.stats.counter("bad_observations") > 0 and engine.stats.snapshot()["frames"] > 0
    # still serving
    after = engine.submit(TextRequest("what is on the table?", max_tokens=3))
    engine.run_cycle(make_observation(99_999))
    engine.run_cycle(None)
    assert after.result(0).success and engine.latest_chunk().plan.frame_index == engine._frame_index - 1
    print(f"seed {seed}: {i} cycles, {len(handles)} requests, reasons {sorted(reasons)}")
