"""Microbenchmark of the Triton kernels against torch at π0.5 full size (CUDA only).

    python -m oxygen_ros.kernels.microbench --json OUT.json [--quick] [--sweep]

Shapes (bf16, head_dim 256, 8 query heads on 1 kv head, pool block size 16, shuffled block ids):
- prefill: one row of 800 new tokens (768 image tokens bidirectional + 32 causal language tokens, the
  OxyGen prefix) and the same row fully bidirectional (upstream openpi);
- decode: batch 1/4/16/32, one new token per row over a shared 800-token prefix + 0..64 own tokens;
- action: H = 10 action queries per row over an 800-token prefix, 1 and 4 rows (frames);
- norms and the gated activation at width 2048 (VLM) / 1024 (expert) with T = 800 and 10
  (gelu_tanh_mul at the MLP widths 16384 / 4096).

Each Triton kernel is compared with
- `torch`: the package's torch backend on the same paged pool (ops.torch_*: what runs without Triton);
- `sdpa`: F.scaled_dot_product_attention on K/V already gathered into dense tensors (gather not timed,
  masks for the causal parts): an ideal dense baseline the paged kernel should approach.
Times are medians of CUDA-event-timed calls (`eager_us`, launch overhead included) and, where the call can be
captured, CUDA-graph replays (`graph_us`, GPU time only). Ratios are baseline / Triton (> 1: Triton faster).
Decode is also timed with split-KV forced off (splits=1) to show what the split buys. Cascade attention is not
implemented (see triton_attention.cached_attention), so there is nothing to compare it with.
Every case also reports max |Triton - torch| and max |Triton - sdpa| as sanity checks (the sdpa baseline
gathers the pool with explicit slot indices, independent of ops.py's slot bookkeeping). Runs in well under a minute on an H200.

    python -m oxygen_ros.kernels.microbench --compile-only [--all-configs] [--json OUT.json]

needs no GPU: it compiles every kernel configuration for sm_90 (ptxas from the triton wheel) and reports
registers, spilled bytes, shared memory and whether the KV loads are pipelined (the test suite runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

WIDTH_VLM, WIDTH_EXPERT, MLP_VLM, MLP_EXPERT = 2048, 1024, 16384, 4096
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 1, 256, 16
PREFIX, IMAGE_TOKENS = 800, 768
DTYPE = torch.bfloat16
DEVICE = "cuda"


def _smoke_sizes():
    """--cpu-smoke: tiny shapes on the CPU through the Triton interpreter, to check this script's code paths
    where there is no GPU (the timings are meaningless)."""
    global WIDTH_VLM, WIDTH_EXPERT, MLP_VLM, MLP_EXPERT, HEADS, HEAD_DIM, PREFIX, IMAGE_TOKENS, DEVICE
    WIDTH_VLM, WIDTH_EXPERT, MLP_VLM, MLP_EXPERT = 64, 32, 128, 64
    HEADS, HEAD_DIM, PREFIX, IMAGE_TOKENS, DEVICE = 4, 32, 40, 32, "cpu"
    os.environ["TRITON_INTERPRET"] = "1"  # before oxygen_ros.kernels.triton_* are imported (lazily, below)


def _time_eager(fn, reps: int) -> float:
    """Median µs of single calls, each between two CUDA events (launch overhead included)."""
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _time_graph(fn, reps: int, inner: int = 20) -> float | None:
    """µs per call from CUDA-graph replays of `inner` calls (GPU time), or None if fn cannot be captured."""
    if DEVICE == "cpu":
        return None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / inner)
        return statistics.median(times)
    except Exception:  # noqa: BLE001 - any capture failure just means "no graph number"
        torch.cuda.synchronize()
        return None


def bench(fn, reps: int, warmup: int = 5) -> dict:
    for _ in range(warmup if DEVICE == "cuda" else 0):
        fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return dict(eager_us=_time_eager(fn, reps), graph_us=_time_graph(fn, max(5, reps // 4)))


class Pool:
    """A one-layer bf16 pool, blocks handed out from a shuffled permutation (like a long-running engine)."""

    def __init__(self, tokens: int, gen: torch.Generator):
        n = tokens // BLOCK_SIZE + 64
        self.order = torch.randperm(n, generator=gen).tolist()
        self.next = 0
        self.k = (torch.randn(n, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)).to(DTYPE).to(DEVICE)
        self.v = (torch.randn(n, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)).to(DTYPE).to(DEVICE)

    def segment(self, length: int):
        from oxygen_ros.kernels.meta import Segment

        n = max(1, -(-length // BLOCK_SIZE))
        blocks = tuple(self.order[self.next:self.next + n])
        self.next += n
        return Segment(blocks, length)

    def dense(self, seg):
        """[length, kv_heads, hd] K and V of a segment, gathered."""
        idx = torch.tensor([seg.blocks[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(seg.length)],
                           device=DEVICE)
        return self.k.view(-1, KV_HEADS, HEAD_DIM)[idx], self.v.view(-1, KV_HEADS, HEAD_DIM)[idx]


def _sdpa(q, k, v, mask=None):
    """q [B, Lq, heads, hd], k/v [B, Lk, kvh, hd] -> [B, Lq, heads, hd] (GQA)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, enable_gqa=True).transpose(1, 2)


# Tile configurations `--sweep` tries on the main attention shapes (see triton_attention.TILE_OVERRIDES).
SWEEP = [dict(BLOCK_N=32, num_warps=4), dict(BLOCK_N=64, num_warps=4), dict(BLOCK_N=32, num_warps=8),
         dict(BLOCK_N=64, num_warps=8), dict(BLOCK_N=64, num_warps=8, num_stages=3),
         dict(BLOCK_M_CAP=128, BLOCK_N=32, num_warps=8)]


def _sweep(fn, reps: int) -> list:
    from oxygen_ros.kernels import triton_attention as ta

    out = []
    for overrides in SWEEP:
        ta.TILE_OVERRIDES.clear()
        ta.TILE_OVERRIDES.update(overrides)
        try:
            out.append(dict(overrides=dict(overrides), **bench(fn, reps)))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report and go on
            out.append(dict(overrides=dict(overrides), error=repr(e)[:300]))
        finally:
            ta.TILE_OVERRIDES.clear()
    return out


def _record(results, name, shape, tri, baselines, err, sweep=None):
    """err: {baseline: max |Triton - baseline|} (outputs)."""
    rec = dict(name=name, shape=shape, triton=tri, **{f"max_abs_err_vs_{k}": v for k, v in err.items()})
    if sweep is not None:
        rec["sweep"] = sweep
    for key, val in baselines.items():
        rec[key] = val
        for mode in ("eager_us", "graph_us"):
            if val.get(mode) and tri.get(mode):
                rec[f"{key}_over_triton_{mode[:-3]}"] = val[mode] / tri[mode]
    results.append(rec)
    parts = [f"{name:38s} triton {tri['eager_us']:8.1f} us"
             + (f" (graph {tri['graph_us']:7.1f})" if tri.get("graph_us") else "")]
    for key, val in baselines.items():
        g = rec.get(f"{key}_over_triton_graph")
        parts.append(f"{key} x{rec.get(f'{key}_over_triton_eager', float('nan')):5.2f}"
                     + (f" (graph x{g:5.2f})" if g else ""))
    print(" | ".join(parts) + " | max err " + ", ".join(f"{k} {v:.1e}" for k, v in err.items()), flush=True)
    for r in sweep or []:
        print(f"    sweep {r['overrides']}: " + (f"{r['eager_us']:.1f} us (graph {r['graph_us']})"
                                                 if "error" not in r else r["error"]), flush=True)


def _errs(out, **refs) -> dict:
    return {k: float((out.float() - r.float()).abs().max()) for k, r in refs.items()}


def bench_attention(results, reps, quick, sweep=False):
    from oxygen_ros.kernels import ops, triton_attention as ta
    from oxygen_ros.kernels.meta import CachedRow

    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(DTYPE).to(DEVICE)

    # Prefill: one 800-token row, OxyGen (images bidirectional, language causal) and fully bidirectional.
    for label, bidir in (("prefill800_oxygen", IMAGE_TOKENS), ("prefill800_bidir", PREFIX)):
        pool = Pool(PREFIX + 64, gen)
        own = pool.segment(PREFIX)
        rows = [CachedRow(PREFIX, own, None, bidir)]
        meta_t = ops.CachedMeta.build(rows, BLOCK_SIZE, DEVICE, with_tensors=True)
        meta_r = ops.CachedMeta.build(rows, BLOCK_SIZE, DEVICE)
        q, k, v = rnd(PREFIX, HEADS, HEAD_DIM), rnd(PREFIX, KV_HEADS, HEAD_DIM), rnd(PREFIX, KV_HEADS, HEAD_DIM)
        out_t = ta.cached_attention(q, k, v, pool.k, pool.v, meta_t)
        out_r = ops.torch_cached_attention(q, k, v, pool.k, pool.v, meta_r)
        i = torch.arange(PREFIX, device=DEVICE)
        mask = None if bidir >= PREFIX else (i[None, :] < torch.clamp(i[:, None] + 1, min=bidir))
        out_d = _sdpa(q[None], k[None], v[None], mask)[0]
        _record(results, label, dict(tokens=PREFIX, bidir=bidir),
                bench(lambda: ta.cached_attention(q, k, v, pool.k, pool.v, meta_t), reps),
                dict(torch=bench(lambda: ops.torch_cached_attention(q, k, v, pool.k, pool.v, meta_r), reps),
                     sdpa=bench(lambda: _sdpa(q[None], k[None], v[None], mask), reps)),
                _errs(out_t, torch=out_r, sdpa=out_d),
                _sweep(lambda: ta.cached_attention(q, k, v, pool.k, pool.v, meta_t), reps)
                if sweep and bidir < PREFIX else None)

    # Decode: batch B over a shared 800-token prefix + 0..64 own tokens per row (the new token included).
    for batch in ((1, 32) if quick else (1, 4, 16, 32)):
        pool = Pool(PREFIX + batch * 80, gen)
        prefix = pool.segment(PREFIX)
        owns = [int(x) for x in torch.randint(1, 65, (batch,), generator=gen)]
        rows = [CachedRow(1, pool.segment(n), prefix, 0) for n in owns]
        meta_t = ops.CachedMeta.build(rows, BLOCK_SIZE, DEVICE, with_tensors=True)
        meta_r = ops.CachedMeta.build(rows, BLOCK_SIZE, DEVICE)
        q, k, v = rnd(batch, HEADS, HEAD_DIM), rnd(batch, KV_HEADS, HEAD_DIM), rnd(batch, KV_HEADS, HEAD_DIM)
        out_t = ta.cached_attention(q, k, v, pool.k, pool.v, meta_t)
        out_r = ops.torch_cached_attention(q, k, v, pool.k, pool.v, meta_r)
        # Dense baseline: prefix + own K/V gathered and right-padded to the longest row, key padding mask.
        pk, pv = pool.dense(prefix)
        dense = [pool.dense(r.own) for r in rows]
        longest = PREFIX + max(owns)
        kd = torch.zeros(batch, longest, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        vd = torch.zeros_like(kd)
        mask = torch.zeros(batch, 1, 1, longest, dtype=torch.bool, device=DEVICE)
        for b, (ok, ov) in enumerate(dense):
            kd[b, :PREFIX], vd[b, :PREFIX] = pk, pv
            kd[b, PREFIX:PREFIX + owns[b]], vd[b, PREFIX:PREFIX + owns[b]] = ok, ov
            mask[b, ..., :PREFIX + owns[b]] = True
        out_d = _sdpa(q[:, None], kd, vd, mask)[:, 0]
        meta_1 = ops.CachedMeta.build(rows, BLOCK_SIZE, DEVICE, with_tensors=True)
        _record(results, f"decode_b{batch}", dict(batch=batch, prefix=PREFIX, own=owns,
                                                   splits=ta._plan(meta_t.tensors, q, k.dtype, pool.k.dtype, KV_HEADS,
                                                                   meta_t.n_new, PREFIX + 64, None)["splits"]),
                bench(lambda: ta.cached_attention(q, k, v, pool.k, pool.v, meta_t), reps),
                dict(torch=bench(lambda: ops.torch_cached_attention(q, k, v, pool.k, pool.v, meta_r), reps),
                     sdpa=bench(lambda: _sdpa(q[:, None], kd, vd, mask), reps),
                     triton_splits1=bench(lambda: ta.cached_attention(q, k, v, pool.k, pool.v, meta_1,
                                                                      num_splits=1), reps)),
                _errs(out_t, torch=out_r, sdpa=out_d),
                _sweep(lambda: ta.cached_attention(q, k, v, pool.k, pool.v, meta_t), reps)
                if sweep and batch in (1, 32) else None)

    # Action attention: H = 10 queries per row over an 800-token prefix + the 10 dense action K/V.
    horizon = 10
    for frames in (1, 4):
        pool = Pool(frames * (PREFIX + 16), gen)
        prefixes = [pool.segment(PREFIX) for _ in range(frames)]
        meta_t = ops.ActionMeta.build(prefixes, BLOCK_SIZE, DEVICE, with_tensors=True)
        meta_r = ops.ActionMeta.build(prefixes, BLOCK_SIZE, DEVICE)
        n = frames * horizon
        q, k, v = rnd(n, HEADS, HEAD_DIM), rnd(n, KV_HEADS, HEAD_DIM), rnd(n, KV_HEADS, HEAD_DIM)
        out_t = ta.action_attention(q, k, v, pool.k, pool.v, meta_t)
        out_r = ops.torch_action_attention(q, k, v, pool.k, pool.v, meta_r)
        dense = [pool.dense(p) for p in prefixes]
        kd = torch.stack([torch.cat([d[0], k[f * horizon:(f + 1) * horizon]]) for f, d in enumerate(dense)])
        vd = torch.stack([torch.cat([d[1], v[f * horizon:(f + 1) * horizon]]) for f, d in enumerate(dense)])
        qd = q.view(frames, horizon, HEADS, HEAD_DIM)
        out_d = _sdpa(qd, kd, vd).reshape(n, HEADS, HEAD_DIM)
        _record(results, f"action_h{horizon}_rows{frames}", dict(rows=frames, horizon=horizon, prefix=PREFIX),
                bench(lambda: ta.action_attention(q, k, v, pool.k, pool.v, meta_t), reps),
                dict(torch=bench(lambda: ops.torch_action_attention(q, k, v, pool.k, pool.v, meta_r), reps),
                     sdpa=bench(lambda: _sdpa(qd, kd, vd), reps)),
                _errs(out_t, torch=out_r, sdpa=out_d),
                _sweep(lambda: ta.action_attention(q, k, v, pool.k, pool.v, meta_t), reps)
                if sweep and frames == 1 else None)


def bench_norms(results, reps, quick):
    from oxygen_ros.kernels import ops, triton_norms as tn

    gen = torch.Generator().manual_seed(1)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(DTYPE).to(DEVICE)

    for width, mlp in ((WIDTH_VLM, MLP_VLM), (WIDTH_EXPERT, MLP_EXPERT)):
        for t in ((800,) if quick else (800, 10)):
            x, b, g, sc, sh = rnd(t, width), rnd(t, width), rnd(t, width), rnd(t, width, s=0.3), rnd(t, width)
            w = rnd(width, s=0.1)
            gate, up = rnd(t, mlp), rnd(t, mlp)
            eps = 1e-6
            cases = [
                ("rms_norm", lambda: tn.rms_norm(x, w, eps), lambda: ops.torch_rms_norm(x, w, eps)),
                ("ada_rms_norm", lambda: tn.ada_rms_norm(x, sc, sh, eps),
                 lambda: ops.torch_ada_rms_norm(x, sc, sh, eps)),
                ("residual_rms_norm", lambda: tn.residual_rms_norm(x, b, w, eps),
                 lambda: ops.residual_rms_norm(x, b, w, eps, "torch")),
                ("residual_ada_rms_norm", lambda: tn.residual_ada_rms_norm(x, b, g, sc, sh, eps),
                 lambda: ops.residual_ada_rms_norm(x, b, g, sc, sh, eps, "torch")),
                ("gelu_tanh_mul", lambda: tn.gelu_tanh_mul(gate, up), lambda: ops.gelu_tanh_mul(gate, up, "torch")),
            ]
            for name, fn_t, fn_r in cases:
                got, ref = fn_t(), fn_r()
                got = got if isinstance(got, tuple) else (got,)
                ref = ref if isinstance(ref, tuple) else (ref,)
                err = dict(torch=max(float((a.float() - r.float()).abs().max()) for a, r in zip(got, ref)))
                shape = dict(tokens=t, width=mlp if name == "gelu_tanh_mul" else width)
                _record(results, f"{name}_w{shape['width']}_t{t}", shape, bench(fn_t, reps),
                        dict(torch=bench(fn_r, reps)), err)


# ---------------------------------------------------------------------------------------------- compile only
# int arguments that are multiples of 16 at real sizes (the JIT specialises on that at run time; strides of
# [T, heads, hd] q/out, [T, kv_heads, hd] k/v, pool slots, norm rows).
_DIV16 = {"s_qt", "s_qh", "s_kt", "s_kh", "s_vt", "s_vh", "s_ot", "s_oh", "s_slot", "s_pkh", "s_ps", "s_pt", "s_ph",
          "s_x", "s_sc", "s_sh", "s_b", "s_g", "s_xn", "s_y", "width"}
_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _compile(fn, types: dict, consts: dict, num_warps: int, num_stages: int, arch: int) -> dict:
    import inspect
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params
             if p not in consts and (sig[p].startswith("*") or p in _DIV16)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", usage)
    return dict(regs=int(m.group(1)), spill_bytes=int(m.group(2)) + int(m.group(3)),
                shared=kernel.metadata.shared, pipelined="async_copy" in kernel.asm["ttgir"])


def compile_report(full: bool = False, arch: int = 90, quick: bool = False) -> list[dict]:
    """Compile the kernels, in the configurations the launchers pick, for sm_<arch> with the ptxas shipped in
    the triton wheel: no GPU needed (run without TRITON_INTERPRET). Reports registers, spilled bytes, shared
    memory and whether the KV loads are software-pipelined, per configuration."""
    import triton
    import triton.language as tl

    from . import triton_attention as ta, triton_norms as tn

    out = []
    attn = [  # (dtype, head_dim, group, max_new, action, splits)
        ("bf16", 256, 8, 1, False, 1), ("bf16", 256, 8, 1, False, 7), ("bf16", 256, 8, 800, False, 1),
        ("bf16", 256, 8, 10, True, 7), ("fp16", 128, 1, 800, False, 1), ("fp32", 16, 8, 1, False, 1),
        ("fp32", 16, 8, 500, False, 1), ("fp32", 256, 8, 800, False, 1), ("bf16", 80, 3, 5, False, 2)]
    if quick:  # the π0.5 bf16 configurations only (~2 s of compilation each)
        attn = attn[:4]
    if full:
        attn = [(d, hd, g, n, a, s) for d in ("bf16", "fp16", "fp32") for hd in (16, 32, 64, 80, 128, 256)
                for g, n in ((1, 1), (8, 1), (8, 10), (1, 800), (8, 800)) for a, s in ((False, 1), (True, 4))]
    for dtype, hd, group, max_new, action, splits in attn:
        half = dtype != "fp32"
        cfg = ta._tiles(group, hd, max_new, not half)
        p = _PTR[dtype]
        types = dict(Q=p, K=p, V=p, Out=p, KC=p, VC=p, Slots="*i64", Cu="*i32", PTable="*i32", PLens="*i32",
                     OTable="*i32", OLens="*i32", Bidir="*i32", OPart="*fp32", LPart="*fp32", qk_scale="fp32")
        consts = dict(BS=16, G=group, GP=cfg["GP"], BLOCK_T=cfg["BLOCK_T"], BLOCK_M=cfg["BLOCK_M"],
                      BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=hd, D_PAD=cfg["D_PAD"], ACTION=action, STORE=not action,
                      NUM_SPLITS=splits, DOT_F32=not half, P_LOWP=half)
        rec = dict(kernel="attention", dtype=dtype, head_dim=hd, group=group, max_new=max_new, action=action,
                   splits=splits, tiles={k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")})
        rec.update(_compile(ta._attn_kernel, types, consts, cfg["num_warps"], cfg["num_stages"], arch))
        out.append(rec)
    rec = dict(kernel="merge", splits=7, head_dim=256)
    rec.update(_compile(ta._merge_kernel, dict(OPart="*fp32", LPart="*fp32", Out="*bf16"),
                        dict(NUM_SPLITS=7, S_PAD=8, HEAD_DIM=256, D_PAD=256), 4, 1, arch))
    out.append(rec)
    for width, rows, ada, res, gated in ((2048, 1, False, False, False), (2048, 1, False, True, False),
                                         (1024, 1, True, False, False), (1024, 1, True, True, True),
                                         (64, 16, True, True, True)):
        types = {n: "*bf16" for n in ("X", "W", "Scale", "Shift", "Branch", "Gate", "XNew", "Y")}
        types["eps"] = "fp32"
        block = triton.next_power_of_2(width)
        rec = dict(kernel="norm", width=width, rows=rows, ada=ada, residual=res, gated=gated)
        rec.update(_compile(tn._norm_kernel, types, dict(ADA=ada, RESIDUAL=res, GATED=gated, PROD_DTYPE=tl.bfloat16,
                                                          ROWS=rows, BLOCK=block),
                            4 if rows * block <= 1024 else 8, 1, arch))
        out.append(rec)
    rec = dict(kernel="gelu_tanh_mul")
    rec.update(_compile(tn._gelu_mul_kernel, dict(G="*bf16", U="*bf16", Out="*bf16"), dict(BLOCK=1024), 4, 1, arch))
    out.append(rec)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per measurement")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (with --compile-only: π0.5 bf16 only)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time a few tile configurations (TILE_OVERRIDES) on prefill, decode b1/b32, action")
    parser.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile-only", action="store_true",
                        help="no GPU needed: compile the kernels for sm_90 and report registers / spills")
    parser.add_argument("--all-configs", action="store_true", help="with --compile-only: a wide config matrix")
    args = parser.parse_args(argv)
    if args.compile_only:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            print("microbench --compile-only: unset TRITON_INTERPRET (it makes the kernels interpreted)",
                  file=sys.stderr)
            return 2
        report = compile_report(args.all_configs, quick=args.quick)
        for rec in report:
            print(json.dumps(rec))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return 0
    if args.cpu_smoke:
        _smoke_sizes()
    elif not torch.cuda.is_available():
        print("microbench: CUDA is not available; the Triton kernels are only benchmarked on a GPU "
              "(on the CPU they run through the interpreter, for tests only)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.time()
    results: list = []
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter smoke run)"
    print(f"device: {name}; bf16, head_dim {HEAD_DIM}, {HEADS} heads / {KV_HEADS} kv head, "
          f"block size {BLOCK_SIZE}. Ratios: baseline time / Triton time (> 1: Triton faster).", flush=True)
    with torch.inference_mode():
        bench_attention(results, args.reps, args.quick, args.sweep)
        bench_norms(results, args.reps, args.quick)
    info = dict(device=name, torch=torch.__version__,
                triton=__import__("triton").__version__, dtype=str(DTYPE), seconds=time.time() - start,
                results=results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
        print(f"wrote {len(results)} results to {args.json}")
    print(f"done in {info['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
