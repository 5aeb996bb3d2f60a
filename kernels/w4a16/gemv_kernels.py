"""Triton kernel of ``W4A16Algo.GEMV``, the ``M = 1`` W4A16 matmul (imported on the first launch, see
``kernels._launch``)."""

import triton
import triton.language as tl

from .common_kernels import _group_rows, _write_tile


@triton.jit
def _gemv_load(qw_ptr, it, offs_kp, offs_n, mask_n, N, K, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """The packed tile of K step ``it``, int32 ``[BLOCK_K // PACK, BLOCK_N]`` (zeros past K or N), masked only
    where the shape needs it (a mask the compiler cannot prove uniform over 4 columns splits the 16-byte load)."""
    PACK: tl.constexpr = 32 // BITS
    kp = it * (BLOCK_K // PACK) + offs_kp
    ptrs = qw_ptr + kp[:, None] * N + offs_n[None, :]
    if EVEN_K and EVEN_N:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(kp[:, None] < K // PACK) & mask_n[None, :], other=0)


@triton.jit
def _gemv_x_pair(x_ptr, k0, offs_kp, K, J: tl.constexpr, PACK: tl.constexpr, EVEN_K: tl.constexpr):
    """x values of fields ``J`` and ``J + 1`` (``J`` even): input rows ``k0 + offs_kp * PACK + J (+ 1)``, two
    fp32 ``[BKP]`` (0 past K). bf16 x is read as one int32 per pair (the even row is the low half) and widened
    by a shift or a mask, which is the bf16 -> fp32 conversion; other dtypes load and convert each value."""
    kk = k0 + offs_kp * PACK + J  # [BKP], even
    if x_ptr.dtype.element_ty == tl.bfloat16:
        xw_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        if EVEN_K:
            xw = tl.load(xw_ptr + kk // 2)
        else:
            xw = tl.load(xw_ptr + kk // 2, mask=kk < K, other=0)
        lo = (xw << 16).to(tl.float32, bitcast=True)
        hi = (xw & -65536).to(tl.float32, bitcast=True)  # -65536 = 0xFFFF0000
    else:
        if EVEN_K:
            lo = tl.load(x_ptr + kk).to(tl.float32)
            hi = tl.load(x_ptr + kk + 1).to(tl.float32)
        else:
            lo = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            hi = tl.load(x_ptr + kk + 1, mask=kk + 1 < K, other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _field_placed(p, zero, J: tl.constexpr, BITS: tl.constexpr):
    """Field ``J`` of packed words ``p`` as the fp32 ``B_J + q`` with a small bias ``B_J = 2**(23 - E_J)``: one
    shift (shared by two fields) + one LOP3, exactly.

    The field is moved to bit ``E_J`` (4-bit: 19 for even ``J``, 15 for odd ``J``, so fields ``2i - 1`` and ``2i``
    share one shift ``E_J - 4J``: 5 distinct shifts per word, 19, 11, 3, -5, -13; 8-bit: ``E_J = 15``, one shift per
    field), masked and OR-ed into the exponent of ``2**(23 - E_J)``, whose mantissa step is then 1: ``B`` is 16 or
    256 (4-bit), 256 (8-bit). ``_field_bias`` is ``B_J``.

    Args: p int32 ``[R, C]``; zero: an int32 scalar that is 0 at run time (see the NOTE). Returns: fp32 ``[R, C]``.
    """
    MASK: tl.constexpr = (1 << BITS) - 1
    E: tl.constexpr = (15 + 4 * ((J + 1) % 2)) if BITS == 4 else 15
    S: tl.constexpr = E - BITS * J  # left shift (negative: right) that puts field J at bit E
    if S > 0:
        w = p << S
    elif S < 0:
        w = p >> (-S)  # arithmetic: the sign-filled bits are masked off
    else:
        w = p
    # NOTE: a LOP3 takes one immediate: ``zero`` (a runtime 0) keeps the mask in a register for the whole loop;
    # with two immediates ptxas re-materializes the mask (a MOV) before almost every LOP3
    f = (w & ((MASK << E) + zero)) | ((150 - E) << 23)  # 150 - E = 127 + 23 - E: the exponent of 2**(23 - E)
    return f.to(tl.float32, bitcast=True)


@triton.jit
def _field_bias(J: tl.constexpr, BITS: tl.constexpr):
    """``B_J = 2**(23 - E_J)`` of ``_field_placed`` (fp32 scalar, exact)."""
    E: tl.constexpr = (15 + 4 * ((J + 1) % 2)) if BITS == 4 else 15
    return 1.0 * (1 << (23 - E))


@triton.jit
def _gemv_step(
    acc, p, x_ptr, s_ptr, z_ptr, k0, offs_n, offs_kp, mask_n, N, K,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """One K step of the GEMV: ``acc [BLOCK_N] += sum_k x[k] W[k, n]`` over input rows ``k0 .. k0 + BLOCK_K`` of the
    packed tile ``p [BLOCK_K // PACK, BLOCK_N]``.

    Per weight one LOP3 (+ a shift shared by two 4-bit fields: ``_field_placed``) and one FFMA of the *biased* value,
    ``P = sum_k x_k (B_k + q_k)``; the bias and the zero point are removed once per column and group,
    ``sum_k x_k (q_k - z) = (P - C) - z X`` with ``C = sum_k x_k B_k`` and ``X = sum_k x_k``, which do not depend on
    the column (made once per step from the x values, shared by the columns a thread holds). Without the FADD per
    weight that ``q - z`` would cost, the sm_90 loop runs 3.30-3.70 instructions per weight instead of 4.97.

    Error bound (fp32, unit roundoff ``u = 2**-24``, standard dot-product analysis, Higham ch. 3): with ``m`` the
    longest chain of roundings in one of the sums (``m <= PACK + BLOCK_K // PACK``), per column and group
    ``|err| <= (2m + 3) u sum_k |x_k| (B_max + 2**BITS) (1 + O(mu))``, i.e. the usual bound of a dot product with
    ``|q - z|`` replaced by ``B_max + 2**BITS`` (``B_max = 256``). Measured (interpreter, fp32 x, K = 256, group
    128, relative to the output norm, random weights): 4e-6 for 4 bits, 3e-7 for 8 bits, against bf16's
    ``2**-9 = 2e-3`` output rounding. Weights near zero make the relative error larger, as the output shrinks and the
    bias does not: worst seen 7e-5 (fp32 x, scales 1e-4, zero point 15, every q near it).
    """
    PACK: tl.constexpr = 32 // BITS
    BKP: tl.constexpr = BLOCK_K // PACK
    zero = N >> 31  # 0 (N > 0), but not a compile-time constant: _field_placed's NOTE
    part = tl.zeros([BKP, p.shape[1]], dtype=tl.float32)
    # B_J depends only on the parity of J: C = B_0 X_even + B_1 X_odd, one FADD per x value
    xe = tl.zeros([BKP], dtype=tl.float32)  # per packed row: sum of x over the even fields
    xo = tl.zeros([BKP], dtype=tl.float32)  # ... and the odd ones
    for J in tl.static_range(PACK):
        if J % 2 == 0:
            xlo, xhi = _gemv_x_pair(x_ptr, k0, offs_kp, K, J, PACK, EVEN_K)
            part += xlo[:, None] * _field_placed(p, zero, J, BITS)
            xe += xlo
        else:
            part += xhi[:, None] * _field_placed(p, zero, J, BITS)
            xo += xhi
    if GROUP_SIZE % BLOCK_K == 0:  # the tile lies in one group: C, X and the scale once per column
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)
        se = tl.sum(xe, axis=0)
        so = tl.sum(xo, axis=0)
        c = se * _field_bias(0, BITS) + so * _field_bias(1, BITS)
        acc += s * ((tl.sum(part, axis=0) - c) - z * (se + so))
    else:  # each packed row lies in one group (GROUP_SIZE % PACK == 0)
        s, z = _group_rows(s_ptr, z_ptr, k0 + offs_kp * PACK, offs_n, mask_n, N, K, GROUP_SIZE)
        cx = xe * _field_bias(0, BITS) + xo * _field_bias(1, BITS)
        acc += tl.sum(s * ((part - cx[:, None]) - z * (xe + xo)[:, None]), axis=0)
    return acc


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [K] activations (the one row, M = 1), unit stride
    qw_ptr,  # int32 [K // PACK, N]
    s_ptr,  # [G, N] scales
    z_ptr,  # int16 [G, N] zero points
    bias_ptr,  # [N] or dummy
    out_ptr,  # [N]
    ws_ptr,  # fp32 [N] workspace, all zero between calls (split-K only)
    lock_ptr,  # int32 [cdiv(N, BLOCK_N)] arrival counters, all zero between calls (split-K only)
    N,
    K,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no masks along N
):
    """The M = 1 GEMV (``W4A16Algo.GEMV``): program ``(pid_n, pid_k)`` owns columns ``pid_n * BLOCK_N + [0,
    BLOCK_N)`` and K slice ``pid_k`` of ``SPLIT_K``; a 1-D fp32 accumulator, reduced over the tile's rows every
    K step (in-thread when the tile's rows all sit in one thread: ``BLOCK_N = 128 * num_warps``).

    It takes 1.37-1.55x the time of a kernel that only reads the same bytes (docs/benchmark-history.md, "the read
    floor"): what is left is the per-weight work of ``_gemv_step``, not the loads."""
    PACK: tl.constexpr = 32 // BITS
    tl.static_assert(BLOCK_K % PACK == 0)
    tl.static_assert(GROUP_SIZE % PACK == 0)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_iters = tl.cdiv(K, BLOCK_K)
    iters_per_split = tl.cdiv(k_iters, SPLIT_K)
    it_start = pid_k * iters_per_split
    it_end = tl.minimum(it_start + iters_per_split, k_iters)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    offs_kp = tl.arange(0, BLOCK_K // PACK)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for it in range(it_start, it_end):
        p = _gemv_load(qw_ptr, it, offs_kp, offs_n, mask_n, N, K, BITS, BLOCK_K, EVEN_K, EVEN_N)
        acc = _gemv_step(acc, p, x_ptr, s_ptr, z_ptr, it * BLOCK_K, offs_n, offs_kp, mask_n, N, K,
                         BITS, GROUP_SIZE, BLOCK_K, EVEN_K)
    offs_m = tl.arange(0, 1)
    _write_tile(acc[None, :], offs_m, offs_n, offs_m < 1, mask_n, out_ptr, ws_ptr, lock_ptr, bias_ptr, pid_n, N, 0,
                HAS_BIAS, SPLIT_K)
