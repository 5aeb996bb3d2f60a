"""Triton kernel of ``W4A16Algo.TC``, the tensor-core W4A16 matmul for 2-64 rows (imported on the first launch, see
``kernels._launch``)."""

import triton
import triton.language as tl

from .common_kernels import _split_k_tile, _write_tile


def _tc_asm(magic_bits: int, sub: str) -> str:
    """The inline PTX of ``_tc_unpack_asm``: int32 ``$8`` -> 8 16-bit outputs ``$0..$7`` (fields 0..7), each
    LOP3 pair ``(B + q_2i, B + q_2i+1)`` in the halves of one register; ``sub`` (``sub.bf16x2``/``sub.f16x2``)
    subtracts ``$9`` (``B + z`` in both halves) from each pair."""
    pair = magic_bits * 0x10001
    lines = ["{", ".reg .b32 s, t0, t1, t2, t3;", "shr.u32 s, $8, 4;"]
    # prmt selector (one hex digit per result byte, 0-3 = bytes of $8, 4-7 = of s): result byte 0 <- byte i of $8
    # (field 2i in its low nibble), byte 2 <- byte i of s = $8 >> 4 (field 2i + 1); bytes 1, 3 are masked off
    lines += [f"prmt.b32 t{i}, $8, s, {(4 + i) << 8 | i:#06x};" for i in range(4)]
    lines += [f"lop3.b32 t{i}, t{i}, 0x000F000F, {pair:#010x}, 0xEA;" for i in range(4)]  # 0xEA: (a & b) | c
    lines += [f"{sub} t{i}, t{i}, $9;" for i in range(4)]
    lines += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, t{i};" for i in range(4)]
    return "\n".join(lines + ["}"])


_TC_ASM_BF16 = tl.constexpr(_tc_asm(0x4300, "sub.bf16x2"))
_TC_ASM_FP16 = tl.constexpr(_tc_asm(0x6400, "sub.f16x2"))


@triton.jit
def _tc_magic_bits(DT: tl.constexpr):
    """Bit pattern of the magic number ``B`` of the ``DT`` element (int constexpr): ``B`` = 128 (bf16, 7
    mantissa bits), 1024 (fp16, 10), 2**23 (fp32, 23; interpreter only), whose mantissa step is 1, so OR-ing
    a 4-bit ``q`` into its low mantissa bits gives ``B + q`` exactly."""
    if DT == tl.bfloat16:
        return 0x4300
    elif DT == tl.float16:
        return 0x6400
    else:
        return 0x4B000000


@triton.jit
def _tc_magic_pair(DT: tl.constexpr):
    """``_tc_magic_bits`` of a 16-bit ``DT`` in both halves of an int32 (a function returning literals: triton
    3.6 cannot multiply a constexpr that holds a jit function's result)."""
    if DT == tl.bfloat16:
        return 0x43004300
    else:
        return 0x64006400


@triton.jit
def _tc_magic_value(DT: tl.constexpr):
    """``B`` of ``_tc_magic_bits`` as a float."""
    if DT == tl.bfloat16:
        return 128.0
    elif DT == tl.float16:
        return 1024.0
    else:
        return 8388608.0  # 2**23


@triton.jit
def _tc_join8(f0, f1, f2, f3, f4, f5, f6, f7):
    """Eight ``[R, 4, T]`` tensors (field j of word ``c * T + t`` of a row) -> ``[R, 32 T]`` in the K order of the
    MMA operand (``_tc_kperm_x``).

    ``join`` appends a new last dim, so three nested joins give ``[R, 4, T, 2, 2, 2]`` indexed ``(u, h, e)`` with the
    outermost join's index ``e`` last: field ``4u + 2h + e``, hence the operand order below (position 1 is the outer
    join's second half, position 4 the inner joins' second halves)."""
    w = tl.join(tl.join(tl.join(f0, f4), tl.join(f2, f6)), tl.join(tl.join(f1, f5), tl.join(f3, f7)))
    # w [R, c, t, u, h, e] -> [R, t, u, h, c, e]: MMA-operand order, see _tc_kperm_x
    return tl.reshape(tl.permute(w, (0, 2, 3, 4, 1, 5)), (f0.shape[0], 32 * f0.shape[2]))


@triton.jit
def _tc_kperm_x(xr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x ``[BLOCK_M, BLOCK_K]`` (columns = input rows of the K step, in order) with its columns in the order of the
    weight tile (``_tc_join8``).

    The A fragment of an m64nNk16 wgmma / m16n8k16 mma gives lane ``c = lane % 4`` the columns
    ``16 b + 8 h + 2 c + e`` (``h, e`` in {0, 1}) of every 16-column block ``b``. Writing ``b = 2t + u`` (``T =
    BLOCK_K // 32`` values of ``t``), word ``w = c T + t`` of a row and its field ``j = 4u + 2h + e`` go to column
    ``k' = 32 t + 16 u + 8 h + 2 c + e``, so the 8 fields of one int32 land in ONE thread's fragment (no data
    moves between threads after the unpack). The sum over K does not care about the order as long as x's
    columns follow it: column ``k'`` is input row ``8 w + j = 32 c + 8 t + 4 u + 2 h + e`` of the step, i.e.
    ``[M, c, t, u, h, e] -> [M, t, u, h, c, e]``. With it the unpacked weights never go through shared memory:
    4.16 SASS instructions per weight at 16x128 on sm_90, 6.38 (and 145 shared stores per step) without.
    """
    tl.static_assert(BLOCK_K % 32 == 0)
    x6 = tl.reshape(xr, (BLOCK_M, 4, BLOCK_K // 32, 2, 2, 2))
    return tl.reshape(tl.permute(x6, (0, 2, 3, 4, 1, 5)), (BLOCK_M, BLOCK_K))


@triton.jit
def _tc_unpack_bits(p, DT: tl.constexpr):
    """4-bit fields of ``p`` (int32 ``[R, 4, T]``) as ``B + q`` in ``DT`` (``_tc_magic_bits``), ``[R, 32 T]`` in
    ``_tc_join8``'s order, with plain Triton bit ops: the interpreter's stand-in for ``_tc_unpack_asm``.

    16-bit ``DT``: per shift ``4j`` one AND|OR makes two ``DT`` values at once, fields ``j`` and ``j + 4`` in the low
    and high halves (mask ``0x000F000F``, magic in both halves), split by a truncation and a shift; fp32: one AND|OR
    per field."""
    MAGIC: tl.constexpr = _tc_magic_bits(DT)
    if DT == tl.float32:
        f0 = (p & 15 | MAGIC).to(tl.float32, bitcast=True)
        f1 = ((p >> 4) & 15 | MAGIC).to(tl.float32, bitcast=True)
        f2 = ((p >> 8) & 15 | MAGIC).to(tl.float32, bitcast=True)
        f3 = ((p >> 12) & 15 | MAGIC).to(tl.float32, bitcast=True)
        f4 = ((p >> 16) & 15 | MAGIC).to(tl.float32, bitcast=True)
        f5 = ((p >> 20) & 15 | MAGIC).to(tl.float32, bitcast=True)
        f6 = ((p >> 24) & 15 | MAGIC).to(tl.float32, bitcast=True)
        f7 = ((p >> 28) & 15 | MAGIC).to(tl.float32, bitcast=True)
    else:
        PAIR = _tc_magic_pair(DT)  # the magic in both 16-bit halves
        t0 = p & 0x000F000F | PAIR
        t1 = (p >> 4) & 0x000F000F | PAIR
        t2 = (p >> 8) & 0x000F000F | PAIR
        t3 = (p >> 12) & 0x000F000F | PAIR
        f0 = t0.to(tl.int16).to(DT, bitcast=True)
        f4 = (t0 >> 16).to(tl.int16).to(DT, bitcast=True)
        f1 = t1.to(tl.int16).to(DT, bitcast=True)
        f5 = (t1 >> 16).to(tl.int16).to(DT, bitcast=True)
        f2 = t2.to(tl.int16).to(DT, bitcast=True)
        f6 = (t2 >> 16).to(tl.int16).to(DT, bitcast=True)
        f3 = t3.to(tl.int16).to(DT, bitcast=True)
        f7 = (t3 >> 16).to(tl.int16).to(DT, bitcast=True)
    return _tc_join8(f0, f1, f2, f3, f4, f5, f6, f7)


@triton.jit
def _tc_unpack_asm(p, zpair, DT: tl.constexpr):
    """As ``_tc_unpack_bits`` minus ``B + z`` (16-bit ``DT`` only, CUDA only: the interpreter runs no PTX), in one
    inline-PTX block per int32, after FasterTransformer / Marlin's LOP3 dequantization: one shift, then per pair of
    adjacent fields ``(2i, 2i + 1)`` a PRMT that puts byte ``i`` of ``p`` and of ``p >> 4`` in the two halves and a
    LOP3 ``(t & 0x000F000F) | magic``: a packed pair ``(B + q_2i, B + q_2i+1)`` in one register, the pairing of the
    MMA operand fragment (adjacent K); one packed subtract of ``zpair`` (``B + z`` in both halves, int32 bits) per
    pair leaves ``q - z`` exactly: 13 instructions per 8 weights.

    Args: p int32 ``[R, 4, T]``; zpair int32 ``[R, 4, T]`` (broadcast of a per-row value). Returns ``DT [R, 32 T]``.
    """
    C: tl.constexpr = "=h,=h,=h,=h,=h,=h,=h,=h,r,r"
    if DT == tl.bfloat16:
        f = tl.inline_asm_elementwise(_TC_ASM_BF16, C, [p, zpair], (tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        f = tl.inline_asm_elementwise(_TC_ASM_FP16, C, [p, zpair], (tl.float16,) * 8, is_pure=True, pack=1)
    return _tc_join8(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7])


@triton.jit
def _w4a16_tc_kernel(
    x_ptr,  # [M, K] activations, row stride stride_xm, unit column stride
    qw_ptr,  # int32 [K // 8, N] (4-bit only)
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
    GROUP_SIZE: tl.constexpr,  # a multiple of BLOCK_K, or K (per-channel): every K step lies in one group
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_ASM: tl.constexpr,  # CUDA: _tc_unpack_asm; the interpreter: _tc_unpack_bits
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
):
    """``W4A16Algo.TC``: program ``(tile, pid_k)`` computes ``out^T [BLOCK_N, BLOCK_M]`` of its tile over K slice
    ``pid_k`` as ``W^T [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M]`` per K step (swap AB: the dequantized weight is
    the left, register-sourced MMA operand, the padded M the MMA's small N), the tile's K order the MMA fragment's
    (``_tc_kperm_x``).

    Each step lies in one group (``GROUP_SIZE % BLOCK_K == 0`` or per-channel), so the scale leaves the tile:
    ``acc += s[n] * (W_int^T @ x^T)`` with ``W_int = q - z`` (``B + q`` minus ``B + z``: exact small integers in
    bf16/fp16), so the only rounding before the fp32 accumulator is x's own."""
    tl.static_assert(BLOCK_K % 8 == 0)
    BKP: tl.constexpr = BLOCK_K // 8
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid, it_start, it_end, offs_m, offs_n = _split_k_tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    offs_kp = tl.arange(0, BKP)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # rows past M read row M - 1 instead (their outputs are never stored): no mask, so the x loads can vectorize
    rows_x = tl.minimum(offs_m, M - 1)
    MAGIC: tl.constexpr = _tc_magic_value(DT)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for it in range(it_start, it_end):
        k0 = it * BLOCK_K
        kp = k0 // 8 + offs_kp
        # p^T: [BLOCK_N, BKP], contiguous along N (dim 0)
        p = tl.load(qw_ptr + kp[None, :] * N + offs_n[:, None], mask=(kp[None, :] < K // 8) & mask_n[:, None], other=0)
        p = tl.reshape(p, (BLOCK_N, 4, BKP // 4))  # word c * T + t -> [c, t]
        kk = k0 + offs_k
        # x [BLOCK_M, BLOCK_K] loaded in order, its columns permuted in registers (_tc_kperm_x)
        if EVEN_K:
            xr = tl.load(x_ptr + rows_x[:, None] * stride_xm + kk[None, :])
        else:
            xr = tl.load(x_ptr + rows_x[:, None] * stride_xm + kk[None, :], mask=kk[None, :] < K, other=0.0)
        xt = tl.trans(_tc_kperm_x(xr, BLOCK_M, BLOCK_K))
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)
        if USE_ASM:
            zb = (z + MAGIC).to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            zpair = tl.broadcast_to((zb | (zb << 16))[:, None], (BLOCK_N, BKP))
            zpair = tl.reshape(zpair, (BLOCK_N, 4, BKP // 4))
            w = _tc_unpack_asm(p, zpair, DT)  # q - z, exact
        else:
            w = _tc_unpack_bits(p, DT) - (z + MAGIC).to(DT)[:, None]  # (B + q) - (B + z) = q - z, exact
        acc += s[:, None] * tl.dot(w, xt)  # [BLOCK_N, BLOCK_M] fp32
    _write_tile(tl.trans(acc), offs_m, offs_n, mask_m, mask_n, out_ptr, ws_ptr, lock_ptr, bias_ptr, pid, N,
                stride_om, HAS_BIAS, SPLIT_K)
