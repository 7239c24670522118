"""One engine, several robots (issue #17, the engine side): per-robot mailboxes, chunks, policy I/O and
norm stats; frames of one cycle prefilled in one forward and denoised together; earliest deadline first
under max_robots_per_cycle; language attached to the owner's frame, admitted round-robin between owners;
captions and statistics per robot.

Numerics contract: a robot's chunk from a fleet cycle equals what a single-robot engine computes from the
same observation and noise within FLEET_TOL (float32 on the CPU; batched GEMMs round differently from
batch-1 ones: measured max |diff| 4.5e-6 on this model, 1.4e-6 on the `tiny` preset with |actions| ~ 4).
Within one fleet the three policies agree bitwise (they run the same frame path)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import SimClock, make_observation
from conftest import drain as run_until_idle
from oxygen_ros.engine.engine import EngineConfig
from oxygen_ros.engine.factory import build_engine
from oxygen_ros.engine.requests import TextRequest
from oxygen_ros.robot.policy_io import RobotIOConfig

FLEET_TOL = 2e-5
H, A = 5, 8                                           # the small model's horizon and action_dim
ROBOTS = {"arm": RobotIOConfig(robot_action_dim=7), "aloha": RobotIOConfig(robot_action_dim=6),
          "libero": RobotIOConfig(robot_action_dim=7, rotate_180=("base_0_rgb",))}


@pytest.fixture
def fleet(small_model):
    def make(robots=None, kv_budget_mb: float = 8.0, clock=None, **cfg):
        engine = build_engine(built_model=small_model, engine=EngineConfig(**cfg), kv_budget_mb=kv_budget_mb,
                              robots=ROBOTS if robots is None else robots)
        if clock is not None:
            engine.clock = clock
        return engine
    return make


def noises(names, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((H, A)).astype(np.float32) for n in names}


def observations(names, i=0):
    return {n: make_observation(i, seed=k + 1, prompt=f"task of {n}") for k, n in enumerate(names)}


def drain(engine):
    """Cycles with every robot's frame until no request is left."""
    run_until_idle(engine, frames=lambda i: observations(engine.robots, i))


# ---------------------------------------------------------------------------------------------- API, N = 1
def test_the_single_robot_engine_is_robot_empty(engine_factory, obs):
    engine = engine_factory()
    assert engine.robots == ("",) and engine.robot_info() is engine.info and engine.info.robot == ""
    engine.run_cycle(obs(0))
    assert engine.latest_chunk().robot == "" and engine.latest_chunk("") is engine.latest_chunk()
    with pytest.raises(ValueError, match="unknown robot 'b'"):
        engine.submit_observation(obs(1), robot="b")
    with pytest.raises(ValueError, match="unknown robot"):
        engine.latest_chunk("b")


# ---------------------------------------------------------------------------------------------- numerics
def test_each_robot_gets_what_a_single_robot_engine_computes(fleet, small_model):
    engine = fleet()
    names = engine.robots
    noise, obs = noises(names), observations(names)
    report = engine.run_frames(obs, noise)
    assert report.robots == list(names) and report.chunks == 3 and not report.fault
    assert len({engine.latest_chunk(n).plan.frame_index for n in names}) == 3
    for n in names:
        single = build_engine(built_model=small_model, engine=EngineConfig(), kv_budget_mb=8.0, robot_io=ROBOTS[n])
        single.run_cycle(obs[n], noise[n])
        want, got = single.latest_chunk(), engine.latest_chunk(n)
        assert got.robot == n and got.plan.stamp_s == obs[n].stamp_s
        assert got.plan.actions.shape == (H, ROBOTS[n].robot_action_dim)      # per robot action dims
        np.testing.assert_allclose(got.model_actions, want.model_actions, rtol=0, atol=FLEET_TOL)
        np.testing.assert_allclose(got.plan.actions, want.plan.actions, rtol=0, atol=FLEET_TOL)
    # the rotated camera really is another input: without rotate_180 the chunk differs by far more
    plain = build_engine(built_model=small_model, engine=EngineConfig(), kv_budget_mb=8.0, robot_io=ROBOTS["arm"])
    plain.run_cycle(obs["libero"], noise["libero"])
    assert np.abs(plain.latest_chunk().model_actions - engine.latest_chunk("libero").model_actions).max() > 1e-3
    assert engine.stats.snapshot()["pool_blocks_used"] == 0


def test_policies_agree_bitwise_per_robot_in_a_fleet(fleet):
    names = tuple(ROBOTS)
    results = {}
    for policy in ("isolated", "shared_kv", "oxygen"):
        engine = fleet(policy=policy, decode_budget="fixed", tokens_per_frame=2)
        handles, chunks = [], []
        for i in range(3):
            handles += [engine.submit(TextRequest(f"what does {n} see?", max_tokens=5, owner=n)) for n in names]
            engine.run_frames(observations(names, i), noises(names, seed=i))
            chunks.append([engine.latest_chunk(n).model_actions for n in names])
        drain(engine)
        results[policy] = (np.array(chunks), [h.result(0).tokens for h in handles])
        assert all(h.result(0).success for h in handles)
        assert engine.stats.snapshot()["pool_blocks_used"] == 0
    for policy in ("shared_kv", "oxygen"):
        np.testing.assert_array_equal(results[policy][0], results["isolated"][0])
        assert results[policy][1] == results["isolated"][1]


# ---------------------------------------------------------------------------------------------- mailboxes
def test_newest_wins_per_robot_and_robots_never_displace_each_other(fleet):
    engine = fleet()
    for i in range(3):
        engine.submit_observation(make_observation(i), robot="arm")
    engine.submit_observation(make_observation(7), robot="aloha")
    report = engine.run_frames()
    assert report.robots == ["arm", "aloha"]
    assert engine.latest_chunk("arm").plan.stamp_s == make_observation(2).stamp_s
    assert engine.latest_chunk("aloha").plan.stamp_s == make_observation(7).stamp_s
    assert engine.latest_chunk("libero") is None
    robots = engine.stats.snapshot()["robots"]
    assert robots["arm"]["dropped_observations"] == 2 and robots["aloha"]["dropped_observations"] == 0
    assert engine.stats.snapshot()["dropped_frames"] == 2


def test_earliest_deadline_first_when_a_cycle_cannot_take_every_robot(fleet):
    clock = SimClock()
    # arm's chunk covers 5 rows x 20 ms = 0.1 s; aloha and libero use the engine's frame period 5 / 10 Hz
    robots = {"arm": RobotIOConfig(control_period_s=0.02), "aloha": RobotIOConfig(), "libero": RobotIOConfig()}
    engine = fleet(robots=robots, clock=clock, max_robots_per_cycle=2, action_rate_hz=10.0)
    assert engine.robot_info("arm").chunk_period_s == pytest.approx(0.1)
    assert engine.robot_info("aloha").chunk_period_s == pytest.approx(0.5) == engine.frame_period
    engine.submit_observation(make_observation(0), robot="aloha")      # deadline 100.5
    clock.advance(0.1)
    engine.submit_observation(make_observation(1), robot="libero")     # deadline 100.6
    clock.advance(0.1)
    engine.submit_observation(make_observation(2), robot="arm")        # deadline 100.3: the earliest
    first = engine.run_frames()
    assert first.robots == ["arm", "aloha"] and first.deferred == ["libero"]
    assert engine.latest_chunk("libero") is None
    second = engine.run_frames()                                        # the deferred frame was not dropped
    assert second.robots == ["libero"] and second.deferred == []
    assert engine.latest_chunk("libero").plan.stamp_s == make_observation(1).stamp_s
    stats = engine.stats.snapshot()["robots"]
    assert stats["libero"]["deferred"] == 1 and stats["libero"]["dropped_observations"] == 0
    assert [stats[n]["chunks"] for n in robots] == [1, 1, 1]


def test_a_missed_deadline_is_counted_for_its_robot(fleet):
    clock = SimClock()
    engine = fleet(robots={"a": RobotIOConfig(), "b": RobotIOConfig()}, clock=clock, action_rate_hz=10.0)
    engine.submit_observation(make_observation(0), robot="a")
    clock.advance(0.6)                                     # a's frame period (0.5 s) passed before the cycle
    engine.run_frames({"b": make_observation(1)})
    stats = engine.stats.snapshot()["robots"]
    assert (stats["a"]["deadline_misses"], stats["b"]["deadline_misses"]) == (1, 0)
    assert stats["a"]["chunks"] == stats["b"]["chunks"] == 1


def test_a_bad_observation_fails_only_its_robot(fleet):
    engine = fleet()
    obs = observations(engine.robots)
    obs["aloha"].images["base_0_rgb"] = np.zeros((4, 4), np.uint8)          # not an RGB image
    report = engine.run_frames(obs)
    assert report.robots == ["arm", "libero"] and report.chunks == 2
    assert engine.latest_chunk("aloha") is None
    stats = engine.stats.snapshot()
    assert stats["counters"]["bad_observations"] == 1 and stats["robots"]["aloha"]["bad_observations"] == 1
    assert "of robot 'aloha'" in stats["last_error"]


def test_a_faulty_frame_is_discarded_for_its_robot_only(fleet):
    engine = fleet()
    real = engine.runner.actions

    def one_nan(frames, noise, steps=None):
        out = real(frames, noise, steps)
        from oxygen_ros.engine.model_runner import EngineFault
        return [EngineFault("injected: NaN") if i == 1 else a for i, a in enumerate(out)]

    engine.runner.actions = one_nan
    report = engine.run_frames(observations(engine.robots))
    assert report.chunks == 2 and report.fault == "injected: NaN"
    assert engine.latest_chunk("aloha") is None and engine.latest_chunk("arm") is not None
    assert engine.stats.snapshot()["robots"]["aloha"]["faults"] == 1 and not engine.faulted
    assert engine.stats.snapshot()["pool_blocks_used"] == 0


def test_unknown_robots_in_a_cycle_are_refused_before_anything_runs(fleet):
    engine = fleet()
    with pytest.raises(ValueError, match=r"unknown robots \['ghost'\]"):
        engine.run_frames({"arm": make_observation(0), "ghost": make_observation(1)})
    assert engine.latest_chunk("arm") is None and engine.stats.counter("cycles") == 0


# ---------------------------------------------------------------------------------------------- language
def test_a_request_is_answered_about_its_owners_camera(fleet):
    engine = fleet(decode_budget="fixed", tokens_per_frame=4)
    names = engine.robots
    obs = observations(names)
    handles = {n: engine.submit(TextRequest("what is on the table?", max_tokens=4, owner=n)) for n in names}
    engine.run_frames(obs)
    drain(engine)
    for n in names:
        r = handles[n].result(0)
        assert r.success and r.frame_stamp == obs[n].stamp_s
    frames = {n: handles[n].result(0).frame_index for n in names}
    assert len(set(frames.values())) == 3, "each reply attached to its own robot's frame"
    # the same question about different cameras gets the frame of the owner: compare with single engines
    for n in names:
        single = build_engine(built_model=engine.runner.model, engine=EngineConfig(decode_budget="fixed",
                              tokens_per_frame=4), kv_budget_mb=8.0, robot_io=ROBOTS[n])
        h = single.submit(TextRequest("what is on the table?", max_tokens=4))
        single.run_cycle(obs[n])
        while single.active_requests:
            single.run_cycle(None)
        assert h.result(0).tokens == handles[n].result(0).tokens


def test_owner_must_name_a_robot_of_the_fleet(fleet):
    engine = fleet()
    r = engine.submit(TextRequest("what is on the table?", max_tokens=4)).result(0)
    assert r.finish_reason == "refused" and "owner is empty but this engine serves several robots" in r.error
    r = engine.submit(TextRequest("what is on the table?", max_tokens=4, owner="ghost")).result(0)
    assert r.finish_reason == "refused" and "owner 'ghost' is not a robot" in r.error


def test_owner_empty_means_the_only_robot(fleet):
    engine = fleet(robots={"solo": RobotIOConfig()})
    h = engine.submit(TextRequest("what is on the table?", max_tokens=3))
    engine.run_frames({"solo": make_observation(0)})
    drain(engine)
    assert h.result(0).success


def test_a_burst_from_one_robot_cannot_starve_another(fleet):
    engine = fleet(robots={"a": RobotIOConfig(), "b": RobotIOConfig()}, max_active_requests=4,
                   decode_budget="fixed", tokens_per_frame=1, kv_budget_mb=16.0, max_queued_per_owner=30)
    burst = [engine.submit(TextRequest(f"question {i} from a", max_tokens=8, owner="a")) for i in range(30)]
    late = engine.submit(TextRequest("question from b", max_tokens=8, owner="b"))
    engine.run_frames(observations(engine.robots, 0))
    waiting = [s.handle for s in engine.scheduler.waiting]
    assert late not in waiting, "b's one request is admitted in the first cycle beside a's burst"
    assert len(waiting) == 27 and sum(h not in waiting for h in burst) == 3
    drain(engine)
    assert late.result(0).queue_s < burst[-1].result(0).queue_s
    assert late.result(0).success and all(h.result(0).success for h in burst)


def test_round_robin_alternates_owners_across_cycles(fleet):
    engine = fleet(robots={"a": RobotIOConfig(), "b": RobotIOConfig()}, max_active_requests=2,
                   decode_budget="fixed", tokens_per_frame=1, kv_budget_mb=16.0)
    a = [engine.submit(TextRequest(f"a {i}", max_tokens=1, owner="a")) for i in range(4)]
    b = [engine.submit(TextRequest(f"b {i}", max_tokens=1, owner="b")) for i in range(4)]
    for i in range(4):
        engine.run_frames(observations(engine.robots, i))
    done_a = [h.result(0).frame_index for h in a]
    done_b = [h.result(0).frame_index for h in b]
    # two slots per cycle, one per owner: each cycle answers one of a's and one of b's
    assert len(set(done_a)) == 4 and len(set(done_b)) == 4


def test_captions_per_robot(fleet):
    engine = fleet(robots={"a": RobotIOConfig(), "b": RobotIOConfig()}, memory_every_frames=1,
                   memory_max_tokens=3, decode_budget="fixed", tokens_per_frame=4)
    seen = []
    engine.add_caption_listener(seen.append)
    obs = observations(engine.robots)
    engine.run_frames(obs)
    drain(engine)
    first = {c.robot: c for c in engine.captions()[:2]}
    assert set(first) == {"a", "b"} and seen[:2] == engine.captions()[:2]
    assert first["a"].stamp == obs["a"].stamp_s and first["a"].frame_index != first["b"].frame_index


# ---------------------------------------------------------------------------------------------- build_engine
def test_each_robot_has_its_own_norm_stats(tmp_path, small_model):
    from test_engine_normalization import norm_stats

    path = norm_stats(tmp_path / "norm_stats.json")
    engine = build_engine(built_model=small_model, kv_budget_mb=8.0, norm_stats={"raw": None, "normed": path},
                          robots={"raw": RobotIOConfig(), "normed": RobotIOConfig()})
    obs, noise = make_observation(0), noises(["x"])["x"]
    engine.run_frames({"raw": obs, "normed": obs}, {"raw": noise, "normed": noise})
    raw, normed = engine.latest_chunk("raw"), engine.latest_chunk("normed")
    assert np.abs(raw.plan.actions - normed.plan.actions).max() > 1e-3
    single = build_engine(built_model=small_model, kv_budget_mb=8.0, norm_stats=path)
    single.run_cycle(obs, noise)
    np.testing.assert_allclose(normed.plan.actions, single.latest_chunk().plan.actions, rtol=0, atol=1e-4)


def test_build_engine_lists_every_robot_problem(small_model, tmp_path):
    with pytest.raises(ValueError) as e:
        build_engine(built_model=small_model, robot_io=RobotIOConfig(), robots={"a": RobotIOConfig(), 3: "x"},
                     norm_stats={"a": None, "zz": None})
    msg = str(e.value)
    assert "not both" in msg and "robot name 3 must be text" in msg and "expected a RobotIOConfig" in msg
    with pytest.raises(ValueError) as e:
        build_engine(built_model=small_model, robots={"a": RobotIOConfig(), "b": RobotIOConfig()},
                     norm_stats={"a": None, "zz": None})
    assert "no source for robots ['b']" in str(e.value) and "robots ['zz'] this engine does not serve" in str(e.value)
    with pytest.raises(ValueError, match="cannot hold two cycles of 3 frame prefixes"):
        build_engine(built_model=small_model, robots=ROBOTS, kv_budget_mb=0.1)
    build_engine(built_model=small_model, kv_budget_mb=0.1)          # one robot fits in the same pool


def test_robot_info_per_robot(fleet):
    engine = fleet()
    assert engine.robots == tuple(ROBOTS)
    assert [engine.robot_info(n).action_dim for n in engine.robots] == [7, 6, 7]
    assert engine.info is engine.robot_info("arm")
    with pytest.raises(ValueError, match="unknown robot"):
        engine.robot_info("")


# ---------------------------------------------------------------------------------------------- robots at run time
def test_robots_added_at_run_time_are_served_like_built_ones(fleet, small_model):
    """An engine built with no robot (a server waiting for clients) gets robots added later; each added
    robot's chunk equals a built fleet's for the same frames (the same cycle code)."""
    from oxygen_ros.engine.factory import robot_preparer

    built = fleet()
    empty = fleet(robots={})
    assert empty.robots == () and empty.run_frames().chunks == 0
    for n, io in ROBOTS.items():
        info = empty.add_robot(n, robot_preparer(small_model.cfg, empty.tokenizer, io))
        assert info == built.robot_info(n)
    noise, obs = noises(ROBOTS), observations(ROBOTS)
    built.run_frames(obs, noise)
    empty.run_frames(obs, noise)
    for n in ROBOTS:
        assert np.array_equal(built.latest_chunk(n).plan.actions, empty.latest_chunk(n).plan.actions)
    with pytest.raises(ValueError, match="already served"):
        empty.add_robot("arm", robot_preparer(small_model.cfg, empty.tokenizer, ROBOTS["arm"]))


def test_a_removed_robot_ends_its_requests_and_its_frame_and_frees_its_kv(fleet):
    engine = fleet(decode_budget="fixed", tokens_per_frame=1)
    engine.run_frames(observations(engine.robots), noises(engine.robots))
    running = engine.submit(TextRequest("what is on the table?", max_tokens=8, owner="arm"))
    other = engine.submit(TextRequest("what is on the table?", max_tokens=8, owner="aloha"))
    engine.run_frames(observations(engine.robots, 1), noises(engine.robots))    # admitted, decoding
    queued = engine.submit(TextRequest("and now?", max_tokens=8, owner="arm"))
    engine.submit_observation(make_observation(2), robot="arm")                    # pending frame
    engine.remove_robot("arm", reason="client disconnected")
    reply = queued.result(0)                                     # queued: ended at once
    assert not reply.success and reply.error == "client disconnected"
    assert engine.robots == ("aloha", "libero") and "arm" not in engine.stats.snapshot()["robots"]
    with pytest.raises(ValueError, match="unknown robot 'arm'"):
        engine.submit_observation(make_observation(3), robot="arm")
    assert not engine.submit(TextRequest("hi", owner="arm")).result(0).success
    report = engine.run_frames({"aloha": make_observation(4)})   # running: ended at the next cycle's start
    assert running.result(0).error == "client disconnected" and "arm" not in report.robots
    drain(engine)
    assert other.result(0).success
    assert engine.runner.pool.blocks.num_used == 0
    with pytest.raises(ValueError, match="unknown robot 'arm'"):
        engine.remove_robot("arm")


def test_a_discarded_frame_is_said_to_the_discard_listeners_and_captions_are_per_robot(fleet, small_model):
    """A server waiting for a robot's chunk learns at once that none will come, and why; a robot added with
    captions=False gets none (a socket client reads no caption topic)."""
    from oxygen_ros.engine.factory import robot_preparer

    engine = fleet(memory_every_frames=1)
    engine.add_robot("quiet", robot_preparer(small_model.cfg, engine.tokenizer, ROBOTS["arm"]), captions=False)
    said = []
    engine.add_discard_listener(lambda robot, why: said.append((robot, why)))
    bad = make_observation(0)
    bad.state[:] = np.nan
    engine.run_frames({"arm": bad, "aloha": make_observation(0, seed=2), "quiet": make_observation(0, seed=3)})
    assert said == [("arm", "observation rejected: state must be a finite vector, got [nan, nan, nan, nan, nan, "
                            "nan, nan, nan]")]
    run_until_idle(engine, frames=lambda i: {})
    assert {c.robot for c in engine.captions()} == {"aloha"} and engine.latest_chunk("quiet") is not None
    from oxygen_ros.engine.model_runner import EngineFault
    engine.runner.actions = lambda frames, *a, **k: [EngineFault("injected") for _ in frames]
    engine.run_frames({"aloha": make_observation(1, seed=2)})
    assert said[-1] == ("aloha", "the engine discarded this frame: injected")


def test_robots_come_and_go_while_the_engine_thread_runs(fleet, small_model):
    """Clients connecting and leaving during cycles: nothing raises on the engine thread, every request is
    answered, the pool ends empty."""
    from oxygen_ros.engine.factory import robot_preparer

    engine = fleet(robots={}, decode_budget="fixed", tokens_per_frame=2)
    errors = []
    engine.add_chunk_listener(lambda c: None if c.plan.actions.shape[1] == 7 else errors.append(c))
    engine.start()
    handles = []
    try:
        for k in range(6):
            name = f"client{k}"
            engine.add_robot(name, robot_preparer(small_model.cfg, engine.tokenizer, ROBOTS["arm"]))
            for i in range(3):
                engine.submit_observation(make_observation(i, seed=k), robot=name)
                handles.append(engine.submit(TextRequest("what is on the table?", max_tokens=4, owner=name)))
            if k % 2:
                engine.remove_robot(f"client{k - 1}")
        for h in handles:
            h.result(timeout=60)                                   # answered (success or the reason)
    finally:
        assert engine.stop()
    assert not errors and engine.stats.counter("listener_errors") == 0
    assert engine.robots == ("client1", "client3", "client5")
    assert engine.runner.pool.blocks.num_used == 0


# ---------------------------------------------------------------------------------------------- thread
def test_the_engine_thread_serves_every_robot(fleet):
    engine = fleet(decode_budget="fixed", tokens_per_frame=4)
    got = {}
    engine.add_chunk_listener(lambda c: got.setdefault(c.robot, c))
    engine.start()
    try:
        handles = [engine.submit(TextRequest("what is on the table?", max_tokens=3, owner=n)) for n in engine.robots]
        for n, o in observations(engine.robots).items():
            engine.submit_observation(o, robot=n)
        for h in handles:
            assert h.result(timeout=60).success
    finally:
        assert engine.stop()
    assert set(got) == set(engine.robots)
    assert json.dumps(engine.stats.snapshot()["robots"])       # plain numbers (diagnostics)


# ---------------------------------------------------------------------------------------------- benchmark
def test_fleet_benchmark_json(tmp_path):
    """`python -m oxygen_ros.bench --robots 2` for a few frames: the JSON's fields, every robot got its chunks,
    both settings did the same work. No timing is asserted (the figures live in docs/fleet_bench_*.json)."""
    from oxygen_ros.bench.__main__ import main

    out = tmp_path / "fleet.json"
    assert main(["--preset", "tiny", "--robots", "2", "--frames", "3", "--reply-tokens", "4", "--tokens-per-frame", "2",
                 "--repeat", "1", "--warmup-frames", "1", "--json", str(out), "--quiet"]) == 0
    result = json.loads(out.read_text())
    fleet = result["fleet"]
    assert fleet["robots"] == 2 and fleet["preset"] == "tiny" and [p["robots"] for p in result["scaling"]] == [2]
    for name in ("batched", "separate"):
        s = fleet[name]
        for key in ("per_robot_action_hz", "aggregate_tokens_per_s", "round_ms_mean", "aggregate_action_hz"):
            assert isinstance(s[key], float) and s[key] > 0, (name, key)
        assert len(s["per_robot_action_hz_all"]) == 2
        assert s["per_robot_action_hz"] == min(s["per_robot_action_hz_all"])
        assert isinstance(s["deadline_misses"], int) and 0 <= s["deadline_misses"] <= 2 * 3
        assert s["chunks"] == {"r0": 3, "r1": 3}, "every robot got a chunk every round"
        assert s["tokens"] == 2 * 3 * 4 and s["replies_failed"] == 0       # one request per robot and frame
        # per-robot rate = horizon x chunks / frame-round time
        assert s["per_robot_action_hz"] == pytest.approx(10 * 3 / (3 * s["round_ms_mean"] / 1e3))
    eq = fleet["equivalence"]
    assert eq["actions_within_tolerance"] and eq["replies_compared"] == 6
    assert fleet["pool_empty_at_end"]
    assert result["meta"]["command"].startswith("python -m oxygen_ros.bench --preset tiny --robots 2")
    assert fleet["engine_robot_stats"]["r1"]["chunks"] >= 3
