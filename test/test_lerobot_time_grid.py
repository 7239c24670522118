"""Denoising time is a property of the checkpoint's format: an openpi checkpoint denoises on openpi's float32
grid (t += dt), a LeRobot one on LeRobot 0.6.1's (t = 1.0 + k*dt, rounded once), bit for bit.

The openpi grid is checked against the oracle's reference times (case_a's `denoise_time`, what the public
reference computes); the LeRobot grid against LeRobot's formula (policies/common/flow_matching.py,
euler_integrate: float64 arithmetic, one float32 rounding per time), computed here in numpy.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import ORACLE, small_config
from oxygen_ros.model.checkpoint import init_random_weights, load_pi05, save_checkpoint
from oxygen_ros.model.pi05 import Pi05


def lerobot_reference_times(steps: int) -> np.ndarray:
    dt = -1.0 / steps
    return np.array([1.0 + k * dt for k in range(steps)], dtype=np.float64).astype(np.float32)


@pytest.mark.parametrize("fmt", ["openpi", "lerobot"])
def test_a_checkpoint_denoises_on_its_formats_time_grid(tmp_path, fmt):
    cfg = small_config(num_denoise_steps=10)
    path = save_checkpoint(init_random_weights(Pi05(cfg), seed=0), tmp_path / fmt, fmt=fmt)
    model = load_pi05(path, cfg)
    assert model.time_grid == fmt
    times, dt = model.flow_schedule(10)
    expected = (lerobot_reference_times(10) if fmt == "lerobot"
                else np.load(ORACLE / "case_a" / "expected.npz")["denoise_time"])
    np.testing.assert_array_equal(times.numpy(), expected)
    assert dt.item() == np.float32(-0.1)


@pytest.mark.parametrize("steps", [3, 7, 10, 32])
def test_the_two_grids_differ_only_by_openpis_accumulated_rounding(steps):
    model = Pi05(small_config())
    openpi, _ = model.flow_schedule(steps)
    model.time_grid = "lerobot"
    lerobot, _ = model.flow_schedule(steps)          # not openpi's cached schedule
    np.testing.assert_array_equal(lerobot.numpy(), lerobot_reference_times(steps))
    assert openpi.shape == lerobot.shape
    np.testing.assert_allclose(openpi.numpy(), lerobot.numpy(), rtol=0, atol=steps * 2 ** -24)
