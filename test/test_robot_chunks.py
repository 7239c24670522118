import math
import random
from fractions import Fraction

import numpy as np
import pytest

from oxygen_ros.robot.chunks import STATUSES, ActionChunkPlan, ChunkFollower, TickCommand
from oxygen_ros.robot.errors import ActionError, ConfigError, TimeError
from oxygen_ros.robot.trajectory import chunk_to_trajectory_points, seconds_to_duration, stamp_to_seconds

DT = 0.02


def plan(frame, t0, rows=10, dims=2, offset=0.0, dt=DT):
    """Row k holds offset + k in every dimension, so an action tells which row it came from."""
    actions = offset + np.repeat(np.arange(rows, dtype=np.float64)[:, None], dims, axis=1)
    return ActionChunkPlan(actions=actions, stamp_s=t0, step_period_s=dt, frame_index=frame)


def test_no_chunk():
    follower = ChunkFollower()
    assert follower.next(1.0) == TickCommand(None, -1, -1, "no_chunk")
    assert follower.age_s(1.0) is None


def test_row_is_aligned_to_the_observation_time():
    follower = ChunkFollower()
    follower.push(plan(3, t0=100.0, rows=50))
    for k in range(50):
        now = 100.0 + k * DT  # exactly on row k's time, despite float rounding
        cmd = follower.next(now)
        assert (cmd.index, cmd.status, cmd.frame_index) == (k, "ok", 3)
        assert cmd.action.tolist() == [k, k]
    assert follower.next(100.0 + 4.99 * DT).index == 4
    assert follower.next(100.0 + 5.01 * DT).index == 5


def test_rows_in_the_past_are_skipped():
    # The chunk arrives 130 ms after its observation: rows for t0 .. t0 + 120 ms are already late.
    follower = ChunkFollower()
    follower.push(plan(1, t0=5.0))
    assert follower.next(5.13).index == 6
    assert follower.age_s(5.13) == pytest.approx(0.13)


def test_before_the_observation_time_uses_the_first_row():
    follower = ChunkFollower()
    follower.push(plan(1, t0=5.0))
    assert follower.next(4.999).index == 0


def test_newer_chunk_replaces_the_old_one():
    follower = ChunkFollower()
    follower.push(plan(1, t0=0.0))
    assert follower.next(0.05).action[0] == 2
    assert follower.push(plan(2, t0=0.04, offset=100.0))
    cmd = follower.next(0.061)
    assert (cmd.frame_index, cmd.index, cmd.status) == (2, 1, "ok")
    assert cmd.action[0] == 101


def test_out_of_order_and_duplicate_chunks_are_ignored():
    follower = ChunkFollower()
    assert follower.push(plan(5, t0=1.0))
    assert not follower.push(plan(4, t0=0.9, offset=100))  # late
    assert not follower.push(plan(5, t0=1.0, offset=100))  # duplicate
    assert follower.stats == {"chunks_accepted": 1, "chunks_ignored": 2, "chunks_superseded": 0}
    assert follower.next(1.0).action[0] == 0
    assert follower.push(plan(0, t0=2.0))  # the engine restarted: frame 0 again, but newer
    assert follower.next(2.0).frame_index == 0


def test_hold_repeats_the_last_row():
    follower = ChunkFollower(on_exhausted="hold")
    follower.push(plan(1, t0=0.0, rows=4))
    assert follower.next(3 * DT).status == "ok"
    for now in (4 * DT, 10.0):
        cmd = follower.next(now)
        assert (cmd.index, cmd.status) == (3, "hold")
        assert cmd.action.tolist() == [3, 3]


def test_stop_returns_no_action():
    follower = ChunkFollower(on_exhausted="stop")
    follower.push(plan(7, t0=0.0, rows=4))
    assert follower.next(3.5 * DT).status == "ok"
    assert follower.next(4 * DT) == TickCommand(None, 7, -1, "stopped")


def test_blending_ramps_from_the_old_chunks_row_for_the_same_time():
    follower = ChunkFollower(execution="blend", blend_steps=3)
    follower.push(plan(1, t0=0.0, rows=50))  # row k = k
    follower.next(0.1)
    follower.push(plan(2, t0=0.1, rows=50, offset=100.0))  # row k = 100 + k
    outputs = []
    for tick in range(5):
        now = 0.14 + tick * DT
        cmd = follower.next(now)
        old_row, new_row = round(now / DT), round((now - 0.1) / DT)
        assert cmd.index == new_row
        outputs.append((cmd.status, cmd.action[0], old_row, 100 + new_row))
    for i, (status, value, old, new) in enumerate(outputs[:3]):
        w = (i + 1) / 4
        assert status == "blending"
        assert value == pytest.approx((1 - w) * old + w * new)
    assert [o[0] for o in outputs[3:]] == ["ok", "ok"]
    assert [o[1] for o in outputs[3:]] == [o[3] for o in outputs[3:]]


def test_no_blend_when_the_old_chunk_no_longer_covers_now():
    follower = ChunkFollower(execution="blend", blend_steps=3)
    follower.push(plan(1, t0=0.0, rows=4))  # covers up to 0.08
    follower.push(plan(2, t0=0.2, offset=100.0))
    cmd = follower.next(0.2)
    assert (cmd.status, cmd.action[0]) == ("ok", 100)
    assert follower.next(0.22).status == "ok"  # the blend is over, not resumed


def test_chunk_arriving_mid_blend_blends_from_the_chunk_being_blended_in():
    follower = ChunkFollower(execution="blend", blend_steps=2)
    follower.push(plan(1, t0=0.0, rows=50))
    follower.push(plan(2, t0=0.0, rows=50, offset=100.0))
    assert follower.next(0.0).status == "blending"
    follower.push(plan(3, t0=0.0, rows=50, offset=200.0))
    cmd = follower.next(0.0)
    assert cmd.status == "blending"
    assert cmd.action[0] == pytest.approx((2 / 3) * 100 + (1 / 3) * 200)


def test_blend_stops_when_the_new_chunk_is_exhausted():
    follower = ChunkFollower(execution="blend", blend_steps=5, on_exhausted="hold")
    follower.push(plan(1, t0=0.0, rows=50))
    follower.push(plan(2, t0=0.0, rows=2, offset=100.0))
    assert follower.next(0.0).status == "blending"
    assert follower.next(0.5).status == "hold"


def test_statuses_are_the_documented_ones():
    assert set(STATUSES) == {"ok", "blending", "hold", "stopped", "no_chunk"}


def test_returned_action_is_a_copy():
    follower = ChunkFollower()
    follower.push(plan(1, t0=0.0))
    follower.next(0.0).action[:] = 42
    assert follower.next(0.0).action[0] == 0


def test_plan_copies_and_validates():
    actions = np.zeros((3, 2))
    p = ActionChunkPlan(actions, 0.0, DT, 1)
    actions[:] = 9
    assert p.actions.max() == 0 and p.horizon == 3
    assert p.time_of_row(2) == pytest.approx(0.04) and p.row_at(0.04) == 2
    bad = np.zeros((4, 2))
    bad[1, 0], bad[3, 1] = np.nan, np.inf
    with pytest.raises(ActionError, match=r"action chunk of frame 9: non-finite actions in rows \[1, 3\]"):
        ActionChunkPlan(bad, 0.0, DT, 9)
    with pytest.raises(ActionError, match=r"non-empty \[H, D\] array, got shape \(4,\)"):
        ActionChunkPlan(np.zeros(4), 0.0, DT, 1)
    with pytest.raises(ActionError, match=r"non-empty \[H, D\] array, got shape \(0, 2\)"):
        ActionChunkPlan(np.zeros((0, 2)), 0.0, DT, 1)
    with pytest.raises(ActionError, match="step_period_s 0 must be positive"):
        ActionChunkPlan(np.zeros((2, 2)), 0.0, 0, 1)
    with pytest.raises(ActionError, match="stamp_s nan is not finite"):
        ActionChunkPlan(np.zeros((2, 2)), float("nan"), DT, 1)


def test_follower_errors():
    follower = ChunkFollower()
    follower.push(plan(1, 0.0, dims=2))
    with pytest.raises(ActionError, match="frame 2 has 3 action dims, the current chunk has 2"):
        follower.push(plan(2, 1.0, dims=3))
    with pytest.raises(ActionError, match="now_s nan is not finite"):
        follower.next(float("nan"))
    with pytest.raises(ConfigError, match="on_exhausted 'drift' must be 'hold' or 'stop'"):
        ChunkFollower(on_exhausted="drift")
    with pytest.raises(ConfigError, match="blend_steps -1 must be >= 0"):
        ChunkFollower(execution="blend", blend_steps=-1)


# --- trajectory ----------------------------------------------------------------------------------

def test_trajectory_points_from_start_index():
    actions = np.arange(12, dtype=np.float64).reshape(4, 3)
    points = chunk_to_trajectory_points(actions, 0.1, start_index=2)
    assert points == [([6.0, 7.0, 8.0], 0.0), ([9.0, 10.0, 11.0], pytest.approx(0.1))]
    assert all(isinstance(p[0], list) and isinstance(p[0][0], float) for p in points)


def test_trajectory_keeps_chunk_timing_with_an_offset():
    p = plan(1, t0=10.0, rows=10)
    now = 10.05  # row 2 is playing; row 3 is due in 10 ms
    start = p.row_at(now) + 1
    points = chunk_to_trajectory_points(p.actions, DT, start, p.time_of_row(start) - now)
    assert [pts[0][0] for pts in points] == [3, 4, 5, 6, 7, 8, 9]
    for j, (_, t) in enumerate(points):
        assert now + t == pytest.approx(p.time_of_row(start + j))


def test_trajectory_errors():
    actions = np.zeros((4, 2))
    with pytest.raises(ActionError, match=r"start_index 4 is outside the chunk's rows 0..3"):
        chunk_to_trajectory_points(actions, 0.1, 4)
    with pytest.raises(ActionError, match="step_period_s -0.1 must be positive"):
        chunk_to_trajectory_points(actions, -0.1, 0)
    with pytest.raises(ActionError, match="first_offset_s -0.5 must be >= 0"):
        chunk_to_trajectory_points(actions, 0.1, 0, -0.5)
    actions[3, 1] = np.nan
    with pytest.raises(ActionError, match=r"non-finite actions in rows \[3\]"):
        chunk_to_trajectory_points(actions, 0.1, 1)


@pytest.mark.parametrize("seconds,expected", [
    (0, (0, 0)),
    (1.5, (1, 500_000_000)),
    (-1.5, (-2, 500_000_000)),
    (-0.000_000_001, (-1, 999_999_999)),
    (0.1, (0, 100_000_000)),
    (0.999_999_999_9, (1, 0)),  # rounds up into the next second
    (1e-10, (0, 0)),
    (7, (7, 0)),
    (2**31 - 1, (2**31 - 1, 0)),
])
def test_seconds_to_duration(seconds, expected):
    assert seconds_to_duration(seconds) == expected


@pytest.mark.parametrize("bad,message", [
    (float("nan"), "duration nan s is not finite"),
    (float("inf"), "duration inf s is not finite"),
    (2.0**31, "does not fit a ROS time"),
    ("soon", "duration 'soon' is not a number"),
])
def test_seconds_to_duration_errors(bad, message):
    with pytest.raises(TimeError, match=message):
        seconds_to_duration(bad)


def test_stamp_to_seconds_is_the_nearest_float():
    assert stamp_to_seconds(-2, 500_000_000) == -1.5
    sec, ns = 1_700_000_000, 123_456_789
    assert stamp_to_seconds(sec, ns) == float(Fraction(sec * 10**9 + ns, 10**9))
    with pytest.raises(TimeError, match=r"stamp \(1.0, 0\) must be integers"):
        stamp_to_seconds(1.0, 0)


def test_stamp_round_trip_is_exact_below_a_million_seconds():
    rng = random.Random(0)
    for _ in range(2000):
        stamp = (rng.randrange(-1_000_000, 1_000_000), rng.randrange(10**9))
        assert seconds_to_duration(stamp_to_seconds(*stamp)) == stamp


def test_round_trip_of_wall_clock_stamps_is_within_a_float_ulp():
    rng = random.Random(1)
    for _ in range(200):
        stamp = (rng.randrange(1_600_000_000, 2_000_000_000), rng.randrange(10**9))
        sec, ns = seconds_to_duration(stamp_to_seconds(*stamp))
        error_ns = abs((sec - stamp[0]) * 10**9 + ns - stamp[1])
        assert error_ns <= math.ulp(2e9) * 1e9 / 2 + 1


def test_rows_before_the_stamp_are_negative_floor_not_truncated():
    # int() truncates towards zero: -0.5 rows would be row 0 and a trajectory sent then would skip row 0.
    plan = ActionChunkPlan(np.zeros((4, 2)), 10.0, 0.1, 0)
    assert [plan.row_at(t) for t in (9.85, 9.95, 10.0, 10.05, 10.1)] == [-2, -1, 0, 0, 1]


# ------------------------------------------------------------------------------------------ control timing
def _droid_follower() -> tuple[ChunkFollower, float]:
    """The follower and control period exactly as config/droid.yaml sets them."""
    from oxygen_ros.robot.configs import find_config, node_params

    action = node_params(find_config("droid"), "oxygen_action")
    engine = node_params(find_config("droid"), "oxygen_engine")
    follower = ChunkFollower(interpolate=action["interpolate"], replan_steps=action["replan_steps"],
                             on_exhausted=action["on_exhausted"])
    return follower, engine["control_period_s"]


def test_droid_chunk_of_15_rows_spans_one_second_at_70_hz():
    """DROID trains at 15 Hz: a 15-row chunk is 1 s of commands. Published at 70 Hz: 70 commands, the
    joint velocities held for their row's 1/15 s, the gripper position interpolated between rows."""
    follower, dt = _droid_follower()
    assert dt == pytest.approx(1 / 15)
    rows = np.arange(15, dtype=np.float64)[:, None] * np.ones(8)     # row k: every dim = k
    follower.push(ActionChunkPlan(rows, 100.0, dt, 1))
    published = []
    for i in range(90):
        cmd = follower.next(100.0 + i / 70)
        if cmd.action is not None:
            published.append((i, cmd))
    assert len(published) == 70 and published[-1][0] == 69                  # ticks 0..69: [0 s, 1 s)
    assert follower.next(100.0 + 70 / 70).status == "stopped"                # DROID: on_exhausted stop
    for i, cmd in published:
        u = i / 70 * 15
        assert cmd.index == int(u + 1e-9)
        assert (cmd.action[:7] == cmd.index).all()                          # velocities: held
        assert cmd.action[7] == pytest.approx(min(u, 14.0))                  # gripper: interpolated
    held_ticks = np.bincount([cmd.index for _, cmd in published])
    assert held_ticks.min() >= 4 and held_ticks.max() <= 5 and held_ticks.sum() == 70


def test_latency_alignment_is_in_the_control_time_base():
    """A chunk arriving 0.3 s after its observation starts at row 4.5 of 15 Hz rows, not at row 21 of
    70 Hz ticks (past the end) nor at row 0."""
    follower, dt = _droid_follower()
    rows = np.arange(15, dtype=np.float64)[:, None] * np.ones(8)
    follower.push(ActionChunkPlan(rows, 10.0, dt, 1))
    cmd = follower.next(10.3)
    assert cmd.index == 4 and cmd.status == "ok"
    assert cmd.action[0] == 4.0 and cmd.action[7] == pytest.approx(4.5)


def test_replan_steps_lets_the_current_chunk_play_its_open_loop_horizon():
    """openpi's open_loop_horizon: a newer chunk takes over only after replan_steps rows of the current one."""
    follower, dt = _droid_follower()
    assert follower.replan_steps == 8
    follower.push(ActionChunkPlan(np.zeros((15, 8)), 0.0, dt, 1))
    assert follower.next(0.0).switched
    follower.push(ActionChunkPlan(np.ones((15, 8)), 0.2, dt, 2))            # arrives after 3 rows
    follower.push(ActionChunkPlan(np.full((15, 8), 2.0), 0.25, dt, 3))     # newer: replaces the waiting one
    assert follower.stats["chunks_superseded"] == 1
    t, switches = 0.0, []
    while t < 0.9:
        cmd = follower.next(t)
        if cmd.switched:
            switches.append((t, cmd.frame_index, cmd.index))
        assert cmd.frame_index == (1 if t < 8 * dt - 1e-9 else 3)
        t += 1 / 70
    # Frame 3 (stamped 0.25 s) starts at 8/15 s = 0.533 s, at its own row for that time: floor(0.283 * 15) = 4.
    assert len(switches) == 1 and switches[0][1] == 3
    assert 8 * dt <= switches[0][0] < 8 * dt + 1 / 70 and switches[0][2] == 4


def test_without_replan_steps_a_newer_chunk_takes_over_at_once():
    follower = ChunkFollower(interpolate=[True, False])
    follower.push(ActionChunkPlan(np.zeros((10, 2)), 0.0, 0.1, 1))
    follower.next(0.0)
    follower.push(ActionChunkPlan(np.ones((10, 2)), 0.05, 0.1, 2))
    cmd = follower.next(0.06)
    assert cmd.switched and cmd.frame_index == 2 and cmd.action.tolist() == [1.0, 1.0]
    assert not follower.next(0.07).switched


def test_interpolate_mask_must_fit_the_chunk():
    follower = ChunkFollower(interpolate=[True, False, True])
    with pytest.raises(ActionError, match="interpolate mask 3"):
        follower.push(ActionChunkPlan(np.zeros((4, 2)), 0.0, 0.1, 1))
