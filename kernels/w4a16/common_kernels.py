"""Triton helpers shared by the W4A16 kernels: the magic-number unpack of a packed field, a group's scale and zero
rows, and the split-K grid with its epilogue (imported on the first launch, see ``kernels._launch``)."""

import triton
import triton.language as tl


@triton.jit
def _field_magic(p, hi, J: tl.constexpr, BITS: tl.constexpr):
    """Field ``J`` of packed words as fp32 ``2**23 + q * 2**E``, exactly (no I2F).

    ``E = BITS*J`` for the fields that end at or below bit 23 (``J < 23 // BITS``), taken in
    place from ``p``; the higher ones are taken from ``hi = p >>> 16`` (``E = BITS*J - 16``). OR-ing
    the masked field into the exponent of 2**23 (0x4B000000) gives ``2**23 + q * 2**E`` (exact,
    below 2**24), so one AND|OR (a LOP3) replaces shift + mask + I2F (a quarter-rate pipe), and
    the caller's one FADD of ``2**23 + z * 2**E`` (``_zero_magic``) leaves ``(q - z) * 2**E``, exact.
    The caller folds ``2**-E`` into x or the scale.

    Args: p, hi int32 ``[R, C]``. Returns: fp32 ``[R, C]``.
    """
    MASK: tl.constexpr = (1 << BITS) - 1
    LOW: tl.constexpr = 23 // BITS
    E: tl.constexpr = BITS * J - 16 * (J // LOW)
    if J < LOW:
        f = (p & (MASK << E)) | 0x4B000000
    else:
        f = (hi & (MASK << E)) | 0x4B000000
    return f.to(tl.float32, bitcast=True)


@triton.jit
def _zero_magic(z, J: tl.constexpr, BITS: tl.constexpr):
    """``2**23 + z * 2**E`` (fp32, exact): what ``_field_magic`` minus it leaves ``(q - z) * 2**E``."""
    LOW: tl.constexpr = 23 // BITS
    E: tl.constexpr = BITS * J - 16 * (J // LOW)
    return 8388608.0 + z * (1 << E)  # 8388608 = 2**23


@triton.jit
def _group_rows(s_ptr, z_ptr, kk, offs_n, mask_n, N, K, GROUP_SIZE: tl.constexpr):
    """Scales and zero points (fp32 ``[R, BLOCK_N]``) of input rows ``kk [R]`` (0 past K)."""
    gg = kk // GROUP_SIZE
    gmask = (kk[:, None] < K) & mask_n[None, :]
    s = tl.load(s_ptr + gg[:, None] * N + offs_n[None, :], mask=gmask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + gg[:, None] * N + offs_n[None, :], mask=gmask, other=0).to(tl.float32)
    return s, z


@triton.jit
def _split_k_tile(M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """Where program ``(tile, pid_k)`` of the split-K grid works: its output tile's rows ``offs_m [BLOCK_M]`` and
    columns ``offs_n [BLOCK_N]`` (tiles N-major: the M-tiles of one weight tile are neighbours, so the weight is
    read once from HBM) and its K steps ``[it_start, it_end)`` of ``BLOCK_K`` rows. Returns
    ``(tile, it_start, it_end, offs_m, offs_n)``; ``tile`` is ``_write_tile``'s ``tile_id``."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    k_iters = tl.cdiv(K, BLOCK_K)
    iters_per_split = tl.cdiv(k_iters, SPLIT_K)
    it_start = pid_k * iters_per_split
    it_end = tl.minimum(it_start + iters_per_split, k_iters)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)  # 16-byte weight loads when N % 4 == 0
    return pid, it_start, it_end, offs_m, offs_n


@triton.jit
def _write_tile(
    acc, offs_m, offs_n, mask_m, mask_n, out_ptr, ws_ptr, lock_ptr, bias_ptr, tile_id, N, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Store a program's fp32 ``acc [BLOCK_M, BLOCK_N]`` (rows ``offs_m``, columns ``offs_n``) into ``out``,
    adding the bias; with ``SPLIT_K > 1`` through the zeroed workspace and the tile's arrival counter
    ``lock_ptr + tile_id`` (package docstring: the last program of the tile writes the sum)."""
    mask_out = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)
    else:
        ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        # NOTE: relaxed partial sums (the default acq_rel puts a MEMBAR.ALL.GPU before each); the counter's
        # acq_rel orders them: every thread's adds are in (barrier) before this program counts as arrived
        tl.atomic_add(ws_ptrs, acc, mask=mask_out, sem="relaxed")
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + tile_id, 1)
        if arrived == SPLIT_K - 1:
            # last program of this tile: take the sum and leave zeros behind for the next call
            zero = tl.zeros_like(acc)
            total = tl.atomic_add(ws_ptrs, zero, mask=mask_out, sem="relaxed")  # an L2-coherent read of the sum
            tl.store(ws_ptrs, zero, mask=mask_out)
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask_out)
            tl.atomic_xchg(lock_ptr + tile_id, 0)
