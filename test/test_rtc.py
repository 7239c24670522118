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

from conftest import SimClock, make_observation, small_config
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
    (module docstring of rtc.py): correction "error" equals its result; the paper's "vjp" equals its result
    plus w t (dv/dx)^T e (`full`), the same for a velocity function independent of x_t ("const"), and
    different by that term for one that depends on x_t ("mlp")."""
    kind, t, beta = key
    rows = _reference_cases()[key]
    guides = [rtc.row_guide(torch.tensor(REF["case_leftover"][i][:REF["case_leftover_rows"][i],
                                                                 :REF["case_leftover_dims"][i]]),
                            int(REF["case_delay"][i]), int(REF["case_execution_horizon"][i]), 10, 3,
                            str(REF["case_schedule"][i])) for i in rows]
    batch = rtc.Guidance.stack(guides, beta)
    x = torch.tensor(REF["case_x"][rows])
    ours = {c: rtc.guided_velocity(_velocity(kind, t), x, t, batch.target, batch.weights, beta, c).numpy()
            for c in rtc.GUIDED_CORRECTIONS}
    np.testing.assert_allclose(ours["vjp"], REF["case_full"][rows], rtol=LEROBOT_RTOL, atol=LEROBOT_RTOL)
    np.testing.assert_allclose(ours["error"], REF["case_lerobot"][rows], rtol=LEROBOT_RTOL, atol=LEROBOT_RTOL)
    if kind == "const":
        np.testing.assert_allclose(ours["vjp"], ours["error"], rtol=LEROBOT_RTOL, atol=LEROBOT_RTOL)
    elif any(w.active for w in guides):
        assert np.abs(ours["vjp"] - ours["error"]).max() > 1e-2


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


def _guide(seed: int, delay: int, horizon_end: int = 4, schedule: str = rtc.DEFAULT_SCHEDULE) -> rtc.RowGuide:
    g = torch.Generator().manual_seed(seed)
    return rtc.row_guide(torch.randn(H, A, generator=g), delay, horizon_end, H, A, schedule)


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


def test_error_correction_needs_no_autograd(setup):
    """LeRobot 0.6.1's correction runs under inference mode (no backward pass), to the same chunk."""
    runner, frames, noise = setup
    guide = _guide(5, delay=3, horizon_end=H)
    chunks = {c: runner.actions(frames[:1], noise[:1], guides=[guide], correction=c)[0]
              for c in rtc.GUIDED_CORRECTIONS}
    with torch.inference_mode():
        attn = ActionAttention(runner.pool.kv, [frames[0].segment], H, "torch", runner.model.device)
        again = runner.model.sample_actions(noise[:1], attn, guidance=rtc.Guidance.stack([guide], correction="error"))
    assert np.array_equal(again[0].numpy(), chunks["error"])
    assert np.abs(chunks["vjp"] - chunks["error"]).max() > 1e-3
    with pytest.raises(ValueError, match="correction 'exact' is not one of vjp, error, prefix"):
        rtc.Guidance.stack([guide], correction="exact")


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


# ------------------------------------------------------------------------------------ prefix conditioning
def test_a_time_per_token_is_the_time_per_row_when_they_agree(setup):
    """denoise_step with t [R, H] (prefix conditioning) computes what t [R] does when every token of a row has
    its row's time: only the condition's gather differs (float32 GEMMs of another shape: 1e-6)."""
    runner, frames, noise = setup
    attn = ActionAttention(runner.pool.kv, [f.segment for f in frames], H, "torch", runner.model.device)
    t = torch.tensor([1.0, 0.55, 0.1])
    with torch.inference_mode():
        per_row = runner.model.denoise_step(noise, t, attn)
        per_token = runner.model.denoise_step(noise, t[:, None].expand(3, H).contiguous(), attn)
        mixed = runner.model.denoise_step(noise, torch.where(torch.arange(H) < 2, 0.0, t[:, None]), attn)
    torch.testing.assert_close(per_token, per_row, atol=1e-6, rtol=1e-6)
    assert (mixed - per_row).abs().max() > 1e-3                  # the tokens' times do condition them


def test_prefix_conditioning_gives_the_pinned_rows_and_needs_a_trained_model(setup):
    """Correction "prefix": the rows with a weight come back exactly as given (the previous chunk's), the
    others are denoised conditioned on them (time 0 there, no gradient, under inference mode); a row without
    a guide in the same batch is plain denoising bit for bit. A model not trained so is refused."""
    runner, frames, noise = setup
    guides = [_guide(1, 3, H, "zeros"), None, _guide(2, 5, H, "zeros")]     # the pinned rows only
    with pytest.raises(ValueError, match="needs a model trained with prefix conditioning"):
        runner.actions(frames, noise, guides=guides, correction="prefix")
    model_cfg = runner.model.cfg
    runner.model.cfg = model_cfg.replace(prefix_conditioning=True)
    try:
        out = runner.actions(frames, noise, guides=guides, correction="prefix")
        (plain,) = runner.actions(frames[1:2], noise[1:2])
        guided_alone = runner.actions(frames[:1], noise[:1], guides=guides[:1], correction="prefix")[0]
        free_plain = runner.actions(frames[:1], noise[:1])[0]
        with pytest.raises(ValueError, match="weights must be 0 or 1"):
            runner.actions(frames[:1], noise[:1], guides=[_guide(1, 3)], correction="prefix")   # soft rows
    finally:
        runner.model.cfg = model_cfg
    for i in (0, 2):
        given = guides[i].weights.numpy() > 0
        assert given.sum() == (3, None, 5)[i]
        assert np.array_equal(out[i][given], guides[i].target.numpy()[given])
    assert np.array_equal(out[1], plain)
    assert np.abs(out[0] - guided_alone).max() <= GUIDED_BATCH_ATOL
    assert np.abs(guided_alone[3:] - free_plain[3:]).max() > 1e-3    # the free rows see the given ones


def test_an_engine_refuses_prefix_rtc_on_a_model_not_trained_for_it():
    from oxygen_ros.engine.tasks.actions import PREFIX_UNTRAINED

    model = build_model(small_config(), seed=3)
    with pytest.raises(ValueError, match="prefix conditioning") as refused:
        build_engine(built_model=model, kv_budget_mb=4.0, robot_io=RobotIOConfig(robot_action_dim=7),
                     engine=EngineConfig(rtc=True, rtc_correction="prefix"))
    assert str(refused.value) == PREFIX_UNTRAINED
    build_engine(built_model=model, kv_budget_mb=4.0, robot_io=RobotIOConfig(robot_action_dim=7),
                 engine=EngineConfig(rtc=False, rtc_correction="prefix"))      # unused while RTC is off


def test_the_engine_node_lists_prefix_rtc_on_an_untrained_checkpoint_and_reads_the_flag(tmp_path):
    """The engine node lists the refusal with its other parameter problems; a checkpoint's config.json says
    whether it was trained so (a bool, or a one-line refusal)."""
    from oxygen_ros.model.checkpoint import CheckpointError, checkpoint_settings
    from oxygen_ros.record.replay import RecordingError, build_engine as node_engine
    from oxygen_ros.robot.configs import demo_checkpoint

    with pytest.raises(RecordingError, match="needs a checkpoint trained with prefix conditioning") as refused:
        node_engine({"model": "tiny", "rtc": True, "rtc_correction": "prefix", "kv_budget_mb": -1.0})
    assert "kv_budget_mb" in str(refused.value)                     # listed together
    assert checkpoint_settings(demo_checkpoint("demo_rtc"))["prefix_conditioning"] is True
    assert "prefix_conditioning" not in checkpoint_settings(demo_checkpoint())
    (tmp_path / "config.json").write_text('{"action_horizon": 20, "prefix_conditioning": "yes"}')
    with pytest.raises(CheckpointError, match="prefix_conditioning must be true or false, got 'yes'"):
        checkpoint_settings(tmp_path)


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


# ------------------------------------------------------------------------------------ the delay evaluation
class _RowPlanner:
    """A stand-in for the engine: the chunk observed at tick t holds 100 t + k in row k (every joint), so a
    command tells which chunk and row it came from."""

    horizon, dim = 20, 3

    def __init__(self):
        self.ticks, self.resets = [], 0

    def reset(self):
        self.resets += 1

    def plan(self, image, state, prompt, noise, tick):
        from oxygen_ros.engine.engine import ChunkResult
        from oxygen_ros.robot.chunks import ActionChunkPlan
        from oxygen_ros.sim.scene import CONTROL_PERIOD_S

        self.ticks.append(tick)
        rows = 100.0 * tick + np.repeat(np.arange(self.horizon, dtype=np.float64)[:, None], self.dim, axis=1)
        return ChunkResult(ActionChunkPlan(rows, tick * CONTROL_PERIOD_S, CONTROL_PERIOD_S, tick + 1), rows, 0.0, 0)


@pytest.fixture(scope="module")
def scene_and_layout():
    from oxygen_ros.sim.scene import Layout, ReachScene

    scene = ReachScene(64)
    yield scene, Layout.random(np.random.default_rng([1000, 0]))
    scene.close()


@pytest.mark.parametrize("execution", ["naive", "rtc"])
def test_a_chunk_observed_at_t_is_first_used_at_t_plus_d(scene_and_layout, execution):
    """Simulation time: the chunk from the observation at tick t plays from tick t + d at its row d; until
    then the robot keeps what it has (the start pose before the first chunk)."""
    from oxygen_ros.eval import run_delayed_episode

    scene, layout = scene_and_layout
    planner = _RowPlanner()
    ep = run_delayed_episode(scene, layout, 0, planner, "touch", 0, steps=35, replan=10, delay=4,
                             execution=execution, blend_steps=0)
    assert not ep.success and planner.resets == 1 and planner.ticks == [0, 10, 20, 30]
    assert (ep.commands[:4] == layout.start).all() and (ep.chunk_of_tick[:4] == -1).all()
    for k in range(4, 35):
        observed = (k - 4) // 10 * 10                        # the newest chunk that has arrived by tick k
        assert ep.commands[k][0] == 100 * observed + (k - observed), k
    assert ep.switches == [14, 24, 34]


def test_jerk_windows_boundary_and_within():
    """Third differences of commanded positions: a window mixing two chunks (or a blend) is a boundary
    window, one chunk unblended a within window, any window with the held start pose neither."""
    from oxygen_ros.eval import DelayedEpisode, command_windows, execution_summary

    q = np.concatenate([np.zeros(3), 0.1 * np.arange(5), 0.1 * np.arange(5, 10) + 0.3])[:, None]
    src = np.array([-1] * 3 + [1] * 5 + [2] * 5)
    ep = DelayedEpisode(False, len(q), q, src, np.zeros(len(q), bool), [8], [None, 3])
    jerk, boundary, within = command_windows(ep)
    ticks = np.arange(3, len(q))
    assert ticks[boundary].tolist() == [8, 9, 10] and ticks[within].tolist() == [6, 7, 11, 12]
    assert jerk[within].max() == pytest.approx(0) and jerk[ticks == 8][0] == pytest.approx(0.3)
    summary = execution_summary([ep])
    assert summary["boundary_jerk"] == pytest.approx((0.3 + 0.6 + 0.3) / 3)
    assert summary["within_jerk"] == pytest.approx(0) and summary["max_command_step"] == pytest.approx(0.4)
    assert summary["mean_jerk"] == pytest.approx((0.3 + 0.6 + 0.3) / 7)
    assert summary["rtc_guided_chunks"] == 1


def test_paired_comparison_counts_the_episodes_only_one_execution_touched():
    """RTC against naive on the same episodes: only the discordant episodes move the difference; the 95%
    interval is the Wald interval of paired proportions (worked by hand: n = 10, b = 3, c = 1)."""
    from oxygen_ros.eval import DelayedEpisode, paired_comparison

    def episodes(successes):
        return [DelayedEpisode(s, 1, np.zeros((1, 3)), np.zeros(1, int), np.zeros(1, bool), [], [], 0.03)
                for s in successes]

    rtc_ok = [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    naive_ok = [1, 1, 1, 1, 0, 0, 0, 1, 0, 0]
    out = paired_comparison(episodes(map(bool, rtc_ok)), episodes(map(bool, naive_ok)))
    assert (out["episodes"], out["only_this"], out["only_naive"], out["both"]) == (10, 3, 1, 4)
    half = 1.96 * np.sqrt(3 + 1 - (3 - 1) ** 2 / 10) / 10          # 0.3719
    assert out["difference"] == pytest.approx(0.2)
    assert out["ci95"] == pytest.approx([0.2 - half, 0.2 + half], abs=1e-12)
    same = paired_comparison(episodes([True, False]), episodes([True, False]))
    assert same["difference"] == 0 and same["ci95"] == [0, 0]


def test_rtc_at_no_delay_is_naive_and_guides_later_chunks():
    """In the demo, through the engine: at d = 0 nothing plays while a chunk computes, so RTC adds nothing
    (identical commands); at d = 6 the first chunk (nothing to continue) is the same, the later ones are
    guided by the engine with d = 6."""
    from oxygen_ros.eval import evaluate_execution

    traces = {}
    out = evaluate_execution(1, seed=7000, steps=40, delays=(0, 6), executions=("naive", "rtc"), traces=traces,
                             log=lambda *_: None)
    assert out["execution"]["rtc"]["0"]["vs_naive"]["only_this"] == out["execution"]["rtc"]["0"]["vs_naive"][
        "only_naive"] == 0 and "vs_naive" not in out["execution"]["naive"]["0"]
    for trace in traces.values():       # 40 ticks: too short to touch; the closest approach is recorded
        assert not trace.success and 0.04 < trace.closest < 0.5
    assert out["execution"]["naive"]["6"]["misses_closest_cm"] == [round(traces[("naive", 6)].closest * 100, 1)]
    assert np.array_equal(traces[("naive", 0)].commands, traces[("rtc", 0)].commands)
    assert traces[("rtc", 0)].rtc_delays == [None] * 4
    naive, guided = traces[("naive", 6)], traces[("rtc", 6)]
    first_switch = naive.switches[0]
    assert np.array_equal(naive.commands[:first_switch], guided.commands[:first_switch])
    assert np.abs(naive.commands[first_switch:] - guided.commands[first_switch:]).max() > 1e-3
    assert naive.rtc_delays == [None] * 4 and guided.rtc_delays == [None, 6, 6, 6]


def test_several_seeds_pool_their_episodes():
    """`--seed 7000,7001`: the episodes of each seed in turn, each as its own seed draws it."""
    from oxygen_ros.eval import evaluate_execution

    def run(seed):
        traces = {}
        out = evaluate_execution(1, seed=seed, steps=12, delays=(0,), executions=("naive",), traces=traces,
                                 log=lambda *_: None)
        return out, traces[("naive", 0)]

    (pooled, first), (one, trace_one), (two, _) = run((7000, 7001)), run(7000), run(7001)
    assert pooled["episodes"] == 2 and pooled["seed"] == [7000, 7001] and one["seed"] == 7000
    assert np.array_equal(first.commands, trace_one.commands)
    assert pooled["execution"]["naive"]["0"]["misses_closest_cm"] == sorted(
        one["execution"]["naive"]["0"]["misses_closest_cm"] + two["execution"]["naive"]["0"]["misses_closest_cm"])


def test_the_configured_rtc_continues_the_playing_chunk_in_the_demo():
    """In the demo at d = 6, re-planning every 10 ticks (the documented evaluation, docs/rtc.md): with the
    engine's RTC settings the take-over is as smooth as the chunk itself (boundary jerk <= 1.5 x within,
    <= a quarter of naive's, the largest command step under half of naive's); without the margin row
    (LeRobot 0.6.1's weights) the take-over keeps a step (a higher boundary/within); with the paper's
    weights and correction it is hardly smoothed (the VJP vanishes on this confident model). One episode,
    60 ticks, 5 switches."""
    from oxygen_ros.eval import PAPER_RTC, RtcSettings, evaluate_execution

    def at_6(execution, settings=RtcSettings()):
        out = evaluate_execution(1, seed=7000, steps=60, replan=10, delays=(6,), executions=(execution,),
                                 settings=settings, log=lambda *_: None)
        s = out["execution"][execution]["6"]
        return s, s["boundary_jerk"] / s["within_jerk"]

    (naive, _), (configured, ratio) = at_6("naive"), at_6("rtc")
    (_, ratio_no_margin), (paper, ratio_paper) = at_6("rtc", RtcSettings(margin_rows=0)), at_6("rtc", PAPER_RTC)
    assert configured["rtc_guided_chunks"] == paper["rtc_guided_chunks"] > 0
    assert ratio <= 1.5 and configured["boundary_jerk"] <= 0.25 * naive["boundary_jerk"]
    assert configured["max_command_step"] < 0.5 * naive["max_command_step"]
    assert ratio_no_margin > ratio
    assert ratio_paper > 1.5 and paper["boundary_jerk"] > 0.5 * naive["boundary_jerk"]


# ------------------------------------------------------------------------------------ the engine's actions task
DT = 1 / 70                      # the small engine's rows: one per publish tick at 70 Hz


def _obs(i: int, stamp: float, seed: int = 0):
    o = make_observation(i, seed=seed)
    o.stamp_s = stamp
    return o


def _noise(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((H, A)).astype(np.float32)


def test_the_engine_guides_a_robots_chunk_by_the_chunk_it_delivered(engine_factory):
    """rtc on (delay fixed at 2 rows): the first chunk is plain (nothing plays) and bitwise the rtc-off
    engine's; the next is guided, its first rows closer to the delivered chunk's rows for the same times."""
    on, off = engine_factory(rtc=True, rtc_delay_rows=2), engine_factory()
    for engine in (on, off):
        engine.run_cycle(_obs(0, 10.0), _noise(0))
    first = on.latest_chunk()
    assert first.rtc_delay_rows is None and np.array_equal(first.model_actions, off.latest_chunk().model_actions)
    for engine in (on, off):
        engine.run_cycle(_obs(1, 10.0 + 2 * DT), _noise(1))
    guided, plain = on.latest_chunk(), off.latest_chunk()
    assert guided.rtc_delay_rows == 2 and plain.rtc_delay_rows is None
    playing = first.plan.actions[2:4]                   # the delivered chunk's rows for the new rows 0, 1
    assert np.abs(guided.plan.actions[:2] - playing).mean() < 0.5 * np.abs(plain.plan.actions[:2] - playing).mean()
    assert on.stats.snapshot()["counters"]["rtc_guided_chunks"] == 1


def test_a_robot_added_without_rtc_gets_plain_chunks_on_an_rtc_engine(engine_factory):
    """Per robot: an openpi client (added with rtc=False) plays chunks open-loop, so the engine's RTC leaves
    its chunks plain (the rtc-off engine's), while the robot beside it in the same cycles is guided."""
    from oxygen_ros.engine.factory import robot_preparer

    on, off = engine_factory(rtc=True, rtc_delay_rows=2), engine_factory()
    for engine in (on, off):
        engine.add_robot("client", robot_preparer(engine.runner.cfg, engine.tokenizer, engine.preparer.io.config),
                         rtc=False)
    for i, stamp in enumerate((10.0, 10.0 + 2 * DT)):
        for engine in (on, off):
            engine.run_frames({"": _obs(i, stamp), "client": _obs(i, stamp, seed=1)},
                              {"": _noise(i), "client": _noise(10 + i)})
    assert on.latest_chunk().rtc_delay_rows == 2                     # the ROS robot: guided
    client, plain = on.latest_chunk("client"), off.latest_chunk("client")
    assert client.rtc_delay_rows is None
    # Beside a guided row it denoises as its own batch of 1, the rtc-off engine's batch holds both rows: the
    # fleet's batch-composition tolerance (docs/numerics.md), not bitwise.
    np.testing.assert_allclose(client.model_actions, plain.model_actions, rtol=0, atol=2e-5)
    on.remove_robot("client")                                          # its setting goes with it
    assert "client" not in on.actions._unguided


def test_the_guide_is_the_playing_chunk_in_the_new_frames_model_space(small_model, tmp_path):
    """Alignment and delta actions: the guide's rows, taken back to robot units with the NEW observation's
    state, are the delivered chunk's rows for the same times (row 3 on: 3 rows passed between the stamps)."""
    stats = {"mean": [0.0] * 8, "std": [1.0] * 8, "q01": [-2.0 + 0.1 * i for i in range(8)],
             "q99": [1.0 + 0.2 * i for i in range(8)]}
    path = tmp_path / "norm_stats.json"
    path.write_text(__import__("json").dumps({"norm_stats": {"state": stats, "actions": stats}}))
    engine = build_engine(built_model=small_model, norm_stats=str(path), kv_budget_mb=4.0,
                          robot_io=RobotIOConfig(robot_action_dim=7, delta_action_mask=(True, True, False, True)),
                          engine=EngineConfig(rtc=True, rtc_delay_rows=1))
    real, seen = engine.runner.actions, []
    engine.runner.actions = lambda *args, **kwargs: (seen.append(kwargs.get("guides")), real(*args, **kwargs))[1]
    engine.run_cycle(_obs(0, 5.0, seed=1), _noise(0))
    delivered = engine.latest_chunk()
    new = _obs(1, 5.0 + 3 * DT, seed=2)                # another state: the deltas' base moved
    engine.run_cycle(new, _noise(1))
    assert seen[0] == [None] and seen[1][0] is not None
    target = seen[1][0].target.numpy()[:H - 3]
    back = engine.preparer.robot_actions(np.pad(target, ((0, 3), (0, 0))), engine.preparer.prepare(new))[:H - 3]
    np.testing.assert_allclose(back, delivered.plan.actions[3:], atol=1e-5)


@pytest.mark.parametrize("margin", [0, 1, 2])
def test_the_guide_pins_the_delay_and_the_margin_rows(engine_factory, margin):
    """Weight 1 on the d rows that play before the take-over and on rtc_margin_rows more (the first rows the
    new chunk plays), then the schedule's decay to the playing chunk's last row: LeRobot's weights with
    start d + margin (margin 0: the paper's). The chunk's reported delay stays d."""
    engine = engine_factory(rtc=True, rtc_delay_rows=1, rtc_margin_rows=margin, rtc_schedule="linear")
    real, seen = engine.runner.actions, []
    engine.runner.actions = lambda *args, **kwargs: (seen.append(kwargs.get("guides")), real(*args, **kwargs))[1]
    engine.run_cycle(_obs(0, 10.0), _noise(0))
    engine.run_cycle(_obs(1, 10.0 + DT), _noise(1))      # a row later: H - 1 rows of it left
    assert engine.latest_chunk().rtc_delay_rows == 1
    weights = seen[1][0].weights
    # LeRobot 0.6.1's linear weights, written out: 1 on rows < start, then linspace(1, 0, span + 2)[1:-1] over
    # the span = end - start rows up to end (the playing chunk's H - 1 = 4 rows left), 0 from there on.
    expected = {0: [1, 3 / 4, 2 / 4, 1 / 4, 0], 1: [1, 1, 2 / 3, 1 / 3, 0], 2: [1, 1, 1, 1 / 2, 0]}[margin]
    np.testing.assert_allclose(weights.numpy(), expected, rtol=0, atol=1e-7)


def test_every_robot_is_guided_by_its_own_chunk(small_model):
    """A fleet cycle: robot a (a delivered chunk) is guided, robot b (none yet) is plain; a's chunk equals a
    single-robot engine's doing the same (GUIDED_BATCH_ATOL)."""
    io = RobotIOConfig(robot_action_dim=7)
    fleet = build_engine(built_model=small_model, robots={"a": io, "b": io}, kv_budget_mb=8.0,
                         engine=EngineConfig(rtc=True, rtc_delay_rows=2))
    solo = build_engine(built_model=small_model, robot_io=io, kv_budget_mb=4.0,
                        engine=EngineConfig(rtc=True, rtc_delay_rows=2))
    fleet.run_frames({"a": _obs(0, 1.0)}, {"a": _noise(0)})
    solo.run_cycle(_obs(0, 1.0), _noise(0))
    fleet.run_frames({"a": _obs(1, 1.0 + DT), "b": _obs(1, 1.0 + DT, seed=5)}, {"a": _noise(1), "b": _noise(2)})
    solo.run_cycle(_obs(1, 1.0 + DT), _noise(1))
    assert fleet.latest_chunk("a").rtc_delay_rows == 2 and fleet.latest_chunk("b").rtc_delay_rows is None
    assert np.abs(fleet.latest_chunk("a").model_actions - solo.latest_chunk().model_actions).max() <= GUIDED_BATCH_ATOL


def test_the_delay_is_predicted_from_the_wait_and_the_measured_latency(engine_factory):
    """d = ceil((wait in the engine + the longest recent cycle-start-to-chunk latency) / control period)."""
    clock = SimClock(100.0)
    engine = engine_factory(rtc=True, clock=clock)
    real = engine.runner.actions
    engine.submit_observation(_obs(0, 5.0), _noise(0))
    clock.advance(3 * DT)
    engine.run_cycle()                                       # nothing plays yet: plain
    assert engine.latest_chunk().rtc_delay_rows is None
    engine.runner.actions = lambda *args, **kwargs: (clock.advance(4 * DT), real(*args, **kwargs))[1]
    engine.submit_observation(_obs(1, 5.0 + DT), _noise(1))
    clock.advance(2 * DT)
    engine.run_cycle()                                       # waited 2 rows, no latency measured yet
    assert engine.latest_chunk().rtc_delay_rows == 2
    engine.submit_observation(_obs(2, 5.0 + 2 * DT), _noise(2))
    engine.run_cycle()                                       # no wait, the last chunk took 4 rows
    assert engine.latest_chunk().rtc_delay_rows == 4
    engine.actions.forget("")                                # nothing plays any more: nothing to continue
    engine.submit_observation(_obs(3, 5.0 + 3 * DT), _noise(3))
    engine.run_cycle()
    assert engine.latest_chunk().rtc_delay_rows is None


@pytest.mark.parametrize("wait_rows, latency_rows, delay", [(2.5, 0.0, 3), (0.25, 1.5, 2), (1.0, 1.0, 2)])
def test_a_delay_of_part_of_a_row_is_rounded_up(engine_factory, wait_rows, latency_rows, delay):
    """A row that starts playing before the take-over is committed even if only part of its time passes:
    d = ceil((wait + latency) / control period), never rounded down."""
    clock = SimClock(100.0)
    engine = engine_factory(rtc=True, clock=clock)
    real = engine.runner.actions
    engine.runner.actions = lambda *args, **kwargs: (clock.advance(latency_rows * DT), real(*args, **kwargs))[1]
    engine.submit_observation(_obs(0, 5.0), _noise(0))
    engine.run_cycle()                                       # nothing plays yet; measures the latency
    engine.submit_observation(_obs(1, 5.0 + DT), _noise(1))
    clock.advance(wait_rows * DT)
    engine.run_cycle()
    assert engine.latest_chunk().rtc_delay_rows == delay


def test_rtc_continues_the_chunk_that_plays_after_the_output_comes_back_on(engine_factory):
    """While the output is off the chunks are plain and nothing plays them; back on, the next chunk's guide
    is the LAST chunk delivered (the one the robot starts playing), aligned to the new stamp: not the chunk
    delivered before the output went off."""
    engine = engine_factory(rtc=True, rtc_delay_rows=1)
    real, seen = engine.runner.actions, []
    engine.runner.actions = lambda *args, **kwargs: (seen.append(kwargs.get("guides")), real(*args, **kwargs))[1]
    engine.run_cycle(_obs(0, 10.0), _noise(0))
    before_off = engine.latest_chunk()
    engine.actions.set_playing("", False)
    for i in (1, 2):
        engine.run_cycle(_obs(i, 10.0 + i * DT, seed=i), _noise(i))
    assert seen[1:] == [[None], [None]]                         # plain while off
    last = engine.latest_chunk()
    engine.actions.set_playing("", True)
    engine.run_cycle(_obs(3, 10.0 + 3 * DT, seed=3), _noise(3))   # a row after the last chunk's stamp
    target = seen[3][0].target.numpy()
    np.testing.assert_array_equal(target[:H - 1], last.model_actions[1:].astype(np.float32))
    assert not np.allclose(target[:H - 1], before_off.model_actions[1:], atol=1e-3)


@pytest.mark.parametrize("argv, message", [
    (["--ros", "--execution", "naive,rtc"], "--ros takes one --execution"),
    (["--ros", "--execution", "rtc", "--delay-ticks", "3"], "--ros takes one --execution and no --delay-ticks"),
    (["--execution", "smooth"], "--execution 'smooth' is not one of naive, blend, rtc"),
    (["--delay-ticks", "12"], "delays up to 12 ticks need a re-plan period (--replan) >= 12"),
    (["--delay-ticks", "3", "--replan", "18"], "delay + re-plan period must fit the chunk (20 rows)"),
    (["--delay-ticks", "x"], "--delay-ticks must be comma-separated integers"),
    (["--seed", "1000,x", "--execution", "rtc"], "--seed must be an integer or comma-separated integers"),
    (["--seed", "1000,2000", "--ros", "--execution", "rtc"], "several --seed values pool episodes in the in-process"),
    (["--seed", "1000,2000"], "several --seed values pool episodes in the in-process --execution evaluation only"),
])
def test_execution_options_are_checked(argv, message, capsys):
    from oxygen_ros.eval import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.timing
def test_rtc_through_the_real_nodes():
    """`--ros --execution rtc`: the demo bringup with the engine's RTC on and the publisher in execution rtc
    (which refuses to start without it: a run at all shows both applied). 4 episodes of seed 1000, at least
    3 touched (through ROS with naive: 8/8 of the first 8, test_eval_ros.py)."""
    from ros_harness import private_domain

    from oxygen_ros.eval import evaluate_ros

    out = evaluate_ros(4, seed=1000, domain=private_domain(62), log=lambda *_: None, execution="rtc")
    assert out["execution"] == "rtc" and [o["episode"] for o in out["outcomes"]] == [0, 1, 2, 3]
    assert sum(o["success"] for o in out["outcomes"]) >= 3, out
