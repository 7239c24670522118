"""The robot side of the policy (oxygen_ros/robot/policy_io.py, robot/aloha.py) against openpi.

case_e (../shared/oracle/case_e) was produced with openpi's own arithmetic; the ALOHA reference values are
worked out by hand from openpi's aloha_policy.py constants (shown next to each)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from oxygen_ros.model.normalize import Normalizer, Stats
from oxygen_ros.robot import aloha
from oxygen_ros.robot.configs import find_config, node_params
from oxygen_ros.robot.errors import ConfigError, InputError
from oxygen_ros.robot.policy_io import PolicyIO, RobotIOConfig

CASE_E = Path(__file__).resolve().parents[1] / ".." / "shared" / "oracle" / "case_e"
ROBOTS = ("droid", "aloha", "libero", "demo")


# ------------------------------------------------------------------------------------------ case_e
def test_case_e_through_the_tool(tmp_path):
    """`python -m oxygen_ros.tools.policy_io CASE --out OUT.npz` within case_e's stated tolerances."""
    out = tmp_path / "e.npz"
    subprocess.run([sys.executable, "-m", "oxygen_ros.tools.policy_io", str(CASE_E), "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    got, expected = np.load(out), np.load(CASE_E / "expected.npz")
    assert sorted(got.files) == sorted(expected.files)
    for key in expected.files:
        assert got[key].shape == expected[key].shape, key
        diff = np.abs(got[key].astype(np.float64) - expected[key])
        if key.startswith("image_"):
            assert diff.max() <= 2 / 255 + 1e-6 and diff.mean() <= 1e-3, (key, diff.max(), diff.mean())
        else:
            assert diff.max() <= 1e-4, (key, diff.max())


def test_case_e_pipeline_comes_from_the_robot_config(tmp_path):
    """The tool builds the droid pipeline from config/droid.yaml: a case whose delta mask disagrees is refused."""
    case = tmp_path / "case"
    case.mkdir()
    for f in ("inputs.npz", "norm_stats.json"):
        (case / f).write_bytes((CASE_E / f).read_bytes())
    cfg = json.loads((CASE_E / "config.json").read_text())
    (case / "config.json").write_text(json.dumps(dict(cfg, delta_action_mask=[True] * 7 + [False])))
    from oxygen_ros.tools.policy_io import run_case
    with pytest.raises(ValueError, match="delta_action_mask"):
        run_case(case)


@pytest.mark.parametrize("robot", ROBOTS)
def test_every_robot_config_builds_its_pipeline(robot):
    params = node_params(find_config(robot), "oxygen_engine")
    io = PolicyIO(RobotIOConfig.from_params(params), model_action_dim=32)
    assert io.robot_action_dim == (params.get("robot_action_dim") or 32)


# ------------------------------------------------------------------------------------------ ALOHA
def test_aloha_state_reference_values():
    state = np.zeros(14)
    state[[1, 2, 8, 9]] = [0.5, -0.3, 0.7, 0.2]      # shoulders and elbows
    state[6], state[13] = 0.0, 1.0                    # left gripper open, right closed (normalised linear)
    got = aloha.decode_state(state)
    np.testing.assert_allclose(got[[1, 2, 8, 9]], [-0.5, 0.3, -0.7, -0.2])   # flip mask [1,-1,-1,1,1,1,1]
    # 0 -> 0.01844 m: asin((0.022² + 0.01844² - 0.036²) / (2 * 0.022 * 0.01844)) = -0.621001 rad,
    # (-0.621001 - 0.5476) / (1.6296 - 0.5476) = -1.079866
    assert got[6] == pytest.approx(-1.079866, abs=1e-5)
    # 1 -> 0.058 m: the arcsine's argument is exactly 1 -> pi/2; (pi/2 - 0.5476) / 1.082 = 0.945653
    assert got[13] == pytest.approx((math.pi / 2 - 0.5476) / 1.082, abs=1e-9)
    assert state[1] == 0.5                            # the caller's array is untouched


def test_aloha_action_reference_values():
    a = np.zeros((2, 14))
    a[:, [1, 2]] = [0.4, -0.1]
    a[0, [6, 13]] = [0.0, 1.0]
    got = aloha.encode_actions(a)
    np.testing.assert_allclose(got[:, [1, 2]], [[-0.4, 0.1]] * 2)
    # (0 + 0.5476 + 0.6213) / (1.4910 + 0.6213) = 0.553378; (1 + 1.1689) / 2.1123 = 1.026795
    np.testing.assert_allclose(got[0, [6, 13]], [0.553378, 1.026795], atol=1e-6)


def test_aloha_round_trips():
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, size=(5, 14))
    np.testing.assert_allclose(aloha.encode_actions(aloha.encode_actions_inv(a)), a, atol=1e-12)
    np.testing.assert_allclose(aloha.encode_actions_inv(aloha.encode_actions(a)), a, atol=1e-12)
    # The gripper state decoding inverts Interbotix's angle -> linear geometry: p = h sin(t) + sqrt(a² - h² cos²(t)).
    linear = rng.uniform(0, 1, size=20)
    angle = aloha.gripper_to_angular(linear) * (aloha.PI_GRIPPER_MAX - aloha.PI_GRIPPER_MIN) + aloha.PI_GRIPPER_MIN
    h, arm = aloha.HORN_RADIUS, aloha.ARM_LENGTH
    position = h * np.sin(angle) + np.sqrt(arm**2 - h**2 * np.cos(angle) ** 2)
    back = (position - aloha.PUPPET_GRIPPER_POSITION_OPEN) / (
        aloha.PUPPET_GRIPPER_POSITION_CLOSED - aloha.PUPPET_GRIPPER_POSITION_OPEN)
    np.testing.assert_allclose(back, linear, atol=1e-9)


def test_aloha_pipeline_zero_delta_commands_the_current_joints():
    """Deltas are added to the *decoded* state, then encoded: a zero joint delta commands exactly the
    robot's current joints (with the signs the robot uses), whatever the flips."""
    params = node_params(find_config("aloha"), "oxygen_engine")
    io = PolicyIO(RobotIOConfig.from_params(params), Normalizer.identity(), model_action_dim=32)
    state = np.linspace(-0.6, 0.6, 14)
    state[[6, 13]] = [0.3, 0.8]
    chunk = np.zeros((4, 32))
    chunk[:, [6, 13]] = 0.25                          # absolute gripper angle (normalised)
    out = io.robot_actions(chunk, state)
    joints = [i for i in range(14) if i not in (6, 13)]
    np.testing.assert_allclose(out[:, joints], np.broadcast_to(state[joints], (4, 12)), atol=1e-12)
    np.testing.assert_allclose(out[:, [6, 13]], aloha.gripper_from_angular(0.25), atol=1e-12)
    # Without the transform the shoulders and elbows would have moved by twice their value.
    plain = PolicyIO(RobotIOConfig(robot_action_dim=14, delta_action_mask=tuple(params["delta_action_mask"])),
                     model_action_dim=32)
    assert not np.allclose(plain.robot_actions(chunk, aloha.decode_state(state))[:, joints], state[joints])


# ------------------------------------------------------------------------------------------ DROID, LIBERO
def test_droid_franka_finger_gripper_converts_both_ways():
    """A Franka finger joint in metres (0.04 open, 0 closed) <-> the model's [0, 1] (0 open, 1 closed)."""
    io = PolicyIO(RobotIOConfig(robot_action_dim=8, gripper_dims=(7,), gripper_range=(0.04, 0.0)),
                  model_action_dim=32)
    state = np.array([0.1] * 7 + [0.01])
    np.testing.assert_allclose(io.model_state(state), [0.1] * 7 + [0.75])
    chunk = np.zeros((2, 32))
    chunk[:, 7] = [0.0, 1.0]
    np.testing.assert_allclose(io.robot_actions(chunk)[:, 7], [0.04, 0.0])
    with pytest.raises(InputError, match="gripper_dims"):
        io.model_state(np.zeros(7))


def test_cameras_marked_rotate_180_are_turned_before_resizing():
    """LIBERO's robosuite renders upside down; the option turns the marked cameras only."""
    params = node_params(find_config("libero"), "oxygen_engine")
    io = PolicyIO(RobotIOConfig.from_params(params).replace(rotate_180=("base_0_rgb",)), model_action_dim=32)
    img = np.zeros((112, 224, 3), np.uint8)
    img[0, 0] = 255                                    # top-left pixel
    out = io.model_inputs({"base_0_rgb": img, "left_wrist_0_rgb": img}, np.zeros(8))
    # 224 x 112 -> padded by 56 rows above and below; the pixel lands bottom-right of the content, or stays
    # (model pixels: [3, 224, 224] in [-1, 1]).
    base, wrist = out.images["base_0_rgb"], out.images["left_wrist_0_rgb"]
    assert base[:, 167, 223].tolist() == [1.0] * 3 and base[:, 56, 0].tolist() == [-1.0] * 3
    assert wrist[:, 56, 0].tolist() == [1.0] * 3


def test_normalisation_matches_openpi_quantiles():
    stats = Stats(np.zeros(3), np.ones(3), np.array([-1.0, 0.0, 2.0]), np.array([1.0, 4.0, 3.0]))
    io = PolicyIO(RobotIOConfig(robot_action_dim=3), Normalizer(stats, stats), model_action_dim=4)
    x = np.array([0.5, 1.0, 2.5])
    expected = (x - stats.q01) / (stats.q99 - stats.q01 + 1e-6) * 2 - 1
    np.testing.assert_allclose(io.model_inputs({}, x).state_normalized, expected, atol=1e-12)
    chunk = np.array([[0.0, 1.0, -1.0, 7.0]])           # the 4th (padding) dim is dropped
    np.testing.assert_allclose(io.robot_actions(chunk)[0],
                               (chunk[0, :3] + 1) / 2 * (stats.q99 - stats.q01 + 1e-6) + stats.q01, atol=1e-12)


# ------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_are_input_errors():
    io = PolicyIO(RobotIOConfig(transform="aloha", robot_action_dim=14, delta_action_mask=(True,) * 6),
                  model_action_dim=32)
    with pytest.raises(InputError, match="14 values"):
        io.model_state(np.zeros(8))
    with pytest.raises(InputError, match="finite"):
        io.model_state(np.full(14, np.nan))
    with pytest.raises(InputError, match="RGB uint8"):
        io.image("base_0_rgb", np.zeros((10, 10, 4), np.uint8))
    with pytest.raises(InputError, match="delta actions need"):
        io.robot_actions(np.zeros((2, 32)))
    # An extreme aspect ratio is resized, not an exception.
    assert io.image("base_0_rgb", np.full((1, 500, 3), 9, np.uint8)).shape == (3, 224, 224)


def test_config_problems_are_all_listed():
    cfg = RobotIOConfig(transform="ur5", robot_action_dim=40, delta_action_mask=(True,) * 41,
                        gripper_dims=(50,), gripper_range=(1.0,), control_period_s=-1.0)
    problems = cfg.problems(32)
    for expected in ("transform 'ur5'", "robot_action_dim 40", "delta_action_mask has 41", "gripper_range needs two",
                     "gripper_dims [50]", "control_period_s -1.0"):
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    with pytest.raises(ConfigError) as e:
        PolicyIO(cfg, model_action_dim=32)
    assert str(e.value).count("\n") == len(problems) - 1
    assert RobotIOConfig(rotate_180=("base_rgb",)).problems(32, ("base_0_rgb", "left_wrist_0_rgb")) == [
        "rotate_180 names ['base_rgb'], not camera slots of the model (base_0_rgb, left_wrist_0_rgb)"]
    assert RobotIOConfig(transform="aloha", robot_action_dim=7).problems(32) == [
        "transform aloha needs robot_action_dim 14, got 7"]


# ------------------------------------------------------------------------------------------ through the engine
def test_engine_takes_extreme_aspect_images_and_counts_unusable_ones(engine_factory, obs):
    """issue #12 item 7: a 1x500 camera image is resized (one row, centred), never an escaping exception;
    an image that is not RGB is refused, counted, and the next frame runs."""
    engine = engine_factory()
    o = obs(0)
    o.images["base_0_rgb"] = np.full((1, 500, 3), 128, np.uint8)
    o.images["left_wrist_0_rgb"] = np.full((500, 1, 3), 64, np.uint8)
    report = engine.run_cycle(o)
    assert report.frame_index is not None and engine.latest_chunk() is not None
    bad = obs(1)
    bad.images["base_0_rgb"] = np.zeros((8, 8, 4), np.uint8)
    engine.run_cycle(bad)
    assert engine.stats.counter("bad_observations") == 1
    assert engine.run_cycle(obs(2)).frame_index is not None


def test_engine_chunks_carry_the_robot_control_period(small_model, obs):
    """Rows one control period apart (DROID 1/15 s), not one publish tick; 0 keeps one row per tick."""
    from oxygen_ros.engine.engine import EngineConfig
    from oxygen_ros.engine.factory import build_engine

    for period, expected in ((1 / 15, 1 / 15), (0.0, 1 / 70)):
        engine = build_engine(built_model=small_model, engine=EngineConfig(action_rate_hz=70.0), kv_budget_mb=4.0,
                              robot_io=RobotIOConfig(robot_action_dim=7, control_period_s=period))
        engine.run_cycle(obs(0))
        assert engine.latest_chunk().plan.step_period_s == pytest.approx(expected)
