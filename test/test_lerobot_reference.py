"""LeRobot checkpoints served as LeRobot 0.6.1 serves them: this package's policy I/O against LeRobot's own
outputs, for every normalisation mode, camera images not at the model's size and relative actions.

The cases in test/data/lerobot_ref/ are LeRobot policy directories (config.json and the processors, as
LeRobot's save_pretrained writes them; no weights) with reference.npz holding inputs and LeRobot's outputs,
made by scripts/lerobot_reference.py in a LeRobot 0.6.1 environment (see its docstring; LeRobot is not
needed here). Tolerance: 1e-6 absolute on the normalised state, the model's images and the robot actions
(the arithmetic is LeRobot's, in float32 and its order: measured max |diff| 0); the prompt's discretised
state exactly.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from oxygen_ros.model.normalize import LeRobotNormalizer
from oxygen_ros.model.tokenizer import discretize_state
from oxygen_ros.robot.policy_io import RobotIOConfig, build_policy_io

REF = Path(__file__).parent / "data" / "lerobot_ref"
CASES = sorted(p.name for p in REF.iterdir() if (p / "reference.npz").is_file())
SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
TOLERANCE = 1e-6
MODES = ("IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10")


def _case(name):
    ref = dict(np.load(REF / name / "reference.npz"))
    assert str(ref["lerobot_version"]) == "0.6.1"
    io = build_policy_io(RobotIOConfig(), checkpoint=REF / name, model_action_dim=32, image_size=64,
                         camera_slots=SLOTS)
    slot_of = {feature: slot for slot, feature in io.camera_features.items()}
    images = {slot_of[k.removeprefix("image_")]: v for k, v in ref.items() if k.startswith("image_")}
    return ref, io, slot_of, images


def test_the_cases_cover_every_mode_and_resized_images():
    assert len(CASES) >= 6
    seen = set()
    for name in CASES:
        ref, io, _, images = _case(name)
        assert isinstance(io.normalizer, LeRobotNormalizer)
        seen |= set(io.normalizer.modes.values())
        # Every case has a camera that LeRobot resizes.
        assert any(img.shape[:2] != (64, 64) for img in images.values()), name
    assert seen == set(MODES)


@pytest.mark.parametrize("name", CASES)
def test_state_images_and_actions_equal_lerobots(name):
    ref, io, slot_of, images = _case(name)
    inputs = io.model_inputs(images, ref["state"])
    np.testing.assert_allclose(inputs.state_normalized, ref["state_normalized"], rtol=0, atol=TOLERANCE)
    np.testing.assert_array_equal(discretize_state(inputs.state_normalized), ref["state_tokens"])
    for key, expected in ref.items():
        if key.startswith("pixels_"):
            got = inputs.images[slot_of[key.removeprefix("pixels_")]].permute(1, 2, 0).numpy()
            np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE, err_msg=key)
    actions = io.robot_actions(ref["model_actions"], ref["state"])
    assert actions.shape == ref["robot_actions"].shape
    np.testing.assert_allclose(actions, ref["robot_actions"], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", ["quantiles", "min_max", "quantile10"])
def test_a_joint_that_never_moved_normalises_to_minus_one(name):
    """q01 = q99 (min = max): LeRobot divides by eps and rounds the state to float32 first, so the joint's
    value maps to exactly -1 (openpi's float64 rule gave -1.0117 for 0.1 + 0.2 against float32 stats)."""
    ref, io, _, images = _case(name)
    assert ref["state"][2] == 0.1 + 0.2 and io.model_inputs(images, ref["state"]).state_normalized[2] == -1.0


def test_relative_actions_keep_the_gripper_absolute():
    ref, io, _, _ = _case("mixed_relative")
    assert io.lerobot.relative_mask == (True,) * 6 + (False,)
    absolute = ref["robot_actions"] - ref["state"][:7].astype(np.float32) * np.array(io.lerobot.relative_mask)
    # Adding the state back is what separates LeRobot's actions from the un-normalised model output.
    unnormalised = io.normalizer.unnormalize_actions(ref["model_actions"][:, :7])
    np.testing.assert_allclose(absolute, unnormalised, rtol=0, atol=1e-5)
    assert np.abs(ref["robot_actions"][:, :6] - unnormalised[:, :6]).max() > 0.1
