"""Fixed-shape steps (oxygen_ros/engine/graphs.py): the decode step per batch bucket and the denoise loop
read all their metadata from fixed buffers, so they can be CUDA graphs. Here (CPU) they replay eagerly
through Triton's interpreter; with OXYGEN_KERNEL_TEST_DEVICE=cuda the same tests capture real graphs.

The contract: the same tokens and actions as the dynamic path (float32: actions within 1e-5, logits within
1e-5; only batch padding differs, and a padding row never touches a real block)."""
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import KERNEL_TEST_DEVICE as DEVICE
from conftest import make_observation, small_config
from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.factory import build_engine, build_model
from oxygen_ros.engine.graphs import batch_buckets
from oxygen_ros.engine.requests import TextRequest
from oxygen_ros.model.attention import CachedAttention, CachedRow, Segment
from oxygen_ros.robot.policy_io import RobotIOConfig

TOL = 1e-5
QUESTIONS = ["what is on the table?", "where is the red cup?", "describe the scene.", "is the gripper open?"]


def make_engine(graphs, backend="triton", dtype=torch.float32, **cfg):
    model = build_model(small_config(), device=DEVICE, dtype=dtype, seed=3)
    return build_engine(built_model=model, backend=backend, engine=EngineConfig(cuda_graphs=graphs, **cfg),
                        kv_budget_mb=4.0, robot_io=RobotIOConfig(robot_action_dim=7))


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(4) == (1, 2, 4)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 32)


def run(engine, frames=6, max_tokens=7):
    handles, chunks = [], []
    for i in range(frames):
        handles.append(engine.submit(TextRequest(QUESTIONS[i % 4], max_tokens=max_tokens)))
        noise = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + i)).numpy()
        report = engine.run_cycle(make_observation(i), noise)
        assert report.fault == "", report.fault
        chunks.append(engine.latest_chunk().model_actions)
    while engine.active_requests or engine.queued_requests:
        engine.run_cycle(None)
    return np.stack(chunks), [h.result(0) for h in handles]


def test_engine_with_fixed_shape_steps_matches_dynamic_path():
    """Continuous batching of 1..4 requests (a batch of 3 runs in bucket 4 with a padding row): same action
    chunks, same replies token for token, every step served by a fixed-shape step, pool empty after."""
    cfg = dict(policy="oxygen", decode_budget="fixed", tokens_per_frame=2, max_active_requests=4)
    fixed, dynamic = make_engine(True, **cfg), make_engine(False, **cfg)
    assert dynamic.runner.graphs is None and fixed.runner.graphs.buckets == (1, 2, 4)
    a_fixed, r_fixed = run(fixed)
    a_dyn, r_dyn = run(dynamic)
    assert np.abs(a_fixed - a_dyn).max() <= TOL
    assert all(r.success for r in r_fixed)
    assert [r.tokens for r in r_fixed] == [r.tokens for r in r_dyn]
    batches = {b for c in fixed.stats._cycles for b in c.batch_sizes}
    assert 3 in batches, batches                           # a padded bucket was exercised
    snap = fixed.stats.snapshot()
    assert snap["graph_fallbacks"] == 0
    decode_steps = sum(c.decode_steps for c in fixed.stats._cycles)
    assert snap["graph_replays"] == 6 + decode_steps and decode_steps > 0     # every chunk and every step
    assert fixed.runner.pool.blocks.num_used == 0


def _pool_state(pool):
    return pool.kv.k.clone(), pool.kv.v.clone()


def _assert_only_changed(pool, before, changed_slots):
    """Every pool slot except `changed_slots` and the scratch block is bitwise unchanged."""
    bs = pool.block_size
    keep = torch.ones(pool.kv.k.shape[1] * bs, dtype=torch.bool)
    keep[pool.scratch_block * bs:(pool.scratch_block + 1) * bs] = False
    keep[list(changed_slots)] = False
    for now, then in zip((pool.kv.k, pool.kv.v), before):
        flat_now, flat_then = now.flatten(1, 2), then.flatten(1, 2)
        assert torch.equal(flat_now[:, keep.to(now.device)], flat_then[:, keep.to(now.device)])


def test_padded_decode_step_equals_dynamic_and_touches_no_real_block():
    engine = make_engine(True, max_active_requests=4)
    runner, graphs, pool = engine.runner, engine.runner.graphs, engine.runner.pool
    g = torch.Generator().manual_seed(0)
    pool.kv.k.copy_(torch.randn(pool.kv.k.shape, generator=g))     # garbage everywhere: stray writes show
    pool.kv.v.copy_(torch.randn(pool.kv.v.shape, generator=g))
    prefix = Segment(pool.blocks.allocate(3), 37)              # 37 tokens over 3 blocks of 16
    own = [pool.blocks.allocate(2), pool.blocks.allocate(1)]
    rows = [CachedRow(1, Segment(own[0], 17), prefix),            # new token opens its second block
            CachedRow(1, Segment(own[1], 1), prefix)]             # first token of a reply
    tokens = [5, 9]
    write = [own[0][1] * 16, own[1][0] * 16]
    before = _pool_state(pool)

    graphs.warm_up(4)                                              # padding only: no real block changes
    _assert_only_changed(pool, before, [])
    fixed = graphs.decode_step(4)(rows, tokens)                    # 2 real rows + 2 padding rows
    after_fixed = _pool_state(pool)
    _assert_only_changed(pool, before, write)

    pool.kv.k.copy_(before[0])
    pool.kv.v.copy_(before[1])
    model = runner.model
    dynamic = model.logits(model.extend(torch.tensor(tokens), CachedAttention(pool.kv, rows, "triton",
                                                                              model.device)))
    torch.testing.assert_close(fixed, dynamic, atol=TOL, rtol=0)
    for a, b in zip(after_fixed, _pool_state(pool)):               # the same K/V landed in the same slots
        torch.testing.assert_close(a.flatten(1, 2)[:, write], b.flatten(1, 2)[:, write], atol=TOL, rtol=0)


def test_rows_wider_than_the_tables_fall_back_to_the_dynamic_path():
    engine = make_engine(True, max_active_requests=2)
    runner, pool = engine.runner, engine.runner.pool
    graphs = runner.enable_graphs(max_batch=2, own_tokens=16, capture=runner.graphs.capture)  # 1 own block
    prefix = Segment(pool.blocks.allocate(2), 20)
    long_row = CachedRow(1, Segment(pool.blocks.allocate(2), 17), prefix)
    assert graphs.decode_step_for([long_row]) is None and graphs.fallbacks == 1
    assert graphs.decode_step_for([long_row] * 3) is None                   # more rows than the cap
    assert graphs.denoise_loop_for(prefix, 6, 4) is None                    # another horizon
    assert graphs.fallbacks == 3 and graphs.replays == 0


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


# What a CUDA graph cannot capture: reading a device value on the host (a sync), or a tensor made from host
# data (a host-to-device copy baked in with stale contents).
HOST_WORK = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
             "aten.nonzero.default", "aten.equal.default", "aten.lift_fresh.default"}


def test_fixed_shape_steps_do_no_host_work():
    engine = make_engine(True, max_active_requests=2)
    graphs = engine.runner.graphs
    graphs.warm_up(4)
    for step in (graphs.decode_step(2), graphs.denoise_loop(4)):
        with torch.inference_mode(), _OpLog() as log:
            step._forward()
        assert "aten.linear.default" in log.ops                    # the log sees the step's work
        assert not log.ops & HOST_WORK, log.ops & HOST_WORK
    engine.runner.model._schedules.clear()                         # the denoise schedule must be cached:
    with torch.inference_mode(), _OpLog() as log:                  # made afresh, it comes from host data
        graphs.denoise_loop(4)._forward()
    assert log.ops & HOST_WORK


def test_cuda_graphs_default_on_cuda_only_and_need_triton():
    engine = make_engine(None, backend=None, dtype=None)
    on_cuda = DEVICE == "cuda"
    assert (engine.runner.graphs is not None) == on_cuda
    if on_cuda:
        assert engine.runner.graphs.capture and engine.runner.graphs._decode    # captured at start
    with pytest.raises(ValueError, match="triton attention backend"):
        make_engine(True, backend="torch")


def test_a_failed_default_capture_runs_eagerly_and_says_so(monkeypatch):
    """Unset cuda_graphs: a capture failure at start is reported and the engine runs the dynamic path."""
    from oxygen_ros.engine.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "graphs_by_default", lambda runner: True)
    engine = make_engine(None, backend="torch")        # the torch backend cannot serve fixed-shape steps
    assert engine.runner.graphs is None
    snap = engine.stats.snapshot()
    assert "CUDA graphs unavailable" in snap["last_error"] and snap["counters"]["graph_capture_failures"] == 1
    engine.run_cycle(make_observation(0), np.zeros((5, 8), np.float32))
    assert engine.latest_chunk() is not None
