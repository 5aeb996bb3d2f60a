"""Triton kernel of ``gemv.gemv`` and ``gemv.gemv_fused`` (imported on its first launch, see ``_launch``)."""

import triton
import triton.language as tl


@triton.jit
def _load_row_tile(x_ptrs, x2_ptrs, kmask, HAS_X2: tl.constexpr, EVEN_K: tl.constexpr):
    """A ``[BLOCK_N, BLOCK_K]`` tile of identical rows of the GEMV's input ``h``: ``x``, or ``x + x2`` rounded to
    x's dtype (the eager residual add) when ``HAS_X2``; fp32 values of the rounded input. Columns past K are 0."""
    if EVEN_K:
        h = tl.load(x_ptrs)
    else:
        h = tl.load(x_ptrs, mask=kmask, other=0.0)
    if HAS_X2:
        if EVEN_K:
            h2 = tl.load(x2_ptrs)
        else:
            h2 = tl.load(x2_ptrs, mask=kmask, other=0.0)
        h = (h.to(tl.float32) + h2.to(tl.float32)).to(h.dtype)
    return h


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] the activation row, unit stride
    w_ptr,  # [N, K] weight (nn.Linear layout), row stride stride_wn, unit stride along K (GATED: [2 * N, K])
    b_ptr,  # [N] bias (GATED: [2 * N]), or any pointer when HAS_BIAS is False
    out_ptr,  # [N]
    N,  # outputs (GATED: the gate rows; the up rows follow them)
    K,
    stride_wn,
    x2_ptr,  # [K] added to x before everything else when HAS_X2 (the residual stream's pending add)
    nw_ptr,  # [K] RMSNorm weight when HAS_NORM
    eps,  # fp32, RMSNorm epsilon when HAS_NORM
    r_ptr,  # [N] residual added to the output when HAS_RESIDUAL
    r2_ptr,  # [N] second residual summand when HAS_RESIDUAL2 (residual = r + r2, rounded)
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # weight rows per program
    BLOCK_K: tl.constexpr,  # K step
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    HAS_X2: tl.constexpr = False,
    HAS_NORM: tl.constexpr = False,
    HAS_RESIDUAL: tl.constexpr = False,
    HAS_RESIDUAL2: tl.constexpr = False,
    GATED: tl.constexpr = False,
):
    """``out[n] = sum_k x[k] * w[n, k] (+ b[n])`` for ``BLOCK_N`` weight rows per program, over all of K.

    The fp32 accumulator keeps the ``[BLOCK_N, BLOCK_K]`` products elementwise and is reduced over K once,
    after the loop, so the loop body is 16-byte loads, conversions and FMAs only. x is loaded as a
    ``[BLOCK_N, BLOCK_K]`` tile of identical rows, in the weight tile's layout: each thread reads the x values
    of its own columns (L1 hits) where a ``[BLOCK_K]`` load would be redistributed through shared memory, with a
    barrier, every step. Rows past N are clamped to row N - 1 for the loads (no masks there) and masked at
    the store.

    Fused modes (all off: the plain GEMV above, the same code), each rounding where the eager PyTorch ops do
    (transformers' ``LlamaRMSNorm``, ``ACT2FN["silu"]`` on a half tensor, ``a + b`` of half tensors):

    - ``HAS_X2``: the input is ``h = half(x + x2)``.
    - ``HAS_NORM`` (prologue): ``x_n = half(half(h * rstd) * nw)``, ``rstd = rsqrt(mean(h**2) + eps)``; a first
      pass over K computes ``rstd`` (x is a few KB: L1/L2 hits, every program recomputes it).
    - ``GATED`` (epilogue): the program also accumulates the up rows ``N + n`` of the ``[2N, K]`` weight and
      writes ``half(half(silu(half(gate))) * half(up))``.
    - ``HAS_RESIDUAL`` (epilogue): ``out = half(half(y) + r)``, ``r = half(r + r2)`` with ``HAS_RESIDUAL2``.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K], > 2**31 elements ok
    x_ptrs = x_ptr + offs_k[None, :] + 0 * rows[:, None]  # [BLOCK_N, BLOCK_K], every row the same
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if not (HAS_X2 or HAS_NORM or GATED):  # the plain GEMV (the loop the H200 sweep measured)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                kmask = (k0 + offs_k)[None, :] < K
                w = tl.load(w_ptrs, mask=kmask, other=0.0)
                x = tl.load(x_ptrs, mask=kmask, other=0.0)
            acc += x.to(tl.float32) * w.to(tl.float32)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = tl.sum(acc, axis=1)  # [BLOCK_N]
        if HAS_BIAS:
            out += tl.load(b_ptr + rows).to(tl.float32)
    else:
        x2_ptrs = x2_ptr + offs_k[None, :] + 0 * rows[:, None]
        nw_ptrs = nw_ptr + offs_k[None, :] + 0 * rows[:, None]
        if HAS_NORM:  # pass 1: rstd (identical in every row of the tile)
            sq = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                h = _load_row_tile(x_ptrs + k0, x2_ptrs + k0, (k0 + offs_k)[None, :] < K, HAS_X2, EVEN_K).to(tl.float32)
                sq += h * h
            rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)  # [BLOCK_N]
        if GATED:
            wu_ptrs = w_ptr + (rows + N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # the up rows N + n
            acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + offs_k)[None, :] < K
            h = _load_row_tile(x_ptrs, x2_ptrs, kmask, HAS_X2, EVEN_K)
            if HAS_NORM:
                if EVEN_K:
                    nw = tl.load(nw_ptrs)
                else:
                    nw = tl.load(nw_ptrs, mask=kmask, other=0.0)
                h = (h.to(tl.float32) * rstd[:, None]).to(h.dtype)
                h = (h.to(tl.float32) * nw.to(tl.float32)).to(h.dtype)
            if EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=kmask, other=0.0)
            acc += h.to(tl.float32) * w.to(tl.float32)
            if GATED:
                if EVEN_K:
                    wu = tl.load(wu_ptrs)
                else:
                    wu = tl.load(wu_ptrs, mask=kmask, other=0.0)
                acc_u += h.to(tl.float32) * wu.to(tl.float32)
                wu_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            x2_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        out = tl.sum(acc, axis=1)  # [BLOCK_N]
        if HAS_BIAS:
            out += tl.load(b_ptr + rows).to(tl.float32)
        if GATED:
            up = tl.sum(acc_u, axis=1)
            if HAS_BIAS:
                up += tl.load(b_ptr + N + rows).to(tl.float32)
            g = out.to(out_ptr.dtype.element_ty).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # silu as Inductor decomposes it
            out = act.to(tl.float32) * up.to(out_ptr.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows)
        if HAS_RESIDUAL2:
            r = (r.to(tl.float32) + tl.load(r2_ptr + rows).to(tl.float32)).to(r.dtype)
        out = out.to(out_ptr.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)
