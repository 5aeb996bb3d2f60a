"""Triton kernels of ``W4A16Algo.DOT`` / ``DOT_SWAP`` (one ``tl.dot`` per packed field) and of ``DEQUANT_MATMUL``'s
dequantization pass (imported on the first launch, see ``kernels._launch``)."""

import triton
import triton.language as tl

from .common_kernels import _field_magic, _group_rows, _split_k_tile, _write_tile, _zero_magic


@triton.jit
def _load_packed(qw_ptr, it, it_end, offs_kp, offs_n, mask_n, N, K, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The packed tile of K step ``it``: int32 ``[BLOCK_K // PACK, BLOCK_N]`` (zeros past K or at ``it >= it_end``)."""
    PACK: tl.constexpr = 32 // BITS
    kp = it * (BLOCK_K // PACK) + offs_kp
    kp_end = tl.minimum(K // PACK, it_end * (BLOCK_K // PACK))  # it >= it_end: all masked
    mask = (kp[:, None] < kp_end) & mask_n[None, :]
    return tl.load(qw_ptr + kp[:, None] * N + offs_n[None, :], mask=mask, other=0)


@triton.jit
def _tile_per_field(
    acc, p, x_ptr, s_ptr, z_ptr, k0, offs_m, offs_n, offs_kp, mask_m, mask_n, N, K, stride_xm,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    """One K step, without a reshape: field j of the packed tile ``p [BLOCK_K // PACK, BLOCK_N]`` (rows
    from ``k0 // PACK``) holds input rows ``k0 + i * PACK + j`` and is paired with those x columns (a
    stride-PACK load of x, which is tiny and stays in L1).

    ``acc``: fp32 ``[BLOCK_N, BLOCK_M]`` (``SWAP``, DOT_SWAP), ``[BLOCK_M, BLOCK_N]`` (DOT). Returns the updated ``acc``.
    """
    PACK: tl.constexpr = 32 // BITS
    LOW: tl.constexpr = 23 // BITS
    ONE_GROUP: tl.constexpr = GROUP_SIZE % BLOCK_K == 0  # the tile lies in one group: one scale row
    hi = (p.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)  # fields that do not fit in place
    if ONE_GROUP:
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)
    for J in tl.static_range(PACK):
        E = BITS * J - 16 * (J // LOW)  # constexpr: see _field_magic
        kk = k0 + offs_kp * PACK + J  # [BKP] input rows of field J
        if ONE_GROUP:
            zc = _zero_magic(z, J, BITS)[None, :]
            sj = (s * (1.0 / (1 << E)))[None, :]
        else:
            s, z = _group_rows(s_ptr, z_ptr, kk, offs_n, mask_n, N, K, GROUP_SIZE)
            zc = _zero_magic(z, J, BITS)
            sj = s * (1.0 / (1 << E))
        wq = ((_field_magic(p, hi, J, BITS) - zc) * sj).to(x_ptr.dtype.element_ty)  # [BKP, BLOCK_N], exact until the cast
        if SWAP:  # [BLOCK_N, BKP] @ [BKP, BLOCK_M]
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None], mask=mask_m[None, :] & (kk[:, None] < K), other=0.0)
            acc += tl.dot(tl.trans(wq), xt)
        else:
            xj = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & (kk[None, :] < K), other=0.0)
            acc += tl.dot(xj, wq)
    return acc


@triton.jit
def _w4a16_dot_kernel(
    x_ptr,  # [M, K] activations, row stride stride_xm, unit column stride
    qw_ptr,  # int32 [K // PACK, N]
    s_ptr,  # [G, N] scales
    z_ptr,  # int16 [G, N] zero points
    bias_ptr,  # [N] or dummy
    out_ptr,  # [M, N], row stride stride_om
    ws_ptr,  # fp32 [M, N] workspace, all zero between calls (split-K only)
    lock_ptr,  # int32 [num_tiles] arrival counters, all zero between calls (split-K only)
    M,
    N,
    K,
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWAP: tl.constexpr,  # DOT_SWAP: the dequantized weight is the left operand
):
    """``W4A16Algo.DOT`` / ``DOT_SWAP``: program ``(tile, pid_k)`` accumulates its ``[BLOCK_M, BLOCK_N]`` tile over K
    slice ``pid_k`` of ``SPLIT_K``, one ``tl.dot`` per packed field and K step (``_tile_per_field``)."""
    PACK: tl.constexpr = 32 // BITS
    tl.static_assert(BLOCK_K % PACK == 0)
    pid, it_start, it_end, offs_m, offs_n = _split_k_tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    offs_kp = tl.arange(0, BLOCK_K // PACK)
    mask_m = offs_m < M
    mask_n = offs_n < N

    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(it_start, it_end):  # the loads feed tl.dot: Triton's pipeliner stages them
        p = _load_packed(qw_ptr, it, it_end, offs_kp, offs_n, mask_n, N, K, BITS, BLOCK_K)
        acc = _tile_per_field(acc, p, x_ptr, s_ptr, z_ptr, it * BLOCK_K, offs_m, offs_n, offs_kp, mask_m, mask_n,
                              N, K, stride_xm, BITS, GROUP_SIZE, BLOCK_N, BLOCK_K, SWAP)
    if SWAP:
        acc = tl.trans(acc)

    _write_tile(acc, offs_m, offs_n, mask_m, mask_n, out_ptr, ws_ptr, lock_ptr, bias_ptr, pid, N, stride_om,
                HAS_BIAS, SPLIT_K)


@triton.jit
def _w4a16_dequant_kernel(
    qw_ptr,  # int32 [K // PACK, N]
    s_ptr,  # [G, N] scales
    z_ptr,  # int16 [G, N] zero points
    w_ptr,  # [K, N] output weight, in the activation dtype
    N,
    K,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """DEQUANT_MATMUL's first pass: one ``[BLOCK_K, BLOCK_N]`` weight tile per program, field by field
    (rows ``k0 + i * PACK + j`` of field j: each stored row is contiguous along N)."""
    PACK: tl.constexpr = 32 // BITS
    LOW: tl.constexpr = 23 // BITS
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kp = tl.arange(0, BLOCK_K // PACK)
    mask_n = offs_n < N
    kp = k0 // PACK + offs_kp
    p = tl.load(qw_ptr + kp[:, None] * N + offs_n[None, :], mask=(kp[:, None] < K // PACK) & mask_n[None, :], other=0)
    hi = (p.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
    for J in tl.static_range(PACK):
        E = BITS * J - 16 * (J // LOW)  # constexpr: see _field_magic
        kk = k0 + offs_kp * PACK + J
        s, z = _group_rows(s_ptr, z_ptr, kk, offs_n, mask_n, N, K, GROUP_SIZE)
        w = (_field_magic(p, hi, J, BITS) - _zero_magic(z, J, BITS)) * (s * (1.0 / (1 << E)))
        tl.store(w_ptr + kk[:, None] * N + offs_n[None, :], w.to(w_ptr.dtype.element_ty), mask=(kk[:, None] < K) & mask_n[None, :])
