"""Real-time chunking (oxygen_ros/model/rtc.py, Pi05.sample_actions with guidance, ModelRunner.actions with
guides): the prefix weight schedules and guided velocities against LeRobot 0.6.1 (reference arrays made by
scripts/rtc_reference.py, committed in test/data/rtc_ref/), and on a small π0.5 through the runner: rows
without guidance are plain denoising bit for bit, rows are independent, the prefix K/V is never written
or differentiated, the correction is the vector-Jacobian product through the expert, and it pulls the new
chunk toward the previous one.

Tolerances: guided velocities equal LeRobot's within 1e-6 relative (values up to ~60; LeRobot computes its
guidance weight in float32, ~1e-7 relative); weights are bitwise equal. A guided row in a batch vs alone:
1e-4 (float32 GEMMs of another batch size round differently, as in ARCHITECTURE.md, and the guidance,
up to beta = 5 times a correction, amplifies that: measured <= 3.3e-5 over 30 draws)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_observation, small_config
from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.factory import build_engine, build_model
from oxygen_ros.model import rtc
from oxygen_ros.model.attention import ActionAttention
from oxygen_ros.robot.policy_io import RobotIOConfig

REF = np.load(Path(__file__).parent / "data" / "rtc_ref" / "lerobot061.npz")
LEROBOT_RTOL = 1e-6
GUIDED_BATCH_ATOL = 1e-4
H, A = small_config().action_horizon, small_config().action_dim


# ------------------------------------------------------------------------------------ against LeRobot 0.6.1
@pytest.mark.parametrize("schedule", rtc.SCHEDULES)
def test_prefix_weights_equal_lerobots(schedule):
    ref = REF[f"schedule_{schedule}"]
    for i, (start, end, total) in enumerate(REF["schedule_grid"].tolist()):
        ours = rtc.prefix_weights(schedule, start, end, total).numpy()
        np.testing.assert_array_equal(ours, ref[i, :total], err_msg=f"{schedule} {start=} {end=} {total=}")


def test_exp_schedule_shape():
    """Weight 1 for the first d rows, decaying strictly toward 0 until row execution_horizon, 0 after."""
    w = rtc.prefix_weights("exp", delay=3, execution_horizon=8, horizon=12).numpy()
    assert (w[:3] == 1).all() and (w[8:] == 0).all()
    assert (np.diff(w[2:8]) < 0).all() and (w[3:8] > 0).all() and (w[3:8] < 1).all()
    assert (rtc.prefix_weights("zeros", 0, 8, 12) == 0).all()
    with pytest.raises(ValueError, match="'cosine' is not one of exp, linear, ones, zeros"):
        rtc.prefix_weights("cosine", 3, 8, 12)
    with pytest.raises(ValueError, match="delay >= 0"):
        rtc.prefix_weights("exp", -1, 8, 12)


def _velocity(kind: str, t: float):
    """The velocity functions of the reference cases (scripts/rtc_reference.py)."""
    w1, u, w2 = (torch.tensor(REF[k]) for k in ("w1", "u", "w2"))

    def velocity(x):
        flat = x.reshape(x.shape[0], -1)
        pre = flat @ w1 + t * u if kind == "mlp" else (t * u).expand(x.shape[0], -1)
        return (torch.tanh(pre) @ w2).reshape(x.shape)
    return velocity


def _reference_cases():
    """Cases grouped by (velocity kind, t, beta): one batched call each, every row with its own previous
    chunk, delay, execution horizon and schedule."""
    groups: dict = {}
    for i, (kind, t, beta) in enumerate(zip(REF["case_kind"], REF["case_t"], REF["case_beta"])):
        groups.setdefault((str(kind), float(t), float(beta)), []).append(i)
    return groups


@pytest.mark.parametrize("key", list(_reference_cases()), ids=str)
def test_guided_velocity_against_lerobot(key):
    """Each row of a batch equals LeRobot's RTCProcessor for that row alone (same inputs, same time
    convention: t from 1 = noise to 0). LeRobot 0.6.1 drops the velocity's Jacobian from its correction
    (module docstring of rtc.py): for a velocity function independent of x_t ("const") ours equals its
    result; for one that depends on x_t ("mlp") ours equals its result plus w t (dv/dx)^T e (`full`), and
    differs from its result by that term."""
    kind, t, beta = key
    rows = _reference_cases()[key]
    guides = [rtc.row_guide(torch.tensor(REF["case_leftover"][i][:REF["case_leftover_rows"][i],
                                                                 :REF["case_leftover_dims"][i]]),
                            int(REF["case_delay"][i]), int(REF["case_execution_horizon"][i]), 10, 3,
                            str(REF["case_schedule"][i])) for i in rows]
    batch = rtc.Guidance.stack(guides, beta)
    x = torch.tensor(REF["case_x"][rows])
    ours = rtc.guided_velocity(_velocity(kind, t), x, t, batch.target, batch.weights, beta).numpy()
    np.testing.assert_allclose(ours, REF["case_full"][rows], rtol=LEROBOT_RTOL, atol=LEROBOT_RTOL)
    if kind == "const":
        np.testing.assert_allclose(ours, REF["case_lerobot"][rows], rtol=LEROBOT_RTOL, atol=LEROBOT_RTOL)
    elif any(w.active for w in guides):
        assert np.abs(ours - REF["case_lerobot"][rows]).max() > 1e-2


def test_guidance_weight():
    assert rtc.guidance_weight(1.0, 5.0) == 5.0            # t = 1 (noise): clipped at beta
    assert rtc.guidance_weight(0.5, 5.0) == pytest.approx(2.0)
    assert rtc.guidance_weight(0.1, 5.0) == 5.0
    assert rtc.guidance_weight(0.1, 50.0) == pytest.approx((0.01 + 0.81) / 0.09)
    assert rtc.guidance_weight(0.0, 5.0) == 0.0


def test_row_guide_pads_and_ends_the_weights_at_the_leftover():
    g = rtc.row_guide(torch.ones(4, 2), delay=2, execution_horizon=8, horizon=6, action_dim=3)
    assert g.target.shape == (6, 3) and (g.target[:4, :2] == 1).all() and (g.target[4:] == 0).all()
    assert (g.target[:, 2] == 0).all()
    assert torch.equal(g.weights, rtc.prefix_weights("exp", 2, 4, 6)) and g.active
    assert not rtc.row_guide(torch.ones(4, 2), 0, 8, 6, 3, schedule="zeros").active
    with pytest.raises(ValueError, match="must be finite"):
        rtc.row_guide(torch.tensor([[float("nan")]]), 1, 4, 6, 3)
    with pytest.raises(ValueError, match=r"must be \[<= 6, <= 3\]"):
        rtc.row_guide(torch.ones(7, 3), 1, 4, 6, 3)
    assert rtc.guided_rows([None, g, rtc.row_guide(torch.ones(4, 2), 0, 0, 6, 3)]) == [1]


# ------------------------------------------------------------------------------------ the model and runner
@pytest.fixture(scope="module")
def setup():
    """A small engine's runner with three prefilled frames (prefix K/V in the pool) and their noise."""
    model = build_model(small_config(), seed=3)
    engine = build_engine(built_model=model, kv_budget_mb=4.0, robot_io=RobotIOConfig(robot_action_dim=7))
    prepared = [engine.preparer.prepare(make_observation(i)) for i in range(3)]
    frames = engine.runner.prefill([p.row for p in prepared], [0, 1, 2], [0.0, 0.0, 0.0])
    noise = torch.randn(3, H, A, generator=torch.Generator().manual_seed(0))
    return engine.runner, frames, noise


def _guide(seed: int, delay: int, horizon_end: int = 4) -> rtc.RowGuide:
    g = torch.Generator().manual_seed(seed)
    return rtc.row_guide(torch.randn(H, A, generator=g), delay, horizon_end, H, A)


def test_rows_without_guidance_are_plain_denoising_bitwise(setup):
    runner, frames, noise = setup
    plain = runner.actions(frames, noise)
    off = [None, rtc.row_guide(torch.ones(H, A), 0, 4, H, A, schedule="zeros"), None]   # all weights zero
    assert not rtc.guided_rows(off)
    for a, b in zip(plain, runner.actions(frames, noise, guides=off)):
        assert np.array_equal(a, b)
    mixed = runner.actions(frames, noise, guides=[None, _guide(1, 2), None])
    alone = runner.actions([frames[0], frames[2]], noise[[0, 2]])
    assert np.array_equal(mixed[0], alone[0]) and np.array_equal(mixed[2], alone[1])
    assert np.abs(mixed[1] - plain[1]).max() > 1e-2                  # the guided row did change


def test_rows_of_a_guided_batch_are_independent(setup):
    """Each robot's own previous chunk and delay: a batch equals each row guided alone."""
    runner, frames, noise = setup
    guides = [_guide(1, 1), _guide(2, 3, 5), _guide(3, 0)]
    batch = runner.actions(frames, noise, guides=guides)
    for i in range(3):
        (alone,) = runner.actions([frames[i]], noise[i:i + 1], guides=[guides[i]])
        assert np.abs(batch[i] - alone).max() <= GUIDED_BATCH_ATOL


def test_guidance_never_writes_or_differentiates_the_prefix_kv(setup):
    runner, frames, noise = setup
    k, v = runner.pool.kv.k.clone(), runner.pool.kv.v.clone()
    runner.actions(frames, noise, guides=[_guide(1, 2), _guide(2, 3), None])
    assert torch.equal(k, runner.pool.kv.k) and torch.equal(v, runner.pool.kv.v)
    assert runner.pool.kv.k.grad is None and not runner.pool.kv.k.requires_grad
    assert all(p.grad is None and not p.requires_grad for p in runner.model.parameters())


def test_correction_is_the_vjp_through_the_expert(setup):
    """One guided step (t = 1, weight beta): v' = v - beta (I - t dv/dx)^T e, with the expert's full Jacobian
    in x (prefix K/V held constant) computed here by torch.autograd.functional.jacobian."""
    runner, frames, noise = setup
    model, guide, beta = runner.model, _guide(4, 2, 5), 3.0
    attn = ActionAttention(runner.pool.kv, [frames[0].segment], H, "torch", model.device)
    record = []
    model.sample_actions(noise[:1], attn, steps=1, record=record, guidance=rtc.Guidance.stack([guide], beta))
    (t, x, guided), = record
    assert t == 1.0

    def velocity(z):
        return model.denoise_step(z, torch.ones(1), attn, backend="torch")
    v = velocity(x)
    jac = torch.autograd.functional.jacobian(velocity, x).reshape(H * A, H * A)      # d v / d x
    error = ((guide.target - (x - t * v)) * guide.weights[:, None]).reshape(-1)
    expected = v.reshape(-1) - beta * (error - t * jac.T @ error)
    assert torch.allclose(guided.reshape(-1), expected, atol=1e-5)


def test_guidance_pulls_the_chunk_toward_the_previous_rows(setup):
    """With delay d, the new chunk's first d rows come (much) closer to the previous chunk's rows."""
    runner, frames, noise = setup
    guide = _guide(5, delay=3, horizon_end=H)
    (plain,) = runner.actions(frames[:1], noise[:1])
    (guided,) = runner.actions(frames[:1], noise[:1], guides=[guide], max_guidance=5.0)
    target = guide.target.numpy()
    assert np.abs(guided[:3] - target[:3]).mean() < 0.3 * np.abs(plain[:3] - target[:3]).mean()


def test_guided_sampling_refuses_what_it_cannot_differentiate(setup):
    runner, frames, noise = setup
    guidance = rtc.Guidance.stack([_guide(1, 2)])
    triton = ActionAttention(runner.pool.kv, [frames[0].segment], H, "triton", runner.model.device)
    with pytest.raises(ValueError, match="needs the torch attention"):
        runner.model.sample_actions(noise[:1], triton, guidance=guidance)
    torch_attn = ActionAttention(runner.pool.kv, [frames[0].segment], H, "torch", runner.model.device)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside torch.inference_mode"):
        runner.model.sample_actions(noise[:1], torch_attn, guidance=guidance)
    with pytest.raises(ValueError, match="RTC guidance for"):
        runner.model.sample_actions(noise[:2], torch_attn, guidance=guidance)


def test_unguided_rows_keep_the_fixed_shape_loop_and_guided_rows_run_torch():
    """On a Triton runner with fixed-shape denoise loops (CUDA graphs on a GPU; Triton's interpreter here):
    a frame without an active guide still runs the fixed-shape loop, bit for bit as without guides; a
    guided frame runs the eager torch path, the same chunk as on a torch runner (prefix K/V from the two
    prefills: within GUIDED_BATCH_ATOL)."""
    model = build_model(small_config(), seed=3)
    runners = {}
    for backend, graphs in (("triton", True), ("torch", False)):
        engine = build_engine(built_model=model, backend=backend, engine=EngineConfig(cuda_graphs=graphs),
                              kv_budget_mb=4.0, robot_io=RobotIOConfig(robot_action_dim=7))
        frame = engine.runner.prefill([engine.preparer.prepare(make_observation(0)).row], [0], [0.0])
        runners[backend] = (engine.runner, frame)
    runner, frame = runners["triton"]
    noise = torch.randn(1, H, A, generator=torch.Generator().manual_seed(0))
    (plain,) = runner.actions(frame, noise)
    replays = runner.graphs.replays
    (off,) = runner.actions(frame, noise, guides=[rtc.row_guide(torch.ones(H, A), 0, 4, H, A, "zeros")])
    assert np.array_equal(off, plain) and runner.graphs.replays == replays + 1
    (guided,) = runner.actions(frame, noise, guides=[_guide(1, 2)])
    assert runner.graphs.replays == replays + 1
    torch_runner, torch_frame = runners["torch"]
    (reference,) = torch_runner.actions(torch_frame, noise, guides=[_guide(1, 2)])
    assert np.abs(guided - reference).max() <= GUIDED_BATCH_ATOL
