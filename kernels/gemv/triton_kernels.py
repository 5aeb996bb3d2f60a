"""Triton kernel of ``gemv.gemv`` (imported on its first launch, see ``_launch``)."""

import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] the activation row, unit stride
    w_ptr,  # [N, K] weight (nn.Linear layout), row stride stride_wn, unit stride along K
    b_ptr,  # [N] bias, or any pointer when HAS_BIAS is False
    out_ptr,  # [N]
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # weight rows per program
    BLOCK_K: tl.constexpr,  # K step
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
):
    """``out[n] = sum_k x[k] * w[n, k] (+ b[n])`` for ``BLOCK_N`` weight rows per program, over all of K.

    The fp32 accumulator keeps the ``[BLOCK_N, BLOCK_K]`` products elementwise and is reduced over K once,
    after the loop, so the loop body is 16-byte loads, conversions and FMAs only. x is loaded as a
    ``[BLOCK_N, BLOCK_K]`` tile of identical rows, in the weight tile's layout: each thread reads the x values
    of its own columns (L1 hits) where a ``[BLOCK_K]`` load would be redistributed through shared memory, with a
    barrier, every step. Rows past N are clamped to row N - 1 for the loads (no masks there) and masked at
    the store.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K], > 2**31 elements ok
    x_ptrs = x_ptr + offs_k[None, :] + 0 * rows[:, None]  # [BLOCK_N, BLOCK_K], every row the same
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
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
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)
