"""A LeRobot pi05 checkpoint served end to end as LeRobot 0.6.1 runs it: the engine's final robot actions
against LeRobot's own, for the same observation and noise.

test/data/lerobot_model/ is a checkpoint LeRobot itself wrote and ran (scripts/lerobot_reference.py
--only model, in a LeRobot 0.6.1 environment; LeRobot is not needed here): PI05Policy with random weights at
the small sizes below (LeRobot's code, its Gemma/SigLIP widths shrunk: its own sizes are 3.3 B parameters),
QUANTILES state and actions, a 48x80 camera that both sides resize to 56 px, the shipped small tokenizer
standing in for PaliGemma's. reference.npz holds the inputs, LeRobot's token ids and its robot actions
(preprocessor -> predict_action_chunk(noise) -> postprocessor).

Tolerance: 1e-5 absolute on robot actions of magnitude up to ~43 (float32, CPU). Measured: 3.8e-6 (one
float32 step at 32-64) on LeRobot's time grid, which a LeRobot checkpoint gets; 1.3e-4 on openpi's grid
(float32 `t += dt`), which the last test shows is outside it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from oxygen_ros.engine.factory import build_engine
from oxygen_ros.model.checkpoint import load_pi05
from oxygen_ros.model.config import GemmaConfig, Pi05Config, VisionConfig
from oxygen_ros.robot.policy_io import RobotIOConfig
from oxygen_ros.robot.sync import Observation

CHECKPOINT = Path(__file__).parent / "data" / "lerobot_model"
TOLERANCE = 1e-5
# scripts/lerobot_reference.py's MODEL_SIZES, MODEL_IMAGE, MODEL_CHUNK and MODEL_TOKENS.
CONFIG = Pi05Config(vlm=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=16),
                    expert=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=1, head_dim=16),
                    vision=VisionConfig(width=32, depth=1, mlp_dim=64, num_heads=2, image_size=56),
                    vocab_size=1000, action_dim=32, action_horizon=10, max_token_len=48, num_denoise_steps=10)


@pytest.fixture(scope="module")
def reference() -> dict:
    ref = dict(np.load(CHECKPOINT / "reference.npz"))
    assert str(ref["lerobot_version"]) == "0.6.1" and int(ref["num_inference_steps"]) == CONFIG.num_denoise_steps
    return ref


def served_actions(ref: dict, time_grid: str | None = None) -> tuple[np.ndarray, list[int]]:
    """The engine's robot actions for LeRobot's observation and noise (and the prompt's token ids)."""
    model = load_pi05(CHECKPOINT, CONFIG)
    if time_grid is not None:
        model.time_grid = time_grid
    engine = build_engine(built_model=model, checkpoint=str(CHECKPOINT), robot_io=RobotIOConfig(),
                          state_in_prompt=True)
    slots = CONFIG.camera_slots
    images = {s: ref["image"] if s == "base_0_rgb" else None for s in slots}
    obs = Observation(stamp_s=0.0, images=images, image_masks={s: images[s] is not None for s in slots},
                      state=ref["state"], prompt=str(ref["task"]))
    tokens = engine.preparer.prepare(obs).row.tokens.tolist()
    engine.run_cycle(obs, ref["noise"])
    return engine.latest_chunk().plan.actions, tokens


def test_a_lerobot_checkpoint_denoises_on_lerobots_grid():
    assert load_pi05(CHECKPOINT, CONFIG).time_grid == "lerobot"


def test_final_actions_equal_lerobots(reference):
    actions, tokens = served_actions(reference)
    # The same prompt (LeRobot's text, its discretised state) as token ids: what the model sees is the same.
    assert tokens == reference["tokens"][reference["token_mask"]].tolist()
    assert actions.shape == reference["robot_actions"].shape == (CONFIG.action_horizon, 6)
    assert 4 <= np.abs(reference["robot_actions"]).mean() <= 20
    np.testing.assert_allclose(actions, reference["robot_actions"], rtol=0, atol=TOLERANCE)


def test_openpis_grid_is_outside_the_tolerance(reference):
    """The same checkpoint denoised on openpi's grid: what the engine did before it followed the format."""
    actions, _ = served_actions(reference, time_grid="openpi")
    assert np.abs(actions - reference["robot_actions"]).max() > 5 * TOLERANCE
