"""Triton kernels of the paged attention: the same maths as `ops.torch_cached_attention` and
`ops.torch_action_attention` (visibility rule: ops.py's module docstring).

One kernel, `_attn_kernel`, serves both operations. A program owns one (tile of new tokens, row, kv head)
and, with split-KV, one slice of that tile's keys:

- the query tile packs BLOCK_T consecutive new tokens x the G query heads that share the kv head
  (GQA packing: row m of the tile is token m // GP, head m % GP, GP = G rounded up to a power of two), so
  every K/V tile read from the pool serves all the heads of its kv head (π0.5: 8 heads on 1 kv head; a
  decode tile is 16 rows, tl.dot's minimum, of which 8 are used);
- keys, in one index space [prefix | older own tokens | new tokens], are visited in BLOCK_N tiles with an
  online (flash) softmax in float32, by two loops: the pool loop (prefix through `prefix_table`, then the
  row's older own tokens through `own_table`; a tile straddling the two takes each key's block id from its
  own table; all visible) and the new-token loop, which reads the row's new K/V straight from the k/v inputs
  (rounded to the pool dtype, as the torch path reads them back from the pool) under the causal/bidir mask
  and stops at the tile's causal bound. Pool keys are gathered one by one through the block table (a 512-byte
  row per key and kv head at π0.5 sizes), so any block size and any (shuffled) block ids work;
- the store of the new K/V into the pool is fused: the split-0 program of each (token tile, kv head) writes
  its BLOCK_T tokens. No program ever reads a pool slot written in the same launch (new tokens are read
  from the inputs), so there is no race and no second launch. Precondition (the engine never breaks it, the
  CPU path checks it): a row's prefix segment is not written by the same batch. The torch path would allow
  that (store all, then attend); the fused kernel does not;
- split-KV (flash-decoding): when there are fewer (tile, row, kv head) programs than SMs, each tile's key
  range [0, ctx) is cut into NUM_SPLITS chunks handled by separate programs, which write a normalised partial
  output and its log2-sum-exp; `_merge_kernel` (grid: token x head) combines them. Decode of one request
  over an 800-token prefix is thus spread over ~7 programs instead of one.

Action attention is the same kernel with ACTION=True: H tokens per row (row r's tokens are r*H..r*H+H-1),
no own pool segment, the H action K/V dense and all visible (bidir = H), nothing stored. One ActionMeta
serves every denoise step.

Numerics: scores and softmax in float32 (exp2 with the log2(e) folded into the scale), P rounded to the K/V
dtype for the P@V product on half types (as flash attention does), float32 accumulation. Padding lanes (query
rows past a row's tokens, heads past G) see no key: their running max starts at -1e30 (finite), so they end
with l = 0 and are written as 0 (or not at all), never NaN.

Interpreter (TRITON_INTERPRET=1, CPU): the interpreter's tl.dot on bfloat16 operands multiplies their raw
uint16 bit patterns (triton 3.9), so on the CPU dots run on float32 copies of the operands (P is still
rounded to bf16 first: the numbers are those of the GPU up to summation order).

Launch plans (tiles, grid, split factor, split workspace) are computed once per meta and call shape and
cached in meta.tensors, so a forward's 18 layers (or a frame's 10 denoise steps) pay the Python once. The
split workspace is shared by the calls of one meta: calls on one stream only (as the model makes them).

Cascade attention (a shared prefix read once for several rows) is not implemented: see `cached_attention`.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .meta import ActionMeta, CachedMeta

_LOG2E = 1.4426950408889634
# Split-KV: at least this many keys per split (below that the merge costs more than the parallelism gains).
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 16


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _softmax_tile(acc, m_i, l_i, q, k, v, visible, qk_scale, DOT_F32: tl.constexpr, P_LOWP: tl.constexpr):
    """Online-softmax update with one tile of keys: q [M, D], k/v [N, D], visible [M, N] (broadcastable).
    DOT_F32: float32 products (q is already float32). P_LOWP: P rounded to the V dtype for P@V."""
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * qk_scale, float("-inf"))        # log2-domain scores, float32
    m_new = tl.maximum(m_i, tl.max(s, 1))                      # >= -1e30: finite
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if P_LOWP:
        p = p.to(v.dtype)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return acc, m_new, l_i


@triton.jit
def _attn_kernel(Q, K, V, Out, KC, VC, Slots, Cu, PTable, PLens, OTable, OLens, Bidir, OPart, LPart,
                 s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh,
                 s_slot, s_pkh, s_ptab, s_otab,
                 s_ps, s_pt, s_ph, s_ls, s_lt,
                 rows_n, qk_scale,
                 BS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 ACTION: tl.constexpr, STORE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 DOT_F32: tl.constexpr, P_LOWP: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.program_id(1)
    kvh = tl.program_id(2)
    qb = pid // NUM_SPLITS
    split = pid % NUM_SPLITS
    if ACTION:
        q0 = r * rows_n
        n_new = rows_n
        own_before = 0
        bidir = rows_n
    else:
        q0 = tl.load(Cu + r)
        n_new = tl.load(Cu + r + 1) - q0
        own_before = tl.load(OLens + r) - n_new
        bidir = tl.load(Bidir + r)
    plen = tl.load(PLens + r)
    t0 = qb * BLOCK_T
    if t0 >= n_new:
        return

    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    kv_off = kvh * s_pkh

    # Fused store of this tile's new K/V (one program per token tile and kv head does it).
    if STORE:
        if split == 0:
            offs_t = t0 + tl.arange(0, BLOCK_T)
            t_ok = offs_t < n_new
            tok_t = (q0 + offs_t).to(tl.int64)
            st_mask = t_ok[:, None] & d_ok[None, :]
            slot_t = tl.load(Slots + tok_t, mask=t_ok, other=0).to(tl.int64)
            dst = slot_t[:, None] * s_slot + kv_off + offs_d[None, :]
            kn = tl.load(K + tok_t[:, None] * s_kt + kvh * s_kh + offs_d[None, :], mask=st_mask, other=0.0)
            vn = tl.load(V + tok_t[:, None] * s_vt + kvh * s_vh + offs_d[None, :], mask=st_mask, other=0.0)
            tl.store(KC + dst, kn.to(KC.dtype.element_ty), mask=st_mask)
            tl.store(VC + dst, vn.to(VC.dtype.element_ty), mask=st_mask)

    # Query tile: BLOCK_T tokens x GP heads of this kv head.
    offs_m = tl.arange(0, BLOCK_M)
    t_loc = t0 + offs_m // GP
    hg = offs_m % GP
    m_ok = (t_loc < n_new) & (hg < G)
    head = kvh * G + hg
    tok_m = (q0 + t_loc).to(tl.int64)
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + tok_m[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # Keys this tile may see, in one index space j: prefix [0, plen) | older own tokens [plen, base) (both in
    # the pool) | new tokens [base, base + new_hi) (from the k/v inputs; new_hi stops at the causal bound).
    base = plen + own_before
    t_hi = tl.minimum(t0 + BLOCK_T, n_new)
    new_hi = tl.minimum(tl.maximum(t_hi, bidir), n_new)
    ctx = base + new_hi
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, ctx)
    else:
        lo = 0
        hi = ctx

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a lane that sees no key keeps p = 0, l = 0
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Pool keys [lo, min(hi, base)): all visible. A tile may straddle prefix and own segment: each key
    # takes its block id from its segment's table (two masked loads, no pointer select).
    pool_hi = tl.minimum(hi, base)
    for start in range(lo, pool_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < pool_hi
        in_pre = offs_n < plen
        if ACTION:
            blk = tl.load(PTable + r * s_ptab + offs_n // BS, mask=n_ok, other=0)
            local = offs_n
        else:
            local = tl.where(in_pre, offs_n, offs_n - plen)    # index within its segment
            blk = (tl.load(PTable + r * s_ptab + local // BS, mask=n_ok & in_pre, other=0)
                   + tl.load(OTable + r * s_otab + local // BS, mask=n_ok & (offs_n >= plen), other=0))
        slot = blk.to(tl.int64) * BS + local % BS
        off = slot[:, None] * s_slot + kv_off + offs_d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(KC + off, mask=kv_mask, other=0.0)
        v = tl.load(VC + off, mask=kv_mask, other=0.0)
        acc, m_i, l_i = _softmax_tile(acc, m_i, l_i, q, k, v, n_ok[None, :], qk_scale, DOT_F32, P_LOWP)
    # New keys [max(lo, base), hi), read from the k/v inputs; key j_new is visible to token t iff
    # j_new <= t or j_new < bidir.
    for start in range(tl.maximum(lo, base), hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        j_new = offs_n - base
        tok_n = (q0 + j_new).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + tok_n[:, None] * s_kt + kvh * s_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + tok_n[:, None] * s_vt + kvh * s_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if not ACTION:
            # What the torch path reads back from the pool.
            k = k.to(KC.dtype.element_ty)
            v = v.to(VC.dtype.element_ty)
        visible = n_ok[None, :] & ((j_new[None, :] <= t_loc[:, None]) | (j_new[None, :] < bidir))
        acc, m_i, l_i = _softmax_tile(acc, m_i, l_i, q, k, v, visible, qk_scale, DOT_F32, P_LOWP)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(Out + tok_m[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :],
                 o.to(Out.dtype.element_ty), mask=q_mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(OPart + split * s_ps + tok_m[:, None] * s_pt + head[:, None] * s_ph + offs_d[None, :], o,
                 mask=q_mask)
        tl.store(LPart + split * s_ls + tok_m * s_lt + head, lse, mask=m_ok)


@triton.jit
def _merge_kernel(OPart, LPart, Out, s_ps, s_pt, s_ph, s_ls, s_lt, s_ot, s_oh,
                  NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Out[t, h] = sum_s w_s o_s / sum_s w_s with w_s = 2 ** lse_s (splits without keys have lse = -inf)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(LPart + offs_s * s_ls + t * s_lt + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.exp2(lse - m)
    den = tl.sum(w, 0)
    den = tl.where(den > 0, den, 1.0)
    o = tl.load(OPart + offs_s[:, None] * s_ps + t * s_pt + h * s_ph + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    res = tl.sum(o * w[:, None], 0) / den
    tl.store(Out + t * s_ot + h * s_oh + offs_d, res.to(Out.dtype.element_ty), mask=d_ok)


# ---------------------------------------------------------------------------------------------- launch
# Tile overrides for tuning (`microbench --sweep` tries some): BLOCK_M_CAP, BLOCK_N, num_warps, num_stages.
# Empty by default. Metas cache their launch plan per override set.
TILE_OVERRIDES: dict = {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check_interpreter():
    from triton.runtime import interpreter

    if not isinstance(_attn_kernel, interpreter.InterpretedFunction):
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                           "oxygen_ros.kernels.triton_attention is first imported")
    _squeeze_interpreted_loop_bounds(interpreter)


def _squeeze_interpreted_loop_bounds(interpreter) -> None:
    """The key loops run to tensor bounds (`range(lo, pool_hi, BLOCK_N)`). The interpreter holds every
    scalar as a shape-(1,) array and, before Triton 3.8, turns a loop bound into a Python int with
    `int(array)`, which numpy >= 2.4 refuses (only 0-d arrays convert): a TypeError under triton 3.6.
    Triton 3.8 squeezes first; give older interpreters the same `__index__`. The compiled kernel is
    untouched, so the interpreter tests still run the very source the GPU compiles."""
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 8):
        return
    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "squeezes_index", False):
        return

    def patch_tensor_squeezed(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_tensor_squeezed.squeezes_index = True
    interpreter._patch_lang_tensor = patch_tensor_squeezed


def _tiles(group: int, head_dim: int, max_new: int, f32: bool) -> dict:
    """Tile sizes (see the module docstring), checked free of register spills by compiling for sm_90
    (ptxas): large head dims get smaller tiles, and float32 storage (its dots run on FMA units, operands in
    registers) smaller ones still."""
    gp = _next_pow2(group)
    d_pad = max(16, _next_pow2(head_dim))
    if f32:
        m_cap, block_n = {16: (128, 64), 32: (64, 64), 64: (32, 64)}.get(d_pad, (32, 16))
        stages = 1 if d_pad > 64 else 2
    else:
        m_cap, block_n = (64, 32) if d_pad > 128 else (128, 64)
        stages = 2 if d_pad > 128 else 3
    m_cap = max(TILE_OVERRIDES.get("BLOCK_M_CAP", m_cap), gp)
    block_m = min(max(16, _next_pow2(max_new * gp)), m_cap)
    warps = 4 if block_m * d_pad <= (1024 if f32 else 8192) else 8
    cfg = dict(GP=gp, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_T=max(1, block_m // gp), BLOCK_N=block_n,
               num_warps=warps, num_stages=stages)
    cfg.update((k, v) for k, v in TILE_OVERRIDES.items() if k in ("BLOCK_N", "num_warps", "num_stages"))
    return cfg


def _num_splits(device: torch.device, programs: int, max_ctx: int) -> int:
    """Split-KV factor: enough programs for ~2 waves of the SMs, >= MIN_KEYS_PER_SPLIT keys per split."""
    env = os.environ.get("OXYGEN_TRITON_SPLITS", "").strip()
    if env:
        return max(1, int(env))
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), max_ctx // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def _dot_modes(q, k, cache, interpret: bool) -> tuple[bool, bool]:
    """(DOT_F32, P_LOWP): float32 dots for float32 or mixed dtypes (exact, like the torch path) and in the
    interpreter for bf16 (its bf16 dot is broken); P rounded to the K/V dtype when everything is half."""
    half = q.dtype == k.dtype == cache.dtype and cache.dtype in (torch.float16, torch.bfloat16)
    return (not half) or (interpret and cache.dtype == torch.bfloat16), half


def _plan(store: dict, q, k_dtype, cache_dtype, kvh: int, n_new: list[int], max_ctx: int,
          num_splits: int | None) -> dict:
    """Tiles, grid and split factor of one call shape, cached in the meta's tensors dict (a meta serves every
    layer of a forward, an ActionMeta every denoise step: this runs once, not per layer)."""
    f32 = not (q.dtype == k_dtype == cache_dtype and cache_dtype in (torch.float16, torch.bfloat16))
    key = ("_triton_plan", q.shape[0], q.shape[1], q.shape[2], kvh, f32, num_splits, tuple(TILE_OVERRIDES.items()))
    plan = store.get(key)
    if plan is None:
        cfg = _tiles(q.shape[1] // kvh, q.shape[2], max(n_new), f32)
        programs = sum(-(-n // cfg["BLOCK_T"]) for n in n_new) * kvh
        splits = max(1, int(num_splits)) if num_splits is not None else _num_splits(q.device, programs, max_ctx)
        plan = dict(cfg=cfg, splits=splits, n_qb=-(-max(n_new) // cfg["BLOCK_T"]), ws=None)
        if splits > 1:
            plan["ws"] = (torch.empty(splits, *q.shape, dtype=torch.float32, device=q.device),
                          torch.empty(splits, q.shape[0], q.shape[1], dtype=torch.float32, device=q.device))
        store[key] = plan
    return plan


def _launch(q, k, v, k_cache, v_cache, plan: dict, *, rows: int, slots, cu, ptable, plens, otable, olens,
            bidir, action: bool):
    n_tok, heads, hd = q.shape
    nb, bs, kvh, hd_c = k_cache.shape
    if hd_c != hd or k.shape[1:] != (kvh, hd) or v.shape != k.shape or heads % kvh:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cache {tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache/v_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    interpret = q.device.type == "cpu"
    if interpret:
        _check_interpreter()
    cfg, splits = plan["cfg"], plan["splits"]
    dot_f32, p_lowp = _dot_modes(q, k, k_cache, interpret)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if splits > 1:
        o_part, l_part = plan["ws"]
        p_strides, l_strides = o_part.stride()[:3], l_part.stride()[:2]
    else:
        o_part = l_part = out  # unused
        p_strides, l_strides = (0, 0, 0), (0, 0)
    _attn_kernel[(plan["n_qb"] * splits, rows, kvh)](
        q, k, v, out, k_cache, v_cache, slots, cu, ptable, plens, otable, olens, bidir, o_part, l_part,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(2), ptable.stride(0), otable.stride(0),
        *p_strides, *l_strides,
        n_tok // rows if action else 0, hd ** -0.5 * _LOG2E,
        BS=bs, G=heads // kvh, GP=cfg["GP"], BLOCK_T=cfg["BLOCK_T"], BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=hd, D_PAD=cfg["D_PAD"], ACTION=action, STORE=not action,
        NUM_SPLITS=splits, DOT_F32=dot_f32, P_LOWP=p_lowp, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    if splits > 1:
        _merge_kernel[(n_tok, heads)](
            o_part, l_part, out, *p_strides, *l_strides, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, S_PAD=max(2, _next_pow2(splits)), HEAD_DIM=hd, D_PAD=cfg["D_PAD"],
            num_warps=4)
    return out


def _check_no_cross_row_reads(meta: CachedMeta):
    """The fused store's precondition (checked on the CPU only: on CUDA it would synchronise)."""
    if meta.write_slots.device.type != "cpu" or not meta.prefix_index:
        return
    for idx in meta.prefix_index.values():
        read = torch.arange(idx.start, idx.stop) if isinstance(idx, slice) else idx.cpu()
        if torch.isin(read, meta.write_slots).any():
            raise ValueError("a row's prefix segment is written by the same batch: the fused Triton kernel "
                             "reads prefixes before they are stored (use the torch backend or split the batch)")


def cached_attention(q, k, v, k_cache, v_cache, meta: CachedMeta, *, num_splits: int | None = None) -> torch.Tensor:
    """Store k/v at meta.write_slots and attend (ops.torch_cached_attention's semantics), fused.

    q [T, heads, hd], k/v [T, kv_heads, hd], k_cache/v_cache [num_blocks, block_size, kv_heads, hd] (one
    layer, modified in place). num_splits forces the split-KV factor (default: OXYGEN_TRITON_SPLITS, else a
    heuristic on CUDA, 1 on the CPU). Cascade attention (a shared prefix read once for several rows) is not
    implemented: with GQA packing every prefix tile already serves all query heads of a row; the rows of
    one frame re-read an 800-token π0.5 prefix (0.8 MB per layer in bf16) from L2; and under continuous
    batching the rows rarely share a frame at all — at the paper's workload (one request per frame, replies
    spanning ~6 frames) every active request is attached to a different frame, so there is no group to
    read once. Only a burst of questions about one frame would form one; measure before adding it."""
    t = meta.tensors
    if not t:
        raise ValueError("CachedMeta was built without with_tensors=True (the Triton view)")
    _check_no_cross_row_reads(meta)
    rows = len(meta.n_new)
    plan = _plan(t, q, k.dtype, k_cache.dtype, k_cache.shape[2], meta.n_new, meta.max_ctx, num_splits)
    return _launch(q, k, v, k_cache, v_cache, plan, rows=rows, slots=meta.write_slots, cu=t["cu_q"],
                   ptable=t["prefix_table"], plens=t["prefix_lens"], otable=t["own_table"], olens=t["own_lens"],
                   bidir=t["bidir"], action=False)


def action_attention(q, k, v, k_cache, v_cache, meta: ActionMeta, *, num_splits: int | None = None) -> torch.Tensor:
    """ops.torch_action_attention's semantics: q [R*H, heads, hd], k/v [R*H, kv_heads, hd] (not stored);
    each row's H queries see the row's prefix (meta.tensors prefix_table/prefix_lens) and all H action keys."""
    t = meta.tensors
    if not t:
        raise ValueError("ActionMeta was built without with_tensors=True (the Triton view)")
    rows = len(meta.prefix_index)
    if rows == 0 or q.shape[0] % rows:
        raise ValueError(f"{q.shape[0]} action tokens do not split into {rows} rows")
    h = q.shape[0] // rows
    max_ctx = meta.max_prefix
    plan = _plan(t, q, k.dtype, k_cache.dtype, k_cache.shape[2], [h] * rows, max_ctx + h, num_splits)
    plens = t["prefix_lens"]
    return _launch(q, k, v, k_cache, v_cache, plan, rows=rows, slots=plens, cu=plens, ptable=t["prefix_table"],
                   plens=plens, otable=t["prefix_table"], olens=plens, bidir=plens, action=True)
