"""Triton kernels of ``layer_ops`` (its wrappers validate the inputs and pick the grids): RMSNorm with an optional
residual add, the rotary embedding of a token's heads, and SiLU-and-mul. One program per row (RMSNorm), per token
and block of heads (rotary), per row and block of columns (SiLU-and-mul). Each computes in fp32 and rounds to the
model dtype where transformers' eager code does, so the results are the eager ops' up to the order of the RMSNorm
sum.
"""

import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, D], unit stride along D
    res_ptr,  # [T, D] the residual (read only with HAS_RESIDUAL)
    w_ptr,  # [D] the norm's weight
    out_ptr,  # [T, D] the normed rows
    sum_ptr,  # [T, D] res + x (written only with HAS_RESIDUAL)
    stride_x, stride_r, stride_o, stride_s,
    D, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One row: ``s = res + x`` rounded to x's dtype (and stored) with ``HAS_RESIDUAL``, else ``s = x``; then
    ``w * (s * rsqrt(mean(s^2) + eps)).to(dtype)`` with ``s`` in fp32 (transformers' ``LlamaRMSNorm``)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    y = (xf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr,  # [T, H, D], unit stride along D
    cos_ptr, sin_ptr,  # [T, D], unit stride along D
    out_ptr,  # [T, H, D] contiguous
    num_heads, stride_xt, stride_xh, stride_ct, stride_st, stride_ot, stride_oh,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    """``x * cos + rotate_half(x) * sin`` for ``BLOCK_H`` heads of one token, each product and the sum rounded to
    x's dtype (transformers' ``apply_rotary_pos_emb``)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mask = (h < num_heads)[:, None]
    base = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    c1 = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_st + d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_st + HALF + d).to(tl.float32)[None, :]
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((x1f * c1).to(dt).to(tl.float32) + (-x2f * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)).to(dt)
    obase = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(obase, o1, mask=mask)
    tl.store(obase + HALF, o2, mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 I] = [gate | up], unit stride along the columns
    out_ptr,  # [T, I] contiguous
    stride_x, stride_o, I,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """``silu(gate).to(dtype) * up`` for ``BLOCK`` columns of one row, rounded as the eager ops."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < I
    g = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + I + col, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * stride_o + col, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)
