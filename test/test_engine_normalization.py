"""State normalisation, action un-normalisation and delta actions through the engine's public API, with real
(non-identity) openpi norm stats: every other engine test runs the identity normaliser, so a runner that
skipped any of the three passed them all."""
from __future__ import annotations

import json

import numpy as np

from conftest import make_observation
from oxygen_ros.engine.engine import EngineConfig
from oxygen_ros.engine.factory import build_engine
from oxygen_ros.robot.policy_io import RobotIOConfig

DIM = 8                                   # the small model's action_dim; the robot uses 7
ROBOT_DIM = 7
DELTA = [True, True, False, True, False, False, False]
RNG = np.random.default_rng(7)
Q01 = {"state": RNG.uniform(-3, -1, DIM), "actions": RNG.uniform(-2, 0, DIM)}
Q99 = {"state": RNG.uniform(1, 4, DIM), "actions": RNG.uniform(0.5, 3, DIM)}
EPS = 1e-6                                # openpi's quantile normalisation epsilon


def norm_stats(path):
    stats = {k: {"mean": [0.0] * DIM, "std": [1.0] * DIM, "q01": Q01[k].tolist(), "q99": Q99[k].tolist()}
             for k in ("state", "actions")}
    path.write_text(json.dumps({"norm_stats": stats}))
    return str(path)


def chunk_of(engine, obs, noise):
    engine.run_cycle(obs, noise)
    chunk = engine.latest_chunk()
    assert chunk is not None and chunk.plan.stamp_s == obs.stamp_s
    return chunk


def test_state_normalised_actions_unnormalised_and_deltas_added(tmp_path, small_model):
    cfg = small_model.cfg
    normalised = build_engine(built_model=small_model, engine=EngineConfig(), kv_budget_mb=4.0,
                              robot_io=RobotIOConfig(robot_action_dim=ROBOT_DIM, delta_action_mask=tuple(DELTA)),
                              norm_stats=norm_stats(tmp_path / "norm_stats.json"))
    identity = build_engine(built_model=small_model, engine=EngineConfig(), kv_budget_mb=4.0,
                            robot_io=RobotIOConfig(robot_action_dim=ROBOT_DIM))
    noise = RNG.standard_normal((cfg.action_horizon, DIM)).astype(np.float32)
    obs = make_observation(0, state_dim=DIM)
    obs.state = RNG.uniform(Q01["state"], Q99["state"])            # robot units, inside the quantiles

    # The state the model sees is (x - q01) / (q99 - q01 + eps) * 2 - 1 (it enters the prompt as 256 bins):
    # the identity engine given that state by hand must produce the same model output.
    by_hand = make_observation(0, state_dim=DIM)
    by_hand.state = (obs.state - Q01["state"]) / (Q99["state"] - Q01["state"] + EPS) * 2 - 1
    assert by_hand.state.min() >= -1 and by_hand.state.max() <= 1
    got = chunk_of(normalised, obs, noise)
    reference = chunk_of(identity, by_hand, noise)
    np.testing.assert_allclose(got.model_actions, reference.model_actions, rtol=0, atol=1e-6)
    unnormalised_state = chunk_of(identity, obs, noise)
    assert np.abs(unnormalised_state.model_actions - got.model_actions).max() > 1e-3, \
        "the raw state gives other actions: the comparison above can tell"

    # Robot actions: (x + 1) / 2 * (q99 - q01 + eps) + q01, the first 7 dimensions, plus the current state
    # where the dimension is a delta.
    x = got.model_actions.astype(np.float64)
    expected = ((x + 1) / 2 * (Q99["actions"] - Q01["actions"] + EPS) + Q01["actions"])[:, :ROBOT_DIM]
    expected[:, np.flatnonzero(DELTA)] += obs.state[np.flatnonzero(DELTA)]
    np.testing.assert_allclose(got.plan.actions, expected, rtol=0, atol=1e-9)
    assert not np.allclose(got.plan.actions, x[:, :ROBOT_DIM], atol=1e-2)
