"""Triton kernel of ``gemv.gemv`` (imported on its first launch, see ``_launch``)."""

import triton
import triton.language as tl


@triton.jit
def _load_tile(ptrs, offs_k, k0, K, EVEN_K: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` tile at ``ptrs`` (columns ``k0 + offs_k``; zeros past K unless ``EVEN_K``)."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)


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
    PDL: tl.constexpr,  # launched as a programmatic dependent launch: wait for the previous kernel before x
):
    """``out[n] = sum_k x[k] * w[n, k] (+ b[n])`` for ``BLOCK_N`` weight rows per program, over all of K.

    The fp32 accumulator keeps the ``[BLOCK_N, BLOCK_K]`` products elementwise and is reduced over K once,
    after the loop, so the loop body is 16-byte loads, conversions and FMAs only. x is loaded as a
    ``[BLOCK_N, BLOCK_K]`` tile of identical rows, in the weight tile's layout: each thread reads the x values
    of its own columns (L1 hits) where a ``[BLOCK_K]`` load would be redistributed through shared memory, with a
    barrier, every step. Rows past N are clamped to row N - 1 for the loads (no masks there) and masked at
    the store.

    With ``PDL`` (programmatic dependent launch, sm_90+) the program may start while the previous kernel of the
    stream still runs: it loads its first weight tile (weights are never written by a step), then waits for
    that kernel (``gdc_wait``) before it reads x or writes anything.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_k[None, :] + 0 * rows[:, None]  # [BLOCK_N, BLOCK_K], every row the same
    # the first K step, peeled: its weight tile is loaded before the wait on the previous kernel (PDL)
    w = _load_tile(w_ptrs, offs_k, 0, K, EVEN_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = _load_tile(x_ptrs, offs_k, 0, K, EVEN_K).to(tl.float32) * w.to(tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w = _load_tile(w_ptrs, offs_k, k0, K, EVEN_K)
        acc += _load_tile(x_ptrs, offs_k, k0, K, EVEN_K).to(tl.float32) * w.to(tl.float32)
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        out += tl.load(b_ptr + rows).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)
