"""Triton kernels against their torch references (oxygen_ros.kernels.ops), on the CPU through Triton's
interpreter (conftest.py sets TRITON_INTERPRET before triton is imported), or compiled on a GPU with
OXYGEN_KERNEL_TEST_DEVICE=cuda."""
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import KERNEL_TEST_DEVICE as DEVICE
from oxygen_ros.kernels import ops
from oxygen_ros.model.attention import CachedRow, Segment

# Tolerances of a Triton output against the torch reference (which computes in float32 from the same stored
# values, then rounds to the storage dtype). float32: summation order and exp2 vs exp only (~1e-7 seen).
# float16: P is rounded to fp16 for the P@V product (flash attention does so) + output rounding (2^-11).
# bfloat16: the same with 8 mantissa bits (P rounding and one output ulp ~ 2^-8 relative).
ATTN_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Norms: same float32 statistics; a rounding-boundary flip of the output costs one ulp of the storage dtype
# (bf16 2^-8, fp16 2^-11 relative; values here reach ~10); float32 differs by the summation order of sum(x^2)
# (and rsqrt). The interpreter rounds float32 -> bfloat16 toward zero (the GPU: to nearest even), up to one
# bf16 ulp off, which the bf16 tolerances cover.
NORM_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def kernels():
    """(triton_attention, triton_norms)."""
    from oxygen_ros.kernels import triton_attention, triton_norms

    return triton_attention, triton_norms






# ---------------------------------------------------------------------------------------------- helpers
class Pool:
    """A one-layer pool whose blocks are handed out from a (shuffled) permutation. Every slot is NaN until
    written: a kernel that reads a slot outside the segments (padding, block tails) produces NaN."""

    def __init__(self, num_blocks, block_size, kv_heads, head_dim, dtype, shuffle, gen):
        self.bs = block_size
        self.order = torch.randperm(num_blocks, generator=gen).tolist() if shuffle else list(range(num_blocks))
        self.next = 0
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=dtype)
        self.v = torch.full(shape, float("nan"), dtype=dtype)
        self.gen = gen

    def segment(self, length, filled):
        n = max(1, -(-length // self.bs))
        blocks = tuple(self.order[self.next:self.next + n])
        self.next += n
        assert len(blocks) == n, "pool too small"
        kf, vf = self.k.view(-1, *self.k.shape[2:]), self.v.view(-1, *self.v.shape[2:])
        for j in range(filled):
            slot = blocks[j // self.bs] * self.bs + j % self.bs
            kf[slot] = torch.randn(kf.shape[1:], generator=self.gen).to(kf.dtype)
            vf[slot] = torch.randn(vf.shape[1:], generator=self.gen).to(vf.dtype)
        return Segment(blocks, length)


def randn(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen).to(dtype)


def same_pool(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def to_dev(*ts):
    return [t.to(DEVICE) for t in ts]


# ---------------------------------------------------------------------------------------------- cached
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# id: heads, kv_heads, head_dim, block_size, dtype, shuffled blocks, splits,
#     rows [(prefix (name, length) or None, own_before, n_new, bidir)]; rows naming one prefix share it.
CACHED_CASES = {
    "prefill_bidir_contiguous_g1": (2, 2, 32, 16, F32, False, None, [(None, 0, 37, 37)]),
    "prefill_bidir_shuffled": (2, 2, 32, 16, F32, True, None, [(None, 0, 37, 37)]),
    "prefill_oxygen_partial_bidir": (4, 1, 16, 4, F32, True, None, [(None, 0, 21, 13)]),
    "prefill_two_rows_causal_and_bidir_f16": (4, 2, 64, 16, F16, True, None, [(None, 0, 17, 0), (None, 0, 16, 16)]),
    "question_after_prefix_bf16": (8, 1, 16, 4, BF16, True, None, [(("A", 19), 0, 6, 0)]),
    "decode_mixed_rows": (8, 1, 16, 4, F32, True, None,
                          [(("A", 13), 4, 1, 0), (("A", 13), 0, 1, 0), (("B", 1), 7, 1, 0), (None, 3, 1, 0)]),
    "prefill_and_decode_f16": (2, 1, 64, 8, F16, True, None,
                               [(None, 0, 9, 5), (("A", 20), 2, 3, 0), (("A", 20), 15, 1, 0)]),
    "decode_hd256_bf16": (8, 1, 256, 16, BF16, True, None, [(("A", 40), 3, 1, 0), (("A", 40), 0, 1, 0)]),
    "group3_hd80_prefix_partial_bidir_bf16": (6, 2, 80, 4, BF16, True, None, [(("A", 9), 2, 5, 3)]),
    "splits3": (4, 1, 32, 4, F32, True, 3, [(("A", 30), 5, 1, 0), (None, 0, 19, 7), (("A", 30), 0, 4, 0)]),
    "splits4_some_empty_bf16": (4, 1, 128, 16, BF16, True, 4, [(("A", 50), 2, 1, 0)]),
    "block_size_1": (2, 1, 16, 1, F32, True, None, [(("A", 3), 1, 2, 1)]),
    "lengths_1": (4, 4, 16, 4, F16, True, 2, [(("A", 1), 0, 1, 0), (None, 0, 1, 1)]),
}


def build_cached(case, seed=0):
    heads, kvh, hd, bs, dtype, shuffle, splits, spec = case
    gen = torch.Generator().manual_seed(seed)
    pool = Pool(64, bs, kvh, hd, dtype, shuffle, gen)
    prefixes, rows = {}, []
    for prefix, before, n_new, bidir in spec:
        seg = None
        if prefix is not None:
            if prefix[0] not in prefixes:
                prefixes[prefix[0]] = pool.segment(prefix[1], prefix[1])
            seg = prefixes[prefix[0]]
        rows.append(CachedRow(n_new, pool.segment(before + n_new, before), seg, bidir))
    t = sum(r.n_new for r in rows)
    q, k, v = (randn(t, heads, hd, dtype=dtype, gen=gen), randn(t, kvh, hd, dtype=dtype, gen=gen),
               randn(t, kvh, hd, dtype=dtype, gen=gen))
    return pool, rows, q, k, v, splits


@pytest.mark.parametrize("name", list(CACHED_CASES))
def test_cached_attention_matches_torch(name):
    ta, _ = kernels()
    pool, rows, q, k, v, splits = build_cached(CACHED_CASES[name])
    dtype = q.dtype
    bs = pool.bs
    meta_ref = ops.CachedMeta.build(rows, bs, "cpu")
    kr, vr = pool.k.clone(), pool.v.clone()
    ref = ops.torch_cached_attention(q, k, v, kr, vr, meta_ref)

    meta = ops.CachedMeta.build(rows, bs, DEVICE, with_tensors=True)
    q_, k_, v_, kt, vt = to_dev(q, k, v, pool.k.clone(), pool.v.clone())
    out = ta.cached_attention(q_, k_, v_, kt, vt, meta, num_splits=splits).cpu()
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **ATTN_TOL[dtype])
    # The fused store wrote exactly the torch path's slots and values (and nothing else: NaN elsewhere).
    same_pool(kt.cpu(), kr)
    same_pool(vt.cpu(), vr)


def test_cached_attention_splits_agree():
    """Split-KV (partials merged by log-sum-exp) gives the unsplit result."""
    ta, _ = kernels()
    pool, rows, q, k, v, _ = build_cached(CACHED_CASES["decode_mixed_rows"], seed=3)
    meta = ops.CachedMeta.build(rows, pool.bs, DEVICE, with_tensors=True)
    outs = []
    for splits in (1, 2, 5):
        q_, k_, v_, kt, vt = to_dev(q, k, v, pool.k.clone(), pool.v.clone())
        outs.append(ta.cached_attention(q_, k_, v_, kt, vt, meta, num_splits=splits).cpu())
    torch.testing.assert_close(outs[1], outs[0], **ATTN_TOL[q.dtype])
    torch.testing.assert_close(outs[2], outs[0], **ATTN_TOL[q.dtype])


def test_cached_attention_dispatch_and_model_object():
    """ops.cached_attention(backend='triton') on a CachedAttention's meta (what the model calls)."""
    kernels()
    from oxygen_ros.model.attention import CachedAttention, PagedKV

    gen = torch.Generator().manual_seed(1)
    kv = PagedKV(2, 16, 4, 1, 16, torch.float32, DEVICE)
    rows = [CachedRow(6, Segment((3, 7), 6), None, 4)]
    attn_t = CachedAttention(kv, rows, "triton", DEVICE)
    q, k, v = randn(6, 2, 16, dtype=F32, gen=gen), randn(6, 1, 16, dtype=F32, gen=gen), randn(6, 1, 16, dtype=F32, gen=gen)
    out = attn_t.layer(1)(*to_dev(q, k, v)).cpu()
    k_ref, v_ref = torch.zeros(16, 4, 1, 16), torch.zeros(16, 4, 1, 16)
    ref = ops.torch_cached_attention(q, k, v, k_ref, v_ref, ops.CachedMeta.build(rows, 4, "cpu"))
    torch.testing.assert_close(out, ref, **ATTN_TOL[F32])
    same_pool(kv.k[1].cpu(), k_ref)
    assert not kv.k[0].any()


def test_cached_attention_rejects_prefix_written_by_same_batch():
    ta, _ = kernels()
    if DEVICE != "cpu":
        pytest.skip("the precondition is only checked on the CPU")
    seg = Segment((0, 1), 8)
    rows = [CachedRow(8, seg, None, 8), CachedRow(1, Segment((2,), 1), seg, 0)]
    meta = ops.CachedMeta.build(rows, 4, "cpu", with_tensors=True)
    z = torch.zeros(9, 1, 16)
    with pytest.raises(ValueError, match="same batch"):
        ta.cached_attention(z, z, z, torch.zeros(4, 4, 1, 16), torch.zeros(4, 4, 1, 16), meta)
    with pytest.raises(ValueError, match="with_tensors"):
        ta.cached_attention(z, z, z, torch.zeros(4, 4, 1, 16), torch.zeros(4, 4, 1, 16),
                            ops.CachedMeta.build(rows[:1], 4, "cpu"))


# ---------------------------------------------------------------------------------------------- action
# id: heads, kv_heads, head_dim, block_size, dtype, horizon, prefix lengths (equal names share a segment),
#     splits
ACTION_CASES = {
    "one_row_h10": (8, 1, 16, 16, F32, 10, [("A", 37)], None),
    "three_rows_bf16": (4, 2, 64, 4, BF16, 3, [("A", 13), ("B", 1), ("C", 40)], None),
    "three_rows_bf16_splits": (4, 2, 64, 4, BF16, 3, [("A", 13), ("B", 1), ("C", 40)], 2),
    "shared_prefix_hd256_f16_splits": (8, 1, 256, 16, F16, 2, [("A", 33), ("A", 33)], 3),
    "g1_h1": (2, 2, 32, 8, F32, 1, [("A", 8), ("B", 9)], None),
}


@pytest.mark.parametrize("name", list(ACTION_CASES))
def test_action_attention_matches_torch(name):
    ta, _ = kernels()
    heads, kvh, hd, bs, dtype, horizon, spec, splits = ACTION_CASES[name]
    gen = torch.Generator().manual_seed(2)
    pool = Pool(64, bs, kvh, hd, dtype, True, gen)
    named = {}
    prefixes = []
    for key, length in spec:
        if key not in named:
            named[key] = pool.segment(length, length)
        prefixes.append(named[key])
    n = len(prefixes) * horizon
    q, k, v = (randn(n, heads, hd, dtype=dtype, gen=gen), randn(n, kvh, hd, dtype=dtype, gen=gen),
               randn(n, kvh, hd, dtype=dtype, gen=gen))
    ref = ops.torch_action_attention(q, k, v, pool.k, pool.v, ops.ActionMeta.build(prefixes, bs, "cpu"))
    meta = ops.ActionMeta.build(prefixes, bs, DEVICE, with_tensors=True)
    q_, k_, v_, kt, vt = to_dev(q, k, v, pool.k.clone(), pool.v.clone())
    out = ta.action_attention(q_, k_, v_, kt, vt, meta, num_splits=splits)
    out2 = ta.action_attention(q_, k_, v_, kt, vt, meta, num_splits=splits)  # the meta serves every step
    out, out2 = out.cpu(), out2.cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **ATTN_TOL[dtype])
    assert torch.equal(out, out2)
    same_pool(kt.cpu(), pool.k)  # action K/V are never stored
    same_pool(vt.cpu(), pool.v)


# ---------------------------------------------------------------------------------------------- norms
NORM_SHAPES = [(1, 48), (7, 256)]


def _norm_inputs(t, width, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    big = randn(t, 2 * width, dtype=dtype, gen=gen) * 3
    x = big[:, :width]                                  # non-contiguous rows: the kernel must cope
    return dict(x=x, branch=randn(t, width, dtype=dtype, gen=gen), gate=randn(t, width, dtype=dtype, gen=gen),
                scale=randn(t, width, dtype=dtype, gen=gen) * 0.3, shift=randn(t, width, dtype=dtype, gen=gen),
                weight=randn(width, dtype=dtype, gen=gen) * 0.1)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_norms_match_torch(shape, dtype):
    _, tn = kernels()
    a = _norm_inputs(*shape, dtype)
    d = {k_: v_.to(DEVICE) for k_, v_ in a.items()}
    eps = 1e-6
    tol = NORM_TOL[dtype]

    def check(got, want):
        got = got.cpu()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **tol)

    check(tn.rms_norm(d["x"], d["weight"], eps), ops.torch_rms_norm(a["x"], a["weight"], eps))
    check(tn.ada_rms_norm(d["x"], d["scale"], d["shift"], eps),
          ops.torch_ada_rms_norm(a["x"], a["scale"], a["shift"], eps))
    xn, y = tn.residual_rms_norm(d["x"], d["branch"], d["weight"], eps)
    xn_ref, y_ref = ops.residual_rms_norm(a["x"], a["branch"], a["weight"], eps, "torch")
    if dtype == BF16 and DEVICE == "cpu":
        # The interpreter rounds float32 -> bfloat16 toward zero (triton 3.9), the GPU to nearest even.
        torch.testing.assert_close(xn.cpu(), xn_ref, **tol)
    else:
        assert torch.equal(xn.cpu(), xn_ref)  # the residual sum is rounded exactly as torch rounds it
    check(y, y_ref)
    xn, y = tn.residual_ada_rms_norm(d["x"], d["branch"], d["gate"], d["scale"], d["shift"], eps)
    xn_ref, y_ref = ops.residual_ada_rms_norm(a["x"], a["branch"], a["gate"], a["scale"], a["shift"], eps, "torch")
    torch.testing.assert_close(xn.cpu(), xn_ref, **tol)  # exact in the interpreter; a GPU FMA may differ by 1 ulp
    check(y, y_ref)
    check(tn.gelu_tanh_mul(d["gate"] * 2, d["branch"]), ops.gelu_tanh_mul(a["gate"] * 2, a["branch"], "torch"))


def test_norm_dispatch_and_large_values():
    """ops.*(backend='triton') reach the kernels; large |x| stays finite (float32 statistics, clamped tanh)."""
    kernels()
    x = (torch.randn(3, 40) * 1e3).to(BF16)
    w = torch.randn(40) * 0.1
    torch.testing.assert_close(ops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6, "triton").cpu(),
                               ops.rms_norm(x, w, 1e-6, "torch"), **NORM_TOL[BF16])
    g = torch.tensor([[-60.0, -9.0, -1.0, 0.0, 1e-4, 3.0, 60.0]])
    u = torch.ones_like(g)
    got = ops.gelu_tanh_mul(g.to(DEVICE), u.to(DEVICE), "triton").cpu()
    torch.testing.assert_close(got, ops.gelu_tanh_mul(g, u, "torch"), **NORM_TOL[F32])
    assert math.isfinite(float(got.sum()))


def test_kernel_modules_are_interpreted_on_cpu():
    ta, tn = kernels()
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(ta._attn_kernel, InterpretedFunction) and isinstance(tn._norm_kernel, InterpretedFunction)



# ---------------------------------------------------------------------------------------------- GPU build
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    """No GPU needed: the launchers' π0.5 configurations (bf16, head_dim 256, 8 heads per kv head: decode,
    split decode, prefill, action) and the norms compile for sm_90 (ptxas from the triton wheel) without
    register spills, and the pool loads are software-pipelined. ~12 s with a cold triton cache, ~3 s warm.
    Runs in a subprocess: this process has TRITON_INTERPRET=1, which makes the kernels interpreted.
    `python -m oxygen_ros.kernels.microbench --compile-only --all-configs` checks ~180 configurations."""
    import json
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = tmp_path / "compile.json"
    proc = subprocess.run([sys.executable, "-m", "oxygen_ros.kernels.microbench", "--compile-only", "--quick",
                           "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {r["kernel"] for r in report} == {"attention", "merge", "norm", "gelu_tanh_mul"}
    for r in report:
        if r.get("dtype") != "fp32":
            assert r["spill_bytes"] == 0, r
        if r["kernel"] == "attention" and r["dtype"] != "fp32":
            assert r["pipelined"], r
