"""Triton kernels of Gemma's norms and gated activation: ops.py's torch versions, fused.

Norms: ROWS token rows per program (grid [T / ROWS]), each row whole in one BLOCK = next_pow2(width) tile
(width <= 2048 for π0.5: 2048 floats live in registers; ROWS = 1 there, more for narrow rows and in the
interpreter, which pays per program), statistics in float32. Outputs in x's dtype; the residual
sums are rounded to their torch dtype before the norm reads them, exactly like the unfused torch code
(x + branch is materialised in x's dtype, branch * gate first in its own dtype).

gelu_tanh_mul: elementwise over the flattened tensors, BLOCK elements per program; the gelu result is
rounded to the input dtype before the product (torch computes F.gelu(gate) as a tensor first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _norm_kernel(X, W, Scale, Shift, Branch, Gate, XNew, Y,
                 s_x, s_sc, s_sh, s_b, s_g, s_xn, s_y, n_rows, width, eps,
                 ADA: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr, PROD_DTYPE: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """y = norm(x) for ROWS rows (RESIDUAL: x_new = x + branch [* gate] first, stored, and normalised)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    col_ok = offs < width
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    r2 = rows[:, None]
    c2 = offs[None, :]
    x = tl.load(X + r2 * s_x + c2, mask=mask, other=0.0)
    if RESIDUAL:
        b = tl.load(Branch + r2 * s_b + c2, mask=mask, other=0.0)
        if GATED:
            g = tl.load(Gate + r2 * s_g + c2, mask=mask, other=0.0)
            b = (b.to(tl.float32) * g.to(tl.float32)).to(PROD_DTYPE)
        x = (x.to(tl.float32) + b.to(tl.float32)).to(XNew.dtype.element_ty)
        tl.store(XNew + r2 * s_xn + c2, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.where(mask, xf * xf, 0.0), 1) / width + eps)
    if ADA:
        sc = tl.load(Scale + r2 * s_sc + c2, mask=mask, other=0.0).to(tl.float32)
        sh = tl.load(Shift + r2 * s_sh + c2, mask=mask, other=0.0).to(tl.float32)
        y = xf * rstd[:, None] * (1.0 + sc) + sh
    else:
        w = tl.load(W + offs, mask=col_ok, other=0.0).to(tl.float32)
        y = xf * rstd[:, None] * (1.0 + w[None, :])
    tl.store(Y + r2 * s_y + c2, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_mul_kernel(G, U, Out, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0)
    u = tl.load(U + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    inner = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)
    inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)      # tanh(15) == 1 in float32; no exp overflow
    tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
    act = (0.5 * gf * (1.0 + tanh)).to(g.dtype)
    tl.store(Out + offs, (act.to(tl.float32) * u.to(tl.float32)).to(Out.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------- launch
def _check(x: torch.Tensor):
    if x.device.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(_norm_kernel, InterpretedFunction):
            raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                               "oxygen_ros.kernels.triton_norms is first imported")


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """[T, width] with unit stride along width (a view when possible)."""
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def _norm(x, eps, weight=None, scale=None, shift=None, branch=None, gate=None):
    _check(x)
    shape, width = x.shape, x.shape[-1]
    x2 = _rows(x, width)
    n = x2.shape[0]
    ada = scale is not None
    residual = branch is not None
    if residual:
        prod_dtype = torch.promote_types(branch.dtype, gate.dtype) if gate is not None else branch.dtype
        new_dtype = torch.promote_types(x.dtype, prod_dtype)
    else:
        prod_dtype, new_dtype = x.dtype, x.dtype
    x_new = torch.empty((n, width), dtype=new_dtype, device=x.device) if residual else x2
    # torch returns the norm in the dtype of what it normalises (x, or x + branch when fused).
    y = torch.empty((n, width), dtype=new_dtype, device=x.device)
    sc = _rows(scale, width) if ada else x2
    sh = _rows(shift, width) if ada else x2
    b = _rows(branch, width) if residual else x2
    g = _rows(gate, width) if gate is not None else x2
    w = weight.contiguous() if weight is not None else x2
    block = triton.next_power_of_2(width)
    if x.device.type == "cpu":
        # The interpreter pays per program, not per element: a few programs of many rows.
        rows = min(128, triton.next_power_of_2(max(1, -(-n // 4))))
    else:
        rows = max(1, min(16, 2048 // block))  # one row per program at π0.5 widths (1024, 2048)
    warps = 4 if rows * block <= 1024 else 8
    if n:
        _norm_kernel[(triton.cdiv(n, rows),)](
            x2, w, sc, sh, b, g, x_new, y,
            x2.stride(0), sc.stride(0), sh.stride(0), b.stride(0), g.stride(0), x_new.stride(0), y.stride(0),
            n, width, float(eps),
            ADA=ada, RESIDUAL=residual, GATED=gate is not None, PROD_DTYPE=_TL[prod_dtype],
            ROWS=rows, BLOCK=block, num_warps=warps)
    out_shape = shape[:-1] + (width,)
    if residual:
        return x_new.view(out_shape), y.view(out_shape)
    return y.view(out_shape)


def rms_norm(x, weight, eps):
    """x / rms(x) * (1 + weight), statistics in float32, output in x's dtype."""
    return _norm(x, eps, weight=weight)


def ada_rms_norm(x, scale, shift, eps):
    """x / rms(x) * (1 + scale) + shift, scale/shift [T, width]."""
    return _norm(x, eps, scale=scale, shift=shift)


def residual_rms_norm(x, branch, weight, eps):
    """(x + branch, rms_norm(x + branch))."""
    return _norm(x, eps, weight=weight, branch=branch)


def residual_ada_rms_norm(x, branch, gate, scale, shift, eps):
    """(x + branch * gate, ada_rms_norm(x + branch * gate))."""
    return _norm(x, eps, scale=scale, shift=shift, branch=branch, gate=gate)


def gelu_tanh_mul(gate, up):
    """gelu_tanh(gate) * up (elementwise, same shapes)."""
    _check(gate)
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    n = g.numel()
    block = 1024
    if n:
        _gelu_mul_kernel[(triton.cdiv(n, block),)](g, u, out, n, BLOCK=block, num_warps=4)
    return out
