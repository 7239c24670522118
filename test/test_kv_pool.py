"""KVPool / BlockManager / FrameCache: reference counts, sharing without copy, exhaustion, no leaks."""
import pytest
import torch

from oxygen_ros.engine.block_manager import BlockManager, PoolExhausted
from oxygen_ros.engine.kv_pool import FrameCache, KVPool
from oxygen_ros.engine.requests import TextRequest
from oxygen_ros.model.attention import Segment


def test_allocator_refcounts_and_free():
    a = BlockManager(8, 16)
    blocks = a.allocate(3)
    assert len(set(blocks)) == 3 and a.num_used == 3 and all(a.refcount(b) == 1 for b in blocks)
    a.incref(blocks)
    a.decref(blocks)
    assert a.num_used == 3                      # still one reference
    a.decref(blocks)
    assert a.num_used == 0 and a.num_free == 8
    with pytest.raises(RuntimeError, match="decref of free block"):
        a.decref(blocks[:1])
    with pytest.raises(RuntimeError, match="incref of free block"):
        a.incref(blocks[:1])


def test_allocator_prefers_consecutive_runs_and_reports_exhaustion():
    a = BlockManager(10, 16)
    x = a.allocate(4)
    y = a.allocate(2)
    a.decref(x[1:2])                            # a hole at one block
    z = a.allocate(3)
    assert list(z) == list(range(z[0], z[0] + 3)), "a free run of 3 exists and must be used"
    assert a.peak_used == 8
    with pytest.raises(PoolExhausted, match=r"need 5 KV blocks, 2 free of 10"):
        a.allocate(5)
    assert a.num_used == 8                      # a failed allocation takes nothing
    for blocks in (x[:1], x[2:], y, z):
        a.decref(blocks)
    assert a.num_used == 0


def test_pool_sizing_from_budget():
    pool = KVPool.from_budget(1 << 20, layers=2, kv_heads=1, head_dim=16, block_size=16,
                              dtype=torch.float32, device="cpu")
    per_block = 2 * 2 * 16 * 16 * 4
    assert pool.num_blocks == (1 << 20) // per_block - 1          # one block of the budget is the scratch
    assert pool.kv.k.shape[1] == pool.num_blocks + 1 and pool.scratch_block == pool.num_blocks
    assert pool.kv.bytes_per_block == per_block
    assert pool.blocks_for(1) == 1 and pool.blocks_for(16) == 1 and pool.blocks_for(17) == 2
    with pytest.raises(ValueError, match="less than two blocks"):
        KVPool.from_budget(100, 2, 1, 16, 16, torch.float32, "cpu")


def test_frame_cache_blocks_return_with_last_reference():
    pool = KVPool(layers=1, kv_heads=1, head_dim=4, block_size=4, num_blocks=6, dtype=torch.float32, device="cpu")
    blocks = pool.blocks.allocate(2)
    frame = FrameCache(pool, Segment(blocks, 7), 0, 0.0, torch.zeros(4))
    frame.retain()
    frame.retain()
    assert pool.blocks.refcount(blocks[0]) == 3
    frame.release()
    frame.release()
    assert pool.blocks.num_used == 2
    frame.release()
    assert pool.blocks.num_used == 0
    with pytest.raises(RuntimeError):
        frame.release()


def test_requests_share_frame_blocks_without_copy(engine_factory, obs):
    """Every language request admitted on a frame points at the frame's own pool blocks: the same storage
    (data pointers), not a copy; its own blocks hold only question + reply."""
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=1)
    handles = [engine.submit(TextRequest("what is on the table?", max_tokens=8)) for _ in range(3)]
    engine.run_cycle(obs(0))
    active = list(engine.scheduler.running)
    assert len(active) == 3
    frame = active[0].frame
    assert all(r.frame is frame for r in active)
    kv = engine.runner.pool.kv
    prefix_ptrs = {kv.k[0, b].data_ptr() for b in frame.segment.blocks}
    for r in active:
        assert {kv.k[0, b].data_ptr() for b in r.frame.segment.blocks} == prefix_ptrs
        assert not set(r.blocks) & set(frame.segment.blocks)
        assert len(r.blocks) == engine.scheduler.own_blocks(len(r.question), 8)
        assert engine.runner.pool.blocks.refcount(frame.segment.blocks[0]) == 3   # 3 requests
    while engine.active_requests:
        engine.run_cycle(None)
    assert all(h.result(0).success for h in handles)
    assert engine.runner.pool.blocks.num_used == 0


def test_pool_exhaustion_is_back_pressure_not_a_crash(engine_factory, obs):
    """A pool with room for little more than the reserve: requests wait in the queue (never OOM), the
    action chunk of every frame is still computed, and everything completes and frees its blocks."""
    engine = engine_factory(kv_budget_mb=0.06, block_size=8, policy="oxygen", decode_budget="fixed",
                            tokens_per_frame=4, max_active_requests=32)
    pool = engine.runner.pool
    handles = [engine.submit(TextRequest("describe the table please", max_tokens=12)) for _ in range(8)]
    peak_active, chunks = 0, 0
    for i in range(40):
        engine.run_cycle(obs(i))
        chunks += engine.latest_chunk() is not None and engine.latest_chunk().plan.frame_index == i
        peak_active = max(peak_active, engine.active_requests)
        assert pool.blocks.num_free >= engine.scheduler.reserve_blocks   # the next frame always fits
        if all(h.done() for h in handles):
            break
    assert chunks == i + 1, "every frame produced its action chunk"
    assert 0 < peak_active < 8, "the pool admitted only what fits"
    assert engine.stats.counter("admission_waits") > 0
    assert all(h.result(0).success for h in handles)
    assert pool.blocks.num_used == 0


def test_attention_reads_the_right_slots_from_scattered_blocks():
    """Blocks handed out out of order (normal once blocks are freed) must be gathered, not sliced: a
    segment over blocks (3, 9, 5) spans slots 48..90 without being the run 48..90."""
    from oxygen_ros.kernels.meta import _slots

    idx = _slots((3, 9, 5), 16, 0, 43, "cpu")
    expected = list(range(48, 64)) + list(range(144, 160)) + list(range(80, 91))
    assert not isinstance(idx, slice) and idx.tolist() == expected
    assert _slots((4, 5, 6), 16, 0, 40, "cpu") == slice(64, 104)
