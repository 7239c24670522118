import numpy as np
import pytest
from transforms3d import euler, quaternions

from oxygen_ros.robot.ee import (
    ROTATION_SIZES,
    action_from_pose,
    pose_from_action,
    twist_from_action,
    wxyz_to_xyzw,
    xyzw_to_wxyz,
)
from oxygen_ros.robot.errors import ActionError, ConfigError
from oxygen_ros.robot.limits import ActionLimits

RNG = np.random.default_rng(0)


# --- limits --------------------------------------------------------------------------------------

def test_position_bounds():
    limits = ActionLimits(lower=np.array([-1.0, 0.0, -np.inf]), upper=np.array([1.0, 2.0, 0.5]))
    clamped, mask = limits.apply([1.5, 1.0, -1e9], previous=None)
    assert clamped.tolist() == [1.0, 1.0, -1e9]
    assert mask.tolist() == [True, False, False]
    clamped, mask = limits.apply([-3.0, -1.0, 0.7])
    assert clamped.tolist() == [-1.0, 0.0, 0.5] and mask.all()


def test_per_tick_velocity_limit_from_config():
    # 70 Hz tick: 1.4 units/s allows 0.02 per tick.
    limits = ActionLimits.from_config(2, max_velocity=[1.4, 7.0], tick_period_s=1 / 70)
    np.testing.assert_allclose(limits.max_step, [0.02, 0.1])
    clamped, mask = limits.apply([0.5, 0.05], previous=[0.0, 0.0])
    np.testing.assert_allclose(clamped, [0.02, 0.05])
    assert mask.tolist() == [True, False]
    clamped, _ = limits.apply([-0.5, -0.5], previous=[0.0, 0.0])
    np.testing.assert_allclose(clamped, [-0.02, -0.1])
    clamped, mask = limits.apply([0.5, 0.05], previous=None)  # first tick: nothing to limit against
    assert clamped.tolist() == [0.5, 0.05] and not mask.any()


def test_a_ramp_reaches_the_target_at_the_velocity_limit():
    limits = ActionLimits.from_config(1, lower=[-1], upper=[1], max_velocity=[1.0], tick_period_s=0.1)
    previous, trace = np.zeros(1), []
    for _ in range(8):
        previous, _ = limits.apply([5.0], previous)
        trace.append(previous[0])
    np.testing.assert_allclose(trace, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])


def test_bounds_win_over_the_step_limit():
    limits = ActionLimits(lower=np.array([0.0]), upper=np.array([1.0]), max_step=np.array([0.1]))
    clamped, mask = limits.apply([2.0], previous=[5.0])  # previous outside the bounds
    assert clamped.tolist() == [1.0] and mask.tolist() == [True]


def test_non_finite_action_is_refused():
    limits = ActionLimits(lower=np.zeros(3), upper=np.ones(3))
    with pytest.raises(ActionError) as e:
        limits.apply([0.5, np.nan, np.inf])
    assert str(e.value) == "action has non-finite values at indices [1, 2] (nan, inf); not sending it"
    with pytest.raises(ActionError, match="action has non-finite"):
        ActionLimits().apply([np.nan])  # even without any limit
    with pytest.raises(ActionError, match=r"previous action has non-finite values at indices \[0\]"):
        ActionLimits(max_step=np.ones(1)).apply([0.0], previous=[np.nan])


def test_wrong_action_size():
    with pytest.raises(ActionError, match=r"action has shape \(2,\), expected \(3,\)"):
        ActionLimits(upper=np.ones(3)).apply([0.0, 0.0])
    with pytest.raises(ActionError, match=r"previous action has shape \(2,\), expected \(3,\)"):
        ActionLimits(max_step=np.ones(3)).apply([0.0, 0.0, 0.0], previous=[0.0, 0.0])


@pytest.mark.parametrize("kwargs,message", [
    (dict(lower=[0, 0]), r"lower has 2 values, expected 3 \(the action dim\)"),
    (dict(upper=[0, 0, 0, 0]), "upper has 4 values, expected 3"),
    (dict(lower=[0, 2, 0], upper=[1, 1, 1]), r"lower\[1\]=2.0 is above upper\[1\]=1.0"),
    (dict(lower=[0, np.nan, 0]), r"lower has NaN at indices \[1\]"),
    (dict(max_velocity=[1, 0, -2], tick_period_s=0.01),
     r"max_velocity\[1\]=0.0, max_velocity\[2\]=-2.0: must be positive"),
    (dict(max_velocity=[1, 1, 1]), "tick_period_s None must be positive to apply max_velocity"),
    (dict(max_velocity=[1, 1, 1], tick_period_s=0), "tick_period_s 0 must be positive"),
    (dict(upper=["a", 1, 1]), "upper is not a list of numbers"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ActionLimits.from_config(3, **kwargs)


def test_config_allows_unbounded_and_unlimited_entries():
    limits = ActionLimits.from_config(
        2, lower=[-np.inf, 0], upper=[np.inf, 1], max_velocity=[np.inf, 1], tick_period_s=0.5
    )
    clamped, _ = limits.apply([1e6, 3.0], previous=[0.0, 0.0])
    assert clamped.tolist() == [1e6, 0.5]
    with pytest.raises(ConfigError, match="action dim 0 must be positive"):
        ActionLimits.from_config(0)


# --- end effector --------------------------------------------------------------------------------

def random_unit_xyzw():
    q = RNG.normal(size=4)
    return q / np.linalg.norm(q)


def same_rotation(q1_xyzw, q2_xyzw):
    return abs(abs(np.dot(q1_xyzw, q2_xyzw)) - 1) < 1e-9


def test_quaternion_order_helpers():
    assert wxyz_to_xyzw([1, 2, 3, 4]).tolist() == [2, 3, 4, 1]
    assert xyzw_to_wxyz([2, 3, 4, 1]).tolist() == [1, 2, 3, 4]


def test_identity_and_known_rotations():
    position, q = pose_from_action([1, 2, 3, 0, 0, 0], "axis_angle")
    assert position.tolist() == [1, 2, 3] and q.tolist() == [0, 0, 0, 1]
    _, q = pose_from_action([0, 0, 0, 0, 0, np.pi / 2], "axis_angle")  # 90 degrees about z
    np.testing.assert_allclose(q, [0, 0, np.sin(np.pi / 4), np.cos(np.pi / 4)])
    _, q = pose_from_action([0, 0, 0, np.pi / 2, 0, 0], "euler_xyz")  # roll 90 degrees: about x
    np.testing.assert_allclose(q, [np.sin(np.pi / 4), 0, 0, np.cos(np.pi / 4)])
    _, q = pose_from_action([0, 0, 0, 2, 0, 0, 0], "quaternion_wxyz")  # normalised
    assert q.tolist() == [0, 0, 0, 1]


def test_euler_is_fixed_axis_roll_pitch_yaw():
    roll, pitch, yaw = 0.3, -0.2, 1.1
    _, q = pose_from_action([0, 0, 0, roll, pitch, yaw], "euler_xyz")
    rx = quaternions.axangle2quat([1, 0, 0], roll)
    ry = quaternions.axangle2quat([0, 1, 0], pitch)
    rz = quaternions.axangle2quat([0, 0, 1], yaw)
    expected = quaternions.qmult(rz, quaternions.qmult(ry, rx))  # R = Rz Ry Rx
    assert same_rotation(q, wxyz_to_xyzw(expected))


@pytest.mark.parametrize("rotation", list(ROTATION_SIZES))
def test_round_trip_from_pose(rotation):
    for _ in range(200):
        position, q = RNG.normal(size=3), random_unit_xyzw()
        action = action_from_pose(position, q, rotation)
        assert action.shape == (3 + ROTATION_SIZES[rotation],)
        position2, q2 = pose_from_action(action, rotation)
        np.testing.assert_allclose(position2, position)
        assert same_rotation(q2, q)
        assert q2[3] >= 0 and abs(np.linalg.norm(q2) - 1) < 1e-12


@pytest.mark.parametrize("rotation", list(ROTATION_SIZES))
def test_round_trip_from_action(rotation):
    for _ in range(200):
        position = RNG.normal(size=3)
        if rotation == "axis_angle":
            axis = RNG.normal(size=3)
            rot = axis / np.linalg.norm(axis) * RNG.uniform(0, np.pi - 1e-6)  # canonical range
        elif rotation == "euler_xyz":
            rot = np.array([RNG.uniform(-np.pi, np.pi), RNG.uniform(-1.5, 1.5), RNG.uniform(-np.pi, np.pi)])
        else:
            rot = xyzw_to_wxyz(random_unit_xyzw())
            rot = rot if rot[0] >= 0 else -rot
        action = np.concatenate([position, rot, [0.7]])  # a trailing gripper value is ignored
        back = action_from_pose(*pose_from_action(action, rotation), rotation)
        np.testing.assert_allclose(back, action[:-1], atol=1e-9)


def test_rotation_matches_transforms3d_matrices():
    for _ in range(50):
        rot = RNG.uniform(-np.pi, np.pi, size=3)
        _, q = pose_from_action(np.concatenate([np.zeros(3), rot]), "euler_xyz")
        np.testing.assert_allclose(quaternions.quat2mat(xyzw_to_wxyz(q)), euler.euler2mat(*rot, axes="sxyz"),
                                   atol=1e-12)


def test_twist():
    linear, angular = twist_from_action([1, 2, 3, 4, 5, 6, 7])
    assert linear.tolist() == [1, 2, 3] and angular.tolist() == [4, 5, 6]


def test_ee_errors():
    supported = r"\(supported: axis_angle, euler_xyz, quaternion_wxyz\)"
    with pytest.raises(ConfigError, match=r"unknown rotation 'rpy' " + supported):
        pose_from_action(np.zeros(6), "rpy")
    with pytest.raises(ActionError, match=r"pose action \(quaternion_wxyz\) needs at least 7 values, got 6"):
        pose_from_action(np.zeros(6), "quaternion_wxyz")
    with pytest.raises(ActionError, match=r"pose action \(axis_angle\) has non-finite values at indices \[4"):
        pose_from_action([0, 0, 0, 0, np.nan, 0])
    with pytest.raises(ActionError, match=r"rotation of pose action \(quaternion_wxyz\) has zero length"):
        pose_from_action(np.zeros(7), "quaternion_wxyz")
    with pytest.raises(ActionError, match="quaternion has zero length"):
        action_from_pose([0, 0, 0], [0, 0, 0, 0])
    with pytest.raises(ActionError, match="twist action needs at least 6 values, got 3"):
        twist_from_action([1, 2, 3])
    with pytest.raises(ActionError, match="twist action is not numbers"):
        twist_from_action(["a"] * 6)
