"""Faults, load and leaks at the engine level: injected exceptions and NaNs, a burst of 1,000 requests,
memory that stays flat, and a short soak. (Across processes, with ROS: test_ros_reliability.py.)"""
import numpy as np
import pytest
import torch

from conftest import drain
from oxygen_ros.engine.requests import TextRequest
from oxygen_ros.tools.soak import rss_mb


def test_exception_in_a_frame_discards_its_chunk_and_the_engine_recovers(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=3)
    engine.run_cycle(obs(0))
    good = engine.latest_chunk()
    real = engine.runner.actions
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected: device lost")
        return real(*args, **kwargs)

    engine.runner.actions = failing
    waiting = engine.submit(TextRequest("what is on the table?", max_tokens=4))
    report = engine.run_cycle(obs(1))
    assert report.fault == "RuntimeError: injected: device lost"
    assert engine.latest_chunk() is good, "the faulty frame published no chunk: the robot keeps the old one"
    assert not waiting.done(), "a queued request is not lost with the frame: it waits for the next one"
    assert engine.stats.counter("faults") == 1 and "injected" in engine.stats.snapshot()["last_error"]
    engine.run_cycle(obs(2))
    assert engine.latest_chunk().plan.stamp_s == obs(2).stamp_s and not engine.faulted
    drain(engine)
    assert waiting.result(0).success and waiting.result(0).frame_stamp == obs(2).stamp_s
    assert engine.runner.pool.blocks.num_used == 0


def test_nan_actions_are_a_fault_and_never_published(engine_factory, obs):
    engine = engine_factory(policy="oxygen")
    engine.run_cycle(obs(0))
    good = engine.latest_chunk()
    model = engine.runner.model
    real = model.sample_actions
    model.sample_actions = lambda *a, **k: real(*a, **k) * float("nan")
    try:
        report = engine.run_cycle(obs(1))
    finally:
        model.sample_actions = real
    assert "non-finite actions" in report.fault
    assert engine.latest_chunk() is good
    assert engine.runner.pool.blocks.num_used == 0


def test_a_failing_decode_step_fails_its_batch_with_an_error_not_a_hang(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=2)
    handles = [engine.submit(TextRequest("what is on the table?", max_tokens=20)) for _ in range(3)]
    engine.run_cycle(obs(0))
    real = engine.runner.extend
    engine.runner.extend = lambda items: (_ for _ in ()).throw(RuntimeError("injected decode failure"))
    engine.run_cycle(obs(1))
    engine.runner.extend = real
    for h in handles:
        r = h.result(0)
        assert not r.success and r.finish_reason == "error" and "injected decode failure" in r.error
        assert r.tokens, "what was generated before the fault is returned"
    later = engine.submit(TextRequest("and now?", max_tokens=4))
    drain(engine)
    assert later.result(0).success
    assert engine.runner.pool.blocks.num_used == 0


def test_nan_logits_fail_only_their_request(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=2)
    a = engine.submit(TextRequest("first question", max_tokens=10))
    b = engine.submit(TextRequest("second question", max_tokens=10))
    engine.run_cycle(obs(0))
    real = engine.runner.extend

    a_blocks = next(s.blocks for s in engine.scheduler.running if s.handle is a)

    def poisoned(rows):
        logits = real(rows).clone()
        for i, row in enumerate(rows):
            if row.blocks == a_blocks:
                logits[i] = float("nan")
        return logits

    engine.runner.extend = poisoned
    drain(engine)
    engine.runner.extend = real
    assert a.result(0).finish_reason == "error" and "non-finite logits" in a.result(0).error
    assert b.result(0).success
    assert engine.runner.pool.blocks.num_used == 0


def test_repeated_faults_trip_a_safe_stop_until_reset(engine_factory, obs):
    engine = engine_factory(policy="oxygen", max_consecutive_faults=3)
    engine.run_cycle(obs(0))
    real = engine.runner.prefill
    engine.runner.prefill = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected: sensor garbage"))
    queued = engine.submit(TextRequest("are you there?", max_tokens=4))
    for i in range(1, 4):
        engine.run_cycle(obs(i))
    assert engine.faulted.startswith("3 consecutive faulty frames")
    assert engine.latest_chunk() is None, "no stale chunk survives a safe stop"
    r = queued.result(0)
    assert r.finish_reason == "error" and "engine stopped after repeated faults" in r.error
    refused = engine.submit(TextRequest("hello?", max_tokens=4)).result(0)
    assert refused.finish_reason == "refused" and "repeated faults" in refused.error
    engine.run_cycle(obs(5))
    assert engine.latest_chunk() is None, "no actions while stopped"
    engine.runner.prefill = real
    engine.reset_fault()
    engine.run_cycle(obs(6))
    assert engine.latest_chunk().plan.stamp_s == obs(6).stamp_s
    assert engine.runner.pool.blocks.num_used == 0


@pytest.mark.timing
def test_a_burst_of_1000_requests_is_bounded_answered_or_refused_and_leaves_no_growth(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=4, max_queued_requests=64,
                            max_queued_per_owner=64,
                            max_active_requests=16)

    def burst():
        handles = [engine.submit(TextRequest(f"question {i}", max_tokens=4)) for i in range(1000)]
        refused = [h for h in handles if h.done()]
        assert len(refused) == 1000 - 64, "everything beyond the bounded queue is refused at once"
        assert all(h.result(0).error.startswith("busy:") for h in refused)
        drain(engine, limit=400)
        replies = [h.result(0) for h in handles]
        assert sum(r.success for r in replies) == 64
        assert all(r.success or r.finish_reason == "refused" for r in replies), "nothing lost or hanging"
        return replies

    burst()
    engine.run_cycle(obs(0))
    torch.manual_seed(0)
    before = rss_mb()
    burst()
    after = rss_mb()
    assert after - before < 20.0, f"memory grew by {after - before:.1f} MB over a second burst"
    assert engine.runner.pool.blocks.num_used == 0
    assert engine.stats.counter("refused_busy") == 2 * 936


@pytest.mark.timing
def test_short_soak_has_no_leak_and_answers_everything():
    from oxygen_ros.tools.soak import run

    out = run(seconds=25.0, preset="tiny", request_hz=4.0, max_tokens=8)
    print({k: v for k, v in out.items() if k != "samples"})
    assert out["requests"] > 40 and out["answered"] == out["requests"], out["failure_reasons"]
    assert out["pool_blocks_used_at_end"] == 0
    assert out["rss_growth_mb"] < 30.0
    assert out["captions"] >= 5
    assert np.isfinite(out["frame_ms_late"])


def test_an_invalid_observation_is_rejected_by_the_engine_too(engine_factory, obs):
    """Defence in depth: the nodes validate their inputs, and the engine checks what reaches it."""
    engine = engine_factory(policy="oxygen")
    bad = obs(0)
    bad.state[2] = float("nan")
    engine.run_cycle(bad)
    no_camera = obs(1, cameras=(False, False, False))
    engine.run_cycle(no_camera)
    assert engine.latest_chunk() is None
    assert engine.stats.counter("bad_observations") == 2 and engine.stats.snapshot()["frames"] == 0
    assert "no valid camera image" in engine.stats.snapshot()["last_error"]
    engine.run_cycle(obs(2))
    assert engine.latest_chunk() is not None and engine.runner.pool.blocks.num_used == 0
