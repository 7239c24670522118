"""The preparer thread (issue #12): camera images are converted to model inputs beside the engine thread,
once per frame cycle at most, and the chunks are bitwise those of inline preparation."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from conftest import make_observation
from oxygen_ros.engine.engine import EngineConfig
from oxygen_ros.engine.factory import build_engine
from oxygen_ros.robot.policy_io import RobotIOConfig

ROBOTS = {"plain": RobotIOConfig(robot_action_dim=7),
          "libero": RobotIOConfig(robot_action_dim=7, rotate_180=("base_0_rgb", "left_wrist_0_rgb"))}


def make(small_model, **cfg):
    cfg.setdefault("prepare_ahead", True)          # on a CPU model the default (auto) is off
    return build_engine(built_model=small_model, engine=EngineConfig(**cfg), kv_budget_mb=8.0, robots=ROBOTS)


class Chunks:
    """Collects chunks from the engine thread; wait(n) until n have come."""

    def __init__(self, engine):
        self.items, self._cv = [], threading.Condition()
        engine.add_chunk_listener(self._add)

    def _add(self, chunk):
        with self._cv:
            self.items.append(chunk)
            self._cv.notify_all()

    def wait(self, n: int, timeout: float = 60.0):
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.items) >= n, timeout), f"{len(self.items)} of {n} chunks"
            return list(self.items)


def test_chunks_prepared_ahead_are_bitwise_those_prepared_inline(small_model):
    rng = np.random.default_rng(3)
    noise = rng.standard_normal((5, 8)).astype(np.float32)
    inline = make(small_model)
    threaded = make(small_model)
    got = Chunks(threaded)
    threaded.start()
    try:
        for i in range(3):
            for n, robot in enumerate(ROBOTS):
                obs = make_observation(i, size=120 + 40 * n, seed=n)     # images the preparer must resize
                threaded.submit_observation(obs, noise, robot=robot)
                got.wait(2 * i + n + 1)
                inline.run_cycle(obs, noise, robot=robot)
                want, have = inline.latest_chunk(robot), threaded.latest_chunk(robot)
                assert have.plan.stamp_s == obs.stamp_s
                np.testing.assert_array_equal(have.model_actions, want.model_actions)
                np.testing.assert_array_equal(have.plan.actions, want.plan.actions)
    finally:
        assert threaded.stop()
    counters = threaded.stats.snapshot()["counters"]
    assert counters["frames_prepared_ahead"] == 6, "every frame came prepared by the preparer thread"
    assert inline.stats.snapshot()["counters"].get("frames_prepared_ahead", 0) == 0    # run_cycle: inline
    assert threaded.stats.snapshot()["pool_blocks_used"] == 0


def test_bad_observations_prepared_ahead_are_still_counted(small_model):
    engine = make(small_model)
    got = Chunks(engine)
    engine.start()
    try:
        bad = make_observation(0)
        bad.images["base_0_rgb"] = np.zeros((8, 8, 3), np.float32)           # not uint8
        engine.submit_observation(bad, robot="libero")
        deadline = time.monotonic() + 30
        while engine.stats.snapshot()["robots"]["libero"]["bad_observations"] < 1:
            assert time.monotonic() < deadline, "the bad observation was never counted"
            time.sleep(0.01)
        engine.submit_observation(make_observation(1), robot="libero")        # the robot keeps being served
        assert got.wait(1)[0].robot == "libero"
    finally:
        assert engine.stop()
    stats = engine.stats.snapshot()
    assert stats["counters"]["bad_observations"] == 1 and "expected an RGB uint8 image" in stats["last_error"]


def test_conversions_are_bounded_by_the_frame_rate_not_the_camera_rate(small_model):
    engine = make(small_model, prepare_ahead=True)
    real = engine.runner.actions

    def slow(*args, **kwargs):                # a slow device: each frame cycle takes >= 50 ms
        time.sleep(0.05)
        return real(*args, **kwargs)

    engine.runner.actions = slow
    engine.start()
    try:
        for i in range(150):                  # a camera much faster than the engine
            engine.submit_observation(make_observation(i % 4), robot="plain")
            time.sleep(0.002)
    finally:
        assert engine.stop()
    frames = engine.stats.snapshot()["robots"]["plain"]["frames"]
    conversions = engine._preparer_thread.conversions
    assert frames >= 1 and conversions <= 2 * frames + 2, (conversions, frames)
    assert engine.stats.snapshot()["robots"]["plain"]["dropped_observations"] >= 150 - conversions - 1


@pytest.mark.parametrize("setting", [False, None])
def test_prepare_ahead_off_converts_on_the_engine_thread(small_model, setting):
    engine = make(small_model, prepare_ahead=setting)        # None on a CPU model: off
    assert engine.prepare_ahead is False
    got = Chunks(engine)
    engine.start()
    try:
        engine.submit_observation(make_observation(0, size=200), robot="plain")
        got.wait(1)
    finally:
        assert engine.stop()
    assert engine._preparer_thread.conversions == 0
    assert engine.stats.snapshot()["counters"].get("frames_prepared_ahead", 0) == 0


@pytest.mark.parametrize("size", [(1080, 1920)])
def test_a_full_resolution_frame_is_converted_off_the_engine_thread(small_model, size):
    """The measurement itself is in the README (no timed assertion here): with prepare_ahead the cycle's
    inline preparation time is zero, the conversion ran on the preparer thread."""
    engine = make(small_model)
    got = Chunks(engine)
    rng = np.random.default_rng(0)
    obs = make_observation(0)
    obs.images = {s: (rng.integers(0, 256, (*size, 3), dtype=np.uint8) if on else None)
                  for s, on in obs.image_masks.items()}
    engine.start()
    try:
        engine.submit_observation(obs, robot="libero")
        got.wait(1)
    finally:
        assert engine.stop()
    snap = engine.stats.snapshot()
    assert snap["counters"]["frames_prepared_ahead"] == 1 and snap["prepare_ms_mean"] == 0.0


def test_the_preparer_converts_once_per_cycle_and_just_before_the_cycle_ends():
    """The timing rule without threads, on a simulated clock: a conversion may start its measured duration
    before the running cycle's predicted end, once per robot per cycle (again once its result is taken)."""
    from conftest import SimClock
    from oxygen_ros.engine.intake import Intake, Pending, PreparerThread

    clock = SimClock(100.0)
    intake = Intake(("a",))
    prep = PreparerThread(intake, {}, clock)
    prep._cycle_s, prep._prepare_s["a"] = 0.2, 0.05          # measured: 200 ms cycles, 50 ms conversions
    raw = Pending(obs=object(), noise=None, deadline=0.0)

    def take():
        with intake.cv:
            return prep._next()

    intake.put("a", raw)
    prep.cycle_started(clock())                            # the cycle ends at about 100.2
    assert prep.not_before == pytest.approx(100.15)
    assert take() is None, "too early: the frame would be stale by the time the cycle takes it"
    clock.advance(0.16)
    assert take() == ("a", raw) and intake.raw["a"] is None
    intake.put_ready("a", raw)
    intake.put("a", raw)                                    # a newer image during the same cycle...
    assert take() is None, "...is not converted again while the prepared one waits"
    prep.cycle_ended(0.2, frame=True)
    taken, deferred = intake.take_due(limit=1, prepared_only=True)
    assert taken == {"a": raw} and deferred == [] and intake.raw["a"] is raw
    prep.cycle_started(clock())
    assert take() is None                                   # the next cycle's lead applies again
    prep.cycle_ended(0.2, frame=True)                        # between cycles: at once
    assert take() == ("a", raw)


@pytest.mark.parametrize("value, expected", [("on", True), ("off", False), ("auto", False)])   # auto: CPU here
def test_the_engine_node_parameter_sets_prepare_ahead(tmp_path, value, expected):
    from ros_harness import engine_node_in_process, private_domain

    with engine_node_in_process(tmp_path, f"model: tiny\nkv_budget_mb: 8.0\nprepare_ahead: '{value}'",
                                private_domain(41)) as node:
        node.trigger_configure()
        assert node.engine is not None, node.failure
        assert node.engine.prepare_ahead is expected
        assert dict((v.key, v.value) for s in node._engine_status() for v in s.values)["prepare_ahead"] == str(expected)
