"""W4A16 (and W8A16): fused dequantize + matmul of fp16/bf16 activations with int4/int8 weights.

``out[m, n] = sum_k x[m, k] * W[k, n] (+ bias[n])`` where the weight is stored packed, GPTQ-style,
in one layout for every checkpoint format (GPTQ and AWQ are converted to it once at load time by
``paged_transformers.quantization``)::

    pack = 32 // bits                       values per int32 word (8 for 4-bit, 4 for 8-bit)
    qweight  int32 [K // pack, N]           packed along the INPUT dim, low bits first:
             q[k, n] = (qweight[k // pack, n] >> (bits * (k % pack))) & (2**bits - 1)
    scales   fp16/bf16/fp32 [G, N]          G = K // group_size (group_size = K for per-channel)
    zeros    int16 [G, N]                   the integer zero point (already +1 for GPTQ v1)
    W[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]

Act-order (GPTQ ``desc_act``) checkpoints are handled before this kernel: their input rows are
permuted at load time so that groups are contiguous, and the activation columns are gathered once
per layer with the same permutation (as exllama/Marlin-style GPTQ kernels do).

Algorithm: every program owns one ``[BLOCK_M, BLOCK_N]`` output tile and a slice of K. Per K-step
it loads ``p``, ``BLOCK_K // pack`` packed rows ``[BLOCK_K // pack, BLOCK_N]`` (16-byte loads), and
unpacks it field by field, without a reshape (which costs a layout conversion through shared memory
every step): field ``j`` is the ``[BLOCK_K // pack, BLOCK_N]`` tile of input rows ``k0 + i * pack + j``,
paired with those x columns (a stride-``pack`` load of x, tiny and cached). Int -> float is the
magic-number trick (``_field_magic``: OR the field into the mantissa of 2**23, no I2F), exact in fp32.
``W4A16Algo`` names the variants: the ``M = 1`` GEMV (``GEMV``, its own kernel ``_gemv_kernel_fn``: a 1-D
fp32 accumulator, the zero point folded into the per-field magic-number FADD, bf16 x read as int32 pairs),
``tl.dot`` per field (``DOT``), the same with the weight as left operand (``DOT_SWAP``), and dequantize +
cuBLAS (``DEQUANT_MATMUL``). ``default_config`` picks one per shape (its table has the H200 numbers).
Sources of the tricks: FasterTransformer / Marlin (magic-number dequant), exllama (dequant + GEMM for
large batches), CUTLASS (serial split-K).

* Small M (decode): split-K. ``SPLIT_K`` programs share an output tile; each adds its fp32 partial
  into a zeroed workspace with atomics, then bumps a per-tile counter; the last one to arrive reads
  the sum back with an atomic (add of zero), re-zeroes the workspace, writes the output and
  resets the counter, so one launch does the whole GEMM and leaves the workspace clean for the next
  call (the "serial split-K with semaphore" scheme of CUTLASS, done with atomics).
* Large M (prefill): plain tiled GEMM, ``SPLIT_K = 1``, output tiles ordered N-major so the
  M-tiles that share a weight tile run together and hit L2.

``w4a16_matmul_ref`` is the PyTorch reference of the same function (dequantize to fp32, cast to the
activation dtype, matmul) and the CPU path.
"""

import enum
import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path still works
    triton = None
    tl = None


# -- layout helpers (PyTorch) -----------------------------------------------------------------------


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpack an int32 tensor packed along dim 0, low bits first.

    Args:
        packed: int32 ``[R, C]``.
        bits: 4 or 8.

    Returns:
        int32 ``[R * (32 // bits), C]`` with values in ``[0, 2**bits)``; row ``r * pack + j`` is bits
        ``[bits * j, bits * (j + 1))`` of ``packed[r]``.
    """
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32).view(1, pack, 1)
    q = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # [R, pack, C]
    return q.reshape(packed.shape[0] * pack, packed.shape[1])


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``unpack_rows``: pack integer values ``[K, C]`` (``K % (32 // bits) == 0``) into
    int32 ``[K // (32 // bits), C]`` along dim 0, low bits first.

    Raises:
        ValueError: ``K`` is not a multiple of ``32 // bits``.
    """
    pack = 32 // bits
    if q.shape[0] % pack:
        raise ValueError(f"cannot pack {q.shape[0]} rows into int32 words of {pack} values")
    shifts = torch.arange(0, 32, bits, device=q.device, dtype=torch.int64).view(1, pack, 1)
    words = (q.to(torch.int64).view(-1, pack, q.shape[1]) << shifts).sum(dim=1)  # [K/pack, C], in [0, 2**32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as two's-complement int32
    return words.to(torch.int32)


def dequantize_packed(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """The full weight of the packed layout (see the module docstring), exactly, in float32.

    Args:
        qweight: int32 ``[K // pack, N]``; scales ``[G, N]`` any float dtype; zeros int ``[G, N]``.
        bits: 4 or 8. group_size: rows per group (``K`` for per-channel).

    Returns:
        float32 ``[K, N]``: ``(q - zeros[k // group_size]) * scales[k // group_size]``.
    """
    q = unpack_rows(qweight, bits)  # [K, N]
    K, N = q.shape
    G = K // group_size
    w = (q.view(G, group_size, N) - zeros.view(G, 1, N)).to(torch.float32)  # broadcast per group, no gather
    return (w * scales.view(G, 1, N).to(torch.float32)).view(K, N)


def w4a16_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference of ``w4a16_matmul`` (and the CPU path): dequantize, then matmul.

    The weight is dequantized exactly in float32 and cast to ``x.dtype`` before the matmul, which is
    also what the Triton kernel feeds its tensor cores; for float32 ``x`` the result is the exact
    dequantized model.

    Args:
        x: ``[M, K]`` float (any float dtype). Other args as in ``w4a16_matmul``.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    w = dequantize_packed(qweight, scales, zeros, bits, group_size).to(x.dtype)
    out = x @ w
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out


# -- Triton kernels ----------------------------------------------------------------------------------


class W4A16Algo(enum.Enum):
    """How a program turns its packed ``[BLOCK_K // pack, BLOCK_N]`` tile into output (module docstring).

    * ``DOT``: per-field unpack, ``tl.dot(x_j [BLOCK_M, BLOCK_K // pack], w_j [BLOCK_K // pack, BLOCK_N])``
      for each field j;
    * ``DOT_SWAP``: as ``DOT`` with the product transposed, ``tl.dot(w_j^T, x_j^T)``, so the dequantized
      weight is the left (register-sourced) MMA operand and ``BLOCK_M`` is the MMA's small N;
    * ``GEMV``: the M = 1 kernel of round 3 (``_gemv_kernel_fn``): a 1-D accumulator, the zero point folded into
      the per-field FADD of the magic number, x read as bf16 pairs, no masks on even shapes; the M = 1 default
      (``block_m`` must be 1; ``W4A16Config.prefetch``/``fold_exp``/``biased_fma`` select its variants);
    * ``TC`` / ``TC_ASM`` (issue 7 round 5, 4-bit only, each K step in one group): swap AB with the whole
      ``[BLOCK_N, BLOCK_K]`` weight tile dequantized to exact small integers ``q - z`` and ONE ``tl.dot`` per K
      step, the scale applied to the fp32 product (``_tc_kernel_fn``); ``TC`` unpacks with Triton bit ops,
      ``TC_ASM`` with inline PTX (LOP3 magic-number pairs, CUDA only); ``W4A16Config.tc_perm`` permutes the tile's
      K order (and x's) to the MMA fragment's, so the unpacked weights never go through shared memory
      (``_tc_kperm_x``);
    * ``DEQUANT_MATMUL``: a Triton pass writes the weight in ``x.dtype`` to a scratch ``[K, N]`` buffer,
      then ``torch.matmul`` (cuBLAS), as exllama does for large batches.

    Removed after the H200 measurements of round 3 (issue 7): ``FMA``, the round-1/2 broadcast-FMA GEMV (the
    ``GEMV`` kernel beat it on every shape at M = 1), and ``TILED``, a fused GEMM for prefill-sized M (one
    dequantized ``[BLOCK_K, BLOCK_N]`` tile + one wgmma per K step; ``default_config``'s NOTE has its numbers).
    """

    GEMV = "gemv"
    DOT = "dot"
    DOT_SWAP = "dot_swap"
    DEQUANT_MATMUL = "dequant_matmul"
    TC = "tc"
    TC_ASM = "tc_asm"


# the kernel's ALGO constexpr (0 was the removed FMA GEMV: the ids stay as measured)
_ALGO_ID = {W4A16Algo.DOT: 1, W4A16Algo.DOT_SWAP: 2}


@dataclass(frozen=True, slots=True)
class W4A16Config:
    """Launch configuration of the W4A16 kernel.

    ``block_k`` must be a multiple of ``32 // bits`` (and, for tensor-core algos on CUDA, give
    ``block_k // (32 // bits) >= 16``; ``block_m >= 16`` there too); ``split_k > 1`` makes ``split_k``
    programs share each output tile. ``algo`` may be given as its string value.

    Raises:
        ValueError: an unknown ``algo``, a non-positive size, a block size or ``num_warps`` that is not a power
            of two (``tl.arange`` and Triton's warp count need one), a non-bool flag, or a GEMV option
            (``prefetch``, ``biased_fma``) / TC option (``tc_perm``) with another algo.
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    algo: W4A16Algo = W4A16Algo.DOT
    prefetch: bool = False  # GEMV only: load K step it+1 before computing step it
    fold_exp: bool = True  # GEMV only: _field_biased (exponent per field) instead of _field_magic + x * 2**-E
    # GEMV only: 0 off; 12 or 15: FFMA the biased field 2**(23-E) + q directly (no FADD per weight), the bias
    # removed once per group (``_gemv_step_biased``); the value is the lowest field position T (E in {T, T+4})
    biased_fma: int = 0
    # TC/TC_ASM only: the tile's K order permuted to the MMA fragment's (_tc_kperm_x; block_k % 32 == 0)
    tc_perm: bool = False

    def __post_init__(self):
        if not isinstance(self.algo, W4A16Algo):
            try:
                object.__setattr__(self, "algo", W4A16Algo(self.algo))
            except ValueError:
                raise ValueError(f"unknown W4A16 algo {self.algo!r}; allowed: {[a.value for a in W4A16Algo]}") from None
        for name in ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"W4A16Config.{name} must be a positive int, got {value!r}")
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"W4A16Config.{name} must be a power of two, got {value!r}")
        for name in ("prefetch", "fold_exp", "tc_perm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"W4A16Config.{name} must be a bool, got {getattr(self, name)!r}")
        if type(self.biased_fma) is not int or self.biased_fma not in (0, 12, 15):
            raise ValueError(f"W4A16Config.biased_fma must be 0 (off), 12 or 15, got {self.biased_fma!r}")
        if self.biased_fma and self.algo != W4A16Algo.GEMV:
            raise ValueError(f"W4A16Config.biased_fma={self.biased_fma} is a GEMV option, but algo is {self.algo.value!r}")
        if self.tc_perm and self.algo not in (W4A16Algo.TC, W4A16Algo.TC_ASM):
            raise ValueError(f"W4A16Config.tc_perm is a TC/TC_ASM option, but algo is {self.algo.value!r}")
        if self.prefetch and self.algo != W4A16Algo.GEMV:
            raise ValueError(f"W4A16Config.prefetch is a GEMV option, but algo is {self.algo.value!r}")

    def __str__(self) -> str:
        extra = (f"{' pf' if self.prefetch else ''}{'' if self.fold_exp else ' magic'}"
                 f"{f' bfma{self.biased_fma}' if self.biased_fma else ''}") if self.algo == W4A16Algo.GEMV else (
                 " perm" if self.tc_perm else "")
        return (f"{self.algo.value} {self.block_m}x{self.block_n}x{self.block_k} split{self.split_k} "
                f"w{self.num_warps} s{self.num_stages}{extra}")  # fmt: skip


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


if triton is not None:
    _TC_ASM_BF16 = tl.constexpr(_tc_asm(0x4300, "sub.bf16x2"))
    _TC_ASM_FP16 = tl.constexpr(_tc_asm(0x6400, "sub.f16x2"))


if triton is not None:

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
        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALGO: tl.constexpr,
    ):  # fmt: skip
        """One K step, without a reshape: field j of the packed tile ``p [BLOCK_K // PACK, BLOCK_N]`` (rows
        from ``k0 // PACK``) holds input rows ``k0 + i * PACK + j`` and is paired with those x columns (a
        stride-PACK load of x, which is tiny and stays in L1).

        ``acc``: fp32 ``[BLOCK_N, BLOCK_M]`` (DOT_SWAP), ``[BLOCK_M, BLOCK_N]`` (DOT). Returns the updated ``acc``.
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
            if ALGO == 1:  # DOT
                xj = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & (kk[None, :] < K), other=0.0)
                acc += tl.dot(xj, wq)
            else:  # DOT_SWAP: [BLOCK_N, BKP] @ [BKP, BLOCK_M]
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None], mask=mask_m[None, :] & (kk[:, None] < K), other=0.0)
                acc += tl.dot(tl.trans(wq), xt)
        return acc

    def _w4a16_kernel_fn(
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
        ALGO: tl.constexpr,  # 1 DOT, 2 DOT_SWAP (_ALGO_ID)
    ):
        PACK: tl.constexpr = 32 // BITS
        tl.static_assert(BLOCK_K % PACK == 0)
        pid, it_start, it_end, offs_m, offs_n = _split_k_tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
        offs_kp = tl.arange(0, BLOCK_K // PACK)
        mask_m = offs_m < M
        mask_n = offs_n < N

        if ALGO == 2:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for it in range(it_start, it_end):  # the loads feed tl.dot: Triton's pipeliner stages them
            p = _load_packed(qw_ptr, it, it_end, offs_kp, offs_n, mask_n, N, K, BITS, BLOCK_K)
            acc = _tile_per_field(acc, p, x_ptr, s_ptr, z_ptr, it * BLOCK_K, offs_m, offs_n, offs_kp, mask_m, mask_n,
                                  N, K, stride_xm, BITS, GROUP_SIZE, BLOCK_N, BLOCK_K, ALGO)
        if ALGO == 2:
            acc = tl.trans(acc)

        _write_tile(acc, offs_m, offs_n, mask_m, mask_n, out_ptr, ws_ptr, lock_ptr, bias_ptr, pid, N, stride_om,
                    HAS_BIAS, SPLIT_K)

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
        ``lock_ptr + tile_id`` (module docstring: the last program of the tile writes the sum)."""
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

    @triton.jit
    def _field_biased(p, hi, J: tl.constexpr, BITS: tl.constexpr):
        """Field ``J`` of packed words as the fp32 ``2**(23 - E) + q``, exactly, in one LOP3.

        As ``_field_magic``, the field stays at bit ``E`` (fields 0 .. ``23 // BITS - 1`` in ``p``, the rest in
        ``hi = p >>> 16``), but it is OR-ed into the exponent of ``2**(23 - E)`` instead of ``2**23``, so its
        lowest bit weighs 1: one FADD of ``-(2**(23 - E) + z)`` leaves ``q - z`` with no ``2**-E`` to fold
        into x (an FMUL per x value with ``FOLD_EXP`` off).

        Args: p, hi int32 ``[R, C]``. Returns: fp32 ``[R, C]``.
        """
        MASK: tl.constexpr = (1 << BITS) - 1
        LOW: tl.constexpr = 23 // BITS
        E: tl.constexpr = BITS * J - 16 * (J // LOW)
        EXP: tl.constexpr = (150 - E) << 23  # the exponent field of 2**(23 - E): 127 + 23 - E
        if J < LOW:
            f = (p & (MASK << E)) | EXP
        else:
            f = (hi & (MASK << E)) | EXP
        return f.to(tl.float32, bitcast=True)

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
    def _gemv_step(
        acc, p, x_ptr, s_ptr, z_ptr, k0, offs_n, offs_kp, mask_n, N, K,
        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FOLD_EXP: tl.constexpr,
    ):  # fmt: skip
        """One K step of the GEMV: ``acc [BLOCK_N] += sum_k x[k] W[k, n]`` over input rows ``k0 .. k0 + BLOCK_K``
        of the packed tile ``p [BLOCK_K // PACK, BLOCK_N]`` (``BKP = BLOCK_K // PACK`` rows).

        One group per tile (``GROUP_SIZE % BLOCK_K == 0``): per field ``J``, ``part += x_J * (q_J - z)``, where
        ``_field_biased``'s float ``2**(23 - E) + q`` minus ``2**(23 - E) + z`` (one per column and exponent, made
        once per tile) is ``q - z`` exactly: LOP3 + FADD + FFMA per weight and nothing per x value but its
        load; the scale once per tile, ``acc += s * sum_rows(part)``. Smaller groups: each packed row lies in
        one group (``GROUP_SIZE % PACK == 0``), so ``acc += sum_rows s_r (part_r - z_r sum_{k in row r} x_k)``
        with ``part_r = sum x q``.
        """
        PACK: tl.constexpr = 32 // BITS
        LOW: tl.constexpr = 23 // BITS
        BKP: tl.constexpr = BLOCK_K // PACK
        hi = (p.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
        part = tl.zeros([BKP, p.shape[1]], dtype=tl.float32)
        if GROUP_SIZE % BLOCK_K == 0:  # the tile lies in one group
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)
            for J in tl.static_range(PACK):
                if J % 2 == 0:
                    xlo, xhi = _gemv_x_pair(x_ptr, k0, offs_kp, K, J, PACK, EVEN_K)
                xj = xlo if J % 2 == 0 else xhi
                E = BITS * J - 16 * (J // LOW)  # constexpr: see _field_magic
                if FOLD_EXP:
                    # (2**(23-E) + q) - (2**(23-E) + z): both exact, so is the difference
                    w = _field_biased(p, hi, J, BITS) - (z + 1.0 * (1 << (23 - E)))[None, :]
                else:
                    # (2**23 + q 2**E) - (2**23 + z 2**E) = (q - z) 2**E, exact; 2**-E goes into x
                    w = _field_magic(p, hi, J, BITS) - _zero_magic(z, J, BITS)[None, :]
                    xj = xj * (1.0 / (1 << E))
                part += xj[:, None] * w
            acc += s * tl.sum(part, axis=0)
        else:
            xsum = tl.zeros([BKP], dtype=tl.float32)
            for J in tl.static_range(PACK):
                if J % 2 == 0:
                    xlo, xhi = _gemv_x_pair(x_ptr, k0, offs_kp, K, J, PACK, EVEN_K)
                xj = xlo if J % 2 == 0 else xhi
                E2 = BITS * J - 16 * (J // LOW)
                part += xj[:, None] * (_field_biased(p, hi, J, BITS) - 1.0 * (1 << (23 - E2)))
                xsum += xj
            s, z = _group_rows(s_ptr, z_ptr, k0 + offs_kp * PACK, offs_n, mask_n, N, K, GROUP_SIZE)
            acc += tl.sum(s * (part - z * xsum[:, None]), axis=0)
        return acc

    @triton.jit
    def _field_placed(p, zero, J: tl.constexpr, BITS: tl.constexpr, T: tl.constexpr):
        """Field ``J`` of packed words ``p`` as the fp32 ``B_J + q`` with a small bias ``B_J = 2**(23 - E_J)``: one
        shift (shared by two fields) + one LOP3, exactly.

        The field is moved to bit ``E_J`` (4-bit: ``T + 4`` for even ``J``, ``T`` for odd ``J``, so fields
        ``2i - 1`` and ``2i`` share one shift ``E_J - 4J``: 4 distinct shifts per word for ``T = 12``, shifts
        16, 8, 0, -8, -16; 5 for ``T = 15``; 8-bit: ``E_J = 15``, one shift per field), masked and OR-ed into the
        exponent of ``2**(23 - E_J)``, whose mantissa step is then 1 (see ``_field_biased``). ``T = 12`` gives
        ``B`` in {2048, 128}, ``T = 15`` {256, 16}, 8-bit 256. ``_field_bias`` is ``B_J``.

        Args: p int32 ``[R, C]``; zero: an int32 scalar that is 0 at run time (see the NOTE). Returns: fp32 ``[R, C]``.
        """
        MASK: tl.constexpr = (1 << BITS) - 1
        E: tl.constexpr = (T + 4 * ((J + 1) % 2)) if BITS == 4 else 15
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
    def _field_bias(J: tl.constexpr, BITS: tl.constexpr, T: tl.constexpr):
        """``B_J = 2**(23 - E_J)`` of ``_field_placed`` (fp32 scalar, exact)."""
        E: tl.constexpr = (T + 4 * ((J + 1) % 2)) if BITS == 4 else 15
        return 1.0 * (1 << (23 - E))

    @triton.jit
    def _gemv_step_biased(
        acc, p, x_ptr, s_ptr, z_ptr, k0, offs_n, offs_kp, mask_n, N, K,
        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, T: tl.constexpr,
    ):  # fmt: skip
        """``_gemv_step`` without the FADD per weight (``W4A16Config.biased_fma = T``): per weight one LOP3 (+ a shift
        shared by two 4-bit fields: ``_field_placed``) and one FFMA of the *biased* value, ``P = sum_k x_k (B_k + q_k)``;
        the bias and the zero point are removed once per column and group, ``sum_k x_k (q_k - z) = (P - C) - z X``
        with ``C = sum_k x_k B_k`` and ``X = sum_k x_k``, which do not depend on the column (made once per step from
        the x values, shared by the columns a thread holds).

        Error bound (fp32, unit roundoff ``u = 2**-24``, standard dot-product analysis, Higham ch. 3): with ``m`` the
        longest chain of roundings in one of the sums (``PACK`` FFMAs + the row reduction: ``m <= PACK + BLOCK_K //
        PACK``), ``|P - P*| <= m u sum_k |x_k| (B_k + q_k)`` and ``|C - C*| <= m u sum_k |x_k| B_k``, and the three
        subtractions add ``u`` each of their operands, so per column and group
        ``|err| <= (2m + 3) u sum_k |x_k| (B_max + 2**BITS) (1 + O(mu))``, i.e. the usual bound of a dot product
        with ``|q - z|`` replaced by ``B_max + 2**BITS``: ``B_max = 2048`` (``T = 12``) or 256 (``T = 15``, 8-bit)
        against ``|q - z| <= 16``. For ``BLOCK_K = 128`` (``m = 24``), ``T = 12``: ``51 * 2064 * 2**-24 = 6.3e-3``
        of ``sum |x_k|`` per group, worst case (every rounding the same sign); typical errors are far smaller
        (random signs add as ``sqrt``). Measured (interpreter, fp32 x, K = 256, group 128, relative to the output
        norm, random weights): 3e-5 for ``T = 12``, 4e-6 for ``T = 15``, 3e-7 for 8-bit, against 1e-7 without
        ``biased_fma`` and bf16's ``2**-9 = 2e-3`` output rounding; ``T = 15`` (bound / 8) is what the fp32 tests'
        1e-5 allows. Weights near zero make the relative error larger, as the output shrinks and the bias does
        not: worst seen 3.7e-4 (``T = 12``, fp32 x, scales 1e-4, zero point 15, every q near it), 7e-5 for ``T = 15``.
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
                part += xlo[:, None] * _field_placed(p, zero, J, BITS, T)
                xe += xlo
            else:
                part += xhi[:, None] * _field_placed(p, zero, J, BITS, T)
                xo += xhi
        if GROUP_SIZE % BLOCK_K == 0:  # the tile lies in one group: C, X and the scale once per column
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)
            se = tl.sum(xe, axis=0)
            so = tl.sum(xo, axis=0)
            c = se * _field_bias(0, BITS, T) + so * _field_bias(1, BITS, T)
            acc += s * ((tl.sum(part, axis=0) - c) - z * (se + so))
        else:  # each packed row lies in one group (GROUP_SIZE % PACK == 0)
            s, z = _group_rows(s_ptr, z_ptr, k0 + offs_kp * PACK, offs_n, mask_n, N, K, GROUP_SIZE)
            cx = xe * _field_bias(0, BITS, T) + xo * _field_bias(1, BITS, T)
            acc += tl.sum(s * ((part - cx[:, None]) - z * (xe + xo)[:, None]), axis=0)
        return acc

    @triton.jit
    def _gemv_step_any(
        acc, p, x_ptr, s_ptr, z_ptr, k0, offs_n, offs_kp, mask_n, N, K, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FOLD_EXP: tl.constexpr, BIASED_FMA: tl.constexpr,
    ):  # fmt: skip
        """One K step of the GEMV: ``_gemv_step_biased`` when ``BIASED_FMA`` is set, else ``_gemv_step``."""
        if BIASED_FMA:
            acc = _gemv_step_biased(acc, p, x_ptr, s_ptr, z_ptr, k0, offs_n, offs_kp, mask_n, N, K,
                                    BITS, GROUP_SIZE, BLOCK_K, EVEN_K, BIASED_FMA)
        else:
            acc = _gemv_step(acc, p, x_ptr, s_ptr, z_ptr, k0, offs_n, offs_kp, mask_n, N, K,
                             BITS, GROUP_SIZE, BLOCK_K, EVEN_K, FOLD_EXP)
        return acc

    def _gemv_kernel_fn(
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
        PREFETCH: tl.constexpr,
        EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
        EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no masks along N
        FOLD_EXP: tl.constexpr,  # _field_biased (a magic per field) instead of _field_magic + x * 2**-E
        BIASED_FMA: tl.constexpr,  # 0, or T of _gemv_step_biased (W4A16Config.biased_fma)
    ):
        """The M = 1 GEMV (``W4A16Algo.GEMV``): program ``(pid_n, pid_k)`` owns columns ``pid_n * BLOCK_N + [0,
        BLOCK_N)`` and K slice ``pid_k`` of ``SPLIT_K``; a 1-D fp32 accumulator, reduced over the tile's rows every
        K step (in-thread when the tile's rows all sit in one thread: ``BLOCK_N = 128 * num_warps``).

        NOTE (issue 7 round 7; Nsight Compute source counters, ``benchmarks/results/ncu_w4a16_h200_round7_source.json``):
        a default program runs 1-2 K steps, so its loads are waited on at once (``long_sb``, a third or more of the stall
        samples) and the split-K epilogue's arrival counter, whose round trip every warp waits for at a barrier, is
        the top single stall (6% on 4096 x 14336, 18% on 4096 x 4096). Three ways around it were measured on the H200
        (``bench_w4a16.py --variants r7`` at commits 1667d32 / c01026f and with 16-warp tiles) and lost on every
        shape of the engine's projections: the K loop pipelined by Triton (``tl.range(num_stages=2..4)``, tiles
        copied ahead with cp.async; 1-23% slower, ``w4a16_h200_round7_pipelined.json``), a per-row accumulator
        reduced once after the loop on 16-128-column tiles with no or little split-K (no counter at all; 2-28%
        slower, ``w4a16_h200_round7_defer.json``), and one 16- or 32-warp program per SM (equal or slower, except the
        2048x128 tiles on 4096 x 6144, which the wide tiles match: ``w4a16_h200_round7_tiles16w.json``). Launched
        as a programmatic dependent launch (the first tile prefetched to L2 before ``gdc_wait``; commit 942669a), the
        engine's batch-1 GPTQ step went from 2.57 to 2.84 ms (``profile_decode_h200_gptq_pdl.json``).

        NOTE (round 8, ``bench_w4a16.py --variants floor`` / ``r8``, ``w4a16_h200_round8_{floor,gemv}*.json``): a kernel
        that only reads the same bytes on the same kind of grid (``benchmarks/read_floor.py``) takes 4.6 / 9.6 / 9.8 us
        at best on 4096 x 4096 / 4096 x 14336 / 14336 x 4096; this GEMV takes 1.38-1.53x that. Its time does not follow
        the grid's read time: on 4096 x 14336 the pure read takes 9.6 us on 512x64 tiles at 8 programs per SM and
        11.9 on round 7's 2048x64 tiles at 2, where the GEMV takes 14.1 and 13.5. What is left is the per-weight work
        (``_gemv_step_biased``: a LOP3 and an FFMA per weight, a shift per two), not the loads."""
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
        if PREFETCH:  # step it+1's tile in flight while step it computes (Triton only pipelines loads that feed tl.dot)
            p = _gemv_load(qw_ptr, it_start, offs_kp, offs_n, mask_n, N, K, BITS, BLOCK_K, EVEN_K, EVEN_N)
            for it in range(it_start, it_end):
                # the last step re-loads its own tile (an L1/L2 hit) instead of masking every load
                p_next = _gemv_load(qw_ptr, tl.minimum(it + 1, it_end - 1), offs_kp, offs_n, mask_n, N, K, BITS,
                                    BLOCK_K, EVEN_K, EVEN_N)
                acc = _gemv_step_any(acc, p, x_ptr, s_ptr, z_ptr, it * BLOCK_K, offs_n, offs_kp, mask_n, N, K,
                                     BITS, GROUP_SIZE, BLOCK_K, EVEN_K, FOLD_EXP, BIASED_FMA)
                p = p_next
        else:
            for it in range(it_start, it_end):
                p = _gemv_load(qw_ptr, it, offs_kp, offs_n, mask_n, N, K, BITS, BLOCK_K, EVEN_K, EVEN_N)
                acc = _gemv_step_any(acc, p, x_ptr, s_ptr, z_ptr, it * BLOCK_K, offs_n, offs_kp, mask_n, N, K,
                                     BITS, GROUP_SIZE, BLOCK_K, EVEN_K, FOLD_EXP, BIASED_FMA)
        offs_m = tl.arange(0, 1)
        _write_tile(acc[None, :], offs_m, offs_n, offs_m < 1, mask_n, out_ptr, ws_ptr, lock_ptr, bias_ptr, pid_n, N, 0,
                    HAS_BIAS, SPLIT_K)

    # -- W4A16Algo.TC / TC_ASM: swap AB, one dequantized [BLOCK_N, BLOCK_K] tile and one tl.dot per K step --------

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
    def _tc_join8(f0, f1, f2, f3, f4, f5, f6, f7, PERMUTE_K: tl.constexpr = False):
        """Eight ``[R, C]`` tensors (field j = input row ``8c + j``) -> ``[R, 8C]`` in natural row order.

        ``join`` appends a new last dim, so three nested joins give ``[R, C, 2, 2, 2]`` indexed ``(i, j, l)``
        with the outermost join's index ``l`` last; the flattened position is ``4i + 2j + l``, hence the operand
        order below (position 1 is the outer join's second half, position 4 the inner joins' second halves)."""
        w = tl.join(tl.join(tl.join(f0, f4), tl.join(f2, f6)), tl.join(tl.join(f1, f5), tl.join(f3, f7)))
        if PERMUTE_K:
            # f: [R, 4 (c), T (t)] -> w [R, c, t, u, h, e] (field 4u + 2h + e) -> [R, t, u, h, c, e]: MMA-operand order,
            # see _tc_kperm_x
            w = tl.reshape(tl.permute(w, (0, 2, 3, 4, 1, 5)), (f0.shape[0], 32 * f0.shape[2]))
        else:
            w = tl.reshape(w, (f0.shape[0], 8 * f0.shape[1]))
        return w

    @triton.jit
    def _tc_kperm_x(xr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """x ``[BLOCK_M, BLOCK_K]`` (columns = input rows of the K step, in order) with its columns in the order of the
        ``PERMUTE_K`` weight tile (``_tc_join8``).

        The A fragment of an m64nNk16 wgmma / m16n8k16 mma gives lane ``c = lane % 4`` the columns
        ``16 b + 8 h + 2 c + e`` (``h, e`` in {0, 1}) of every 16-column block ``b``. Writing ``b = 2t + u`` (``T =
        BLOCK_K // 32`` values of ``t``), word ``w = c T + t`` of a row and its field ``j = 4u + 2h + e`` go to column
        ``k' = 32 t + 16 u + 8 h + 2 c + e``, so the 8 fields of one int32 land in ONE thread's fragment (no data
        moves between threads after the unpack). The sum over K does not care about the order as long as x's
        columns follow it: column ``k'`` is input row ``8 w + j = 32 c + 8 t + 4 u + 2 h + e`` of the step, i.e.
        ``[M, c, t, u, h, e] -> [M, t, u, h, c, e]``.
        """
        tl.static_assert(BLOCK_K % 32 == 0)
        x6 = tl.reshape(xr, (BLOCK_M, 4, BLOCK_K // 32, 2, 2, 2))
        return tl.reshape(tl.permute(x6, (0, 2, 3, 4, 1, 5)), (BLOCK_M, BLOCK_K))

    @triton.jit
    def _tc_unpack_bits(p, DT: tl.constexpr, PERMUTE_K: tl.constexpr = False):
        """4-bit fields of ``p`` (int32 ``[R, C]``) as ``B + q`` in ``DT`` (``_tc_magic_bits``): ``[R, 8C]``, column
        ``8c + j`` = field ``j`` of ``p[:, c]``. Plain Triton bit ops (variant ``TC``).

        16-bit ``DT``: per shift ``4j`` one AND|OR (a LOP3) makes two ``DT`` values at once, fields ``j`` and
        ``j + 4`` in the low and high halves (mask ``0x000F000F``, magic in both halves), split by a truncation
        and a shift; fp32: one LOP3 per field."""
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
        return _tc_join8(f0, f1, f2, f3, f4, f5, f6, f7, PERMUTE_K)

    @triton.jit
    def _tc_unpack_asm(p, zpair, DT: tl.constexpr, PERMUTE_K: tl.constexpr = False):
        """As ``_tc_unpack_bits`` (16-bit ``DT`` only, CUDA only: the interpreter runs no PTX), in one inline-PTX
        block per int32 (variant ``TC_ASM``), after FasterTransformer / Marlin's LOP3 dequantization: one shift,
        then per pair of adjacent fields ``(2i, 2i + 1)`` a PRMT that puts byte ``i`` of ``p`` and of ``p >> 4`` in
        the two halves and a LOP3 ``(t & 0x000F000F) | magic``: a packed pair ``(B + q_2i, B + q_2i+1)`` in one
        register, the pairing of the MMA operand fragment (adjacent K); one packed subtract of ``zpair`` (``B + z``
        in both halves, int32 bits) per pair leaves ``q - z`` exactly: 13 instructions per 8 weights.

        Args: p int32 ``[R, C]``; zpair int32 ``[R, C]`` (broadcast of a per-row value). Returns ``DT [R, 8C]``.
        """
        C: tl.constexpr = "=h,=h,=h,=h,=h,=h,=h,=h,r,r"
        if DT == tl.bfloat16:
            f = tl.inline_asm_elementwise(_TC_ASM_BF16, C, [p, zpair], (tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            f = tl.inline_asm_elementwise(_TC_ASM_FP16, C, [p, zpair], (tl.float16,) * 8, is_pure=True, pack=1)
        return _tc_join8(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], PERMUTE_K)

    def _tc_kernel_fn(
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
        USE_ASM: tl.constexpr,  # TC_ASM: _tc_unpack_asm; TC: _tc_unpack_bits
        EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
        PERMUTE_K: tl.constexpr,  # W4A16Config.tc_perm: the weight tile's columns in MMA-fragment order (_tc_kperm_x)
    ):
        """``W4A16Algo.TC`` / ``TC_ASM``: program ``(tile, pid_k)`` computes ``out^T [BLOCK_N, BLOCK_M]`` of its tile
        over K slice ``pid_k`` as ``W^T [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M]`` per K step (swap AB: the
        dequantized weight is the left, register-sourced MMA operand, the padded M the MMA's small N).

        Each step lies in one group (``GROUP_SIZE % BLOCK_K == 0`` or per-channel), so the scale leaves the tile:
        ``acc += s[n] * (W_int^T @ x^T)`` with ``W_int = q - z`` (``B + q`` minus ``B + z``: exact small integers in
        bf16/fp16), so the only rounding before the fp32 accumulator is x's own.

        NOTE: removing ``B + z`` after the dot instead (``B + q`` in the tile, minus ``(B + z) * sum_k x``: no float
        op per weight) was tried: the row sum of the MMA-layout x tile cost 112 SHFL + 114 FADD per K step on sm_90
        (10.1 SASS instructions per weight in the loop vs 6.6), so it was dropped.

        NOTE (issue 7 round 6, commits d6934bd / 8f77939; removed after the H200 sweep ``bench_w4a16.py --variants
        tc2``, ``benchmarks/results/w4a16_h200_round6_tc2.{json,log}``, torch 2.11, triton 3.6): three latency options
        around round 5's 16x64x128 ``tc_perm`` default, which takes 9.6 / 21.6 / 20.7 us at M = 16 on 4096x4096 /
        4096x14336 / 14336x4096. ``prefetch`` (step it+1's x, s, z in registers: plain loads that displaced the
        pipeliner's cp.async of x and z): 39.3 / 135.4 / 127.3 us, 3-6x slower at every M <= 16. ``tc_x_index`` (x
        read at its tile-order column index, a cp.async stage): 17.8 / 59.2 / 51.5 us, up to 2.7x slower.
        ``tc_prescale`` (``w = (q - z) * s`` rounded once in the tile, ``acc = tl.dot(w, xt, acc)``): 9.8 / 22.6 /
        21.7 us. Both of the last two (``xi pre``) 18.1 / 59.9 / 51.9 us, and every larger tile, stage count or
        split of it slower too; at M = 64 / 256 with 64x64 to 128x128 tiles 178-1209 us, 2.5-14x DEQUANT_MATMUL's
        time. Triton 3.9 (a CPU compile) had left the chained wgmma in flight (``pendings = 1``); triton 3.6 on the
        H200 waits at once (``pendings = 0`` in every variant, ``w4a16_sass_round6_h200.log``). At M = 1 every TC
        variant (9.7-29 / 22.8-101 / 21.7-93 us) lost to the GEMV (7.0 / 13.4 / 13.7 us).

        NOTE (round 7): Nsight Compute put the top single stall of this kernel (14% of the samples at M = 16 on 4096 x
        14336) on the fp16 -> fp32 conversion of the scales right after the wgmma: the scales are a plain load,
        waited on at once (Triton pipelines only the dot's operands, and ``tl.range(num_stages=...)`` did not take
        them in either). Loading them one K step ahead (commit 1667d32) gained 0-2% on the 16x64 tiles (9.6 -> 9.4
        us at M = 4 on 4096 x 4096, equal elsewhere) and was removed; other warps hide that latency. The next
        largest costs: x's shared-memory round trip (permuted in registers and stored for the wgmma: LDS at 4
        wavefronts where 1 is ideal, STS, fences; ~20% of the samples) and the split-K epilogue (~20%). With x handed
        over already in tile order (a measurement, commit 1f33889: what storing the weights in that K order at load
        time would allow), the default took 8.7 / 21.5 / 17.7 us at M = 16 instead of 9.6 / 21.9 / 20.8, and 23.6
        instead of 22.3 on the wide shape at M = 4 (``w4a16_h200_round7_xperm.json``)."""
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
            if PERMUTE_K:
                p = tl.reshape(p, (BLOCK_N, 4, BKP // 4))  # word c * T + t -> [c, t]
            kk = k0 + offs_k
            if PERMUTE_K:  # x [BLOCK_M, BLOCK_K] loaded in order, its columns permuted in registers (_tc_kperm_x)
                if EVEN_K:
                    xr = tl.load(x_ptr + rows_x[:, None] * stride_xm + kk[None, :])
                else:
                    xr = tl.load(x_ptr + rows_x[:, None] * stride_xm + kk[None, :], mask=kk[None, :] < K, other=0.0)
                xt = tl.trans(_tc_kperm_x(xr, BLOCK_M, BLOCK_K))
            elif EVEN_K:
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None], mask=mask_m[None, :], other=0.0)
            else:
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None], mask=mask_m[None, :] & (kk[:, None] < K), other=0.0)
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
            z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)
            if USE_ASM:
                zb = (z + MAGIC).to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                zpair = tl.broadcast_to((zb | (zb << 16))[:, None], (BLOCK_N, BKP))
                if PERMUTE_K:
                    zpair = tl.reshape(zpair, (BLOCK_N, 4, BKP // 4))
                w = _tc_unpack_asm(p, zpair, DT, PERMUTE_K)  # q - z, exact
            else:
                w = _tc_unpack_bits(p, DT, PERMUTE_K) - (z + MAGIC).to(DT)[:, None]  # (B + q) - (B + z) = q - z, exact
            acc += s[:, None] * tl.dot(w, xt)  # [BLOCK_N, BLOCK_M] fp32
        _write_tile(tl.trans(acc), offs_m, offs_n, mask_m, mask_n, out_ptr, ws_ptr, lock_ptr, bias_ptr, pid, N,
                    stride_om, HAS_BIAS, SPLIT_K)

    def _dequant_kernel_fn(
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

    _w4a16_kernel = triton.jit(_w4a16_kernel_fn)
    _dequant_kernel = triton.jit(_dequant_kernel_fn)
    _gemv_kernel = triton.jit(_gemv_kernel_fn)
    _tc_kernel = triton.jit(_tc_kernel_fn)
    _interpreted: dict = {}


def _kernel_for(device: torch.device, fn_name: str = "_w4a16_kernel_fn"):
    """The compiled kernel on CUDA; on CPU the Triton interpreter (needs ``TRITON_INTERPRET=1``)."""
    if device.type == "cuda":
        return {"_w4a16_kernel_fn": _w4a16_kernel, "_dequant_kernel_fn": _dequant_kernel, "_gemv_kernel_fn": _gemv_kernel, "_tc_kernel_fn": _tc_kernel}[fn_name]
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"w4a16_matmul needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 or use w4a16_matmul_ref")
    if fn_name not in _interpreted:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreted[fn_name] = InterpretedFunction(globals()[fn_name])
    return _interpreted[fn_name]


class _SplitKWorkspace:
    """Per-device fp32 workspace and tile counters for split-K, zero between calls.

    NOTE: the kernel leaves both zeroed, so they are allocated once and reused by every layer. They
    only grow; an outgrown buffer is kept alive because a captured CUDA graph may still point at it.
    Calls on two streams at once would share them: run W4A16 split-K on one stream per device.
    """

    def __init__(self):
        self._buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._retired: list[torch.Tensor] = []

    def get(self, device: torch.device, ws_numel: int, num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        ws, locks = self._buffers.get(device, (None, None))
        if ws is None or ws.numel() < ws_numel or locks.numel() < num_tiles:
            if ws is not None:
                self._retired += [ws, locks]
            ws = torch.zeros(max(ws_numel, 1 << 20), dtype=torch.float32, device=device)
            locks = torch.zeros(max(num_tiles, 1 << 14), dtype=torch.int32, device=device)
            self._buffers[device] = (ws, locks)
        return ws, locks


_WORKSPACE = _SplitKWorkspace()


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 for anything else: the H200 we tune on)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_for(num_tiles: int, k_iters: int, num_sms: int, programs_per_sm: int = 4) -> int:
    """Split-K count that gives about ``programs_per_sm`` programs per SM (each SM streams weights from
    several programs at once), at most one K step per program.

    Args: output tiles of the grid, K steps (``ceil(K / BLOCK_K)``), SMs of the device.
    Returns: an int in ``[1, k_iters]``.
    """
    return max(1, min(k_iters, -(-programs_per_sm * num_sms // num_tiles)))


def default_config(M: int, N: int, K: int, group_size: int, device: torch.device, bits: int = 4,
                   dtype: torch.dtype = torch.bfloat16) -> W4A16Config:
    """The launch configuration used when none is given, as rules on the shape: the fastest of the H200 sweeps
    of issue 7 (group 128, bf16; M = 1: round 4, ``bench_w4a16.py --variants gemv``, and rounds 7 and 8, ``--variants
    r7`` / ``r8``; M = 2-16 on CUDA: round 5, ``--variants tc``; M = 17-64 on CUDA: rounds 6 and 7, ``--variants
    tc2``; otherwise round 1, re-timed in round 3).

    A weight is *square* when neither side is twice the other (4096 x 4096), *wide* when
    ``N >= 2K`` (gate/up projections, 4096 x 14336) and *tall* when ``K >= 2N`` (down projection,
    14336 x 4096). Split-K comes from ``split_k_for`` with the programs per SM of each rule. The times are
    H200 device time per call on the CUDA-graph clock (``bench_w4a16.py --quick``, torch 2.11, triton 3.6; the
    run of record of round 7, 2026-11-30, ``benchmarks/results/w4a16_h200_round7_quick.json``, unless said
    otherwise), with bf16 ``torch.matmul`` of the same shape in brackets:

    ========  ========================================  ===============================================
    M         square (4096 x 4096)                      wide (4096 x 14336) / tall (14336 x 4096)
    ========  ========================================  ===============================================
    1         GEMV 1x512x64 ``biased_fma=15``, 2        the same: 13.6 us (30.4, 2.24x) / 13.6 us
              warps, 8 per SM (round 8, ``--variants    (30.9, 2.27x); round 7's 2048-column tiles
              r8``): 7.1 us (bf16 13.2, 1.85x); the     13.5 / 13.7; round 3: 18.0 / 17.8
              fused q|k|v (4096 x 6144) 7.8 us, round
              7's 2048-column tiles 8.7
    2 - 16    TC_ASM 16x64x128 ``tc_perm``, 4 per SM,   the same: 22.6 (30.1, 1.33x) / 21.3 (31.5, 1.48x)
              3 stages (round 5, ``--variants tc``):    at M = 4; 21.8 (30.3, 1.39x) / 21.0 (32.2,
              9.6 us at M = 16 (bf16 13.2, 1.38x)       1.53x) at M = 16
    2 - 4     (no TC: not 4-bit, fp32 x, a group that   DOT 16x128x128, 4 per SM: 33.2 (29.9, 0.90x) /
              is not whole K steps, or not CUDA)        30.1 (31.5, 1.05x) (round 3)
              DOT 16x64x128, 4 per SM: 12.9 us at
              M = 4 (12.8, 0.99x) (round 3)
    5 - 16    (no TC) DOT_SWAP 16x64x128, 4 per SM:     DOT 16x128x128, 4 per SM: 38.8 (30.3, 0.78x) /
              16.9 us at M = 16 (13.1, 0.78x)           35.6 (32.0, 0.90x) (round 3)
    17 - 64   (the > 16 rule)                           with TC: TC_ASM 64x128x128 ``tc_perm``, 8 warps,
                                                        3 stages; wide split 1 (round 6): 39.8 us at
                                                        M = 64 (31.2, 0.78x; DEQUANT_MATMUL 73.5), 52.7
                                                        at M = 32 (30.6; DEQUANT_MATMUL 72.8); tall
                                                        split-K, 2 per SM (round 7): 48.5 at M = 64
                                                        (35.2, 0.73x; DEQUANT_MATMUL 77.6); without TC:
                                                        the > 16 rule
    > 16      DEQUANT_MATMUL 128x128 tiles:             the same (M > 64 or no TC): 87.4 (45.1) / 90.9
              20.8 / 26.0 us at M = 64 / 256            (48.3) at M = 256 (0.52x-0.53x)
              (11.3 / 17.0: 0.54x / 0.65x)
    ========  ========================================  ===============================================

    ``M == 1`` with ``group_size % 8 != 0`` (a group that is not whole int32 words, which the GEMV needs) takes
    the ``M <= 4`` rule.

    The 17 - 64 rules (``benchmarks/results/w4a16_h200_round6_tc2.json`` and ``w4a16_h200_round7_tc2.json``,
    2026-11-30) were measured at M = 64 and, for wide weights, M = 32. The TC kernel runs one 64-row M tile for
    every M in 17..64 (rows past M read row M - 1), so its work does not depend on M there: split 1 took 135.6 us at
    M = 32 and 136.0 at M = 64 on the tall shape. The tall rule at M < 64 rests on that, not on a timing of its
    split-K config below M = 64. On the square shape the same split-K tiles tied DEQUANT_MATMUL at M = 64 (20.0 vs
    20.8 us), which stays; at M = 256, 64x128 and 128x128 tiles lost on every shape (round 6: 150.8 vs 85.3 wide,
    40.7 vs 26.7 square, 142.8 vs 90.6 tall).

    NOTE: a fused tiled GEMM for M = 16..1024 (one dequantized ``[BLOCK_K, BLOCK_N]`` tile and one wgmma per K
    step, with unpack variants, a swapped variant and split-K; commit b41233e, results
    ``benchmarks/results/w4a16_h200_round3_tiled.json``) was measured on the H200 against this dispatch: its
    best config per point ran at 0.37-0.58x of bf16 where this dispatch ran at 0.42-0.91x, slower at 11 of the
    12 (shape, M) points; the exception, 14336 x 4096 at M = 64 (61.5 us vs DEQUANT_MATMUL's 77.7, still 0.57x
    of bf16), was one config of a 12-config sweep, not its default. It was removed with the round-1/2 FMA GEMV.

    Args/Returns: the GEMM sizes (``x [M, K] @ W [K, N]``), the group size, the device, the weight's bits and x's
    dtype -> a ``W4A16Config``. ``TC_ASM`` is inline PTX: it is picked only on CUDA, for 4 bits, fp16/bf16 x and a
    group that holds whole 128-row K steps (or per-channel).
    """
    sms = _num_sms(device)
    wide, tall = N >= 2 * K, K >= 2 * N
    k_iters = -(-K // 128)
    if M == 1 and group_size % 8 == 0:  # a group of whole int32 words for 4 and 8 bits (the GEMV's layout)
        # round 8: one rule for every shape (docstring; 64 words per thread and step, as round 7's 2048x64 on 8 warps)
        return W4A16Config(1, 512, 64, split_k_for(-(-N // 512), -(-K // 64), sms, 8), 2, 1, W4A16Algo.GEMV, biased_fma=15)
    tc = (device.type == "cuda" and bits == 4 and dtype in (torch.float16, torch.bfloat16)
          and (group_size % 128 == 0 or group_size == K))
    if M <= 16 and tc:
        split = split_k_for(-(-N // 64), k_iters, sms, 4)
        return W4A16Config(16, 64, 128, split, 4, 3, W4A16Algo.TC_ASM, tc_perm=True)
    if 16 < M <= 64 and tc and (wide or tall):  # rounds 6 and 7 (docstring)
        split = split_k_for(-(-N // 128), k_iters, sms, 2) if tall else 1
        return W4A16Config(64, 128, 128, split, 8, 3, W4A16Algo.TC_ASM, tc_perm=True)
    if M <= 16:
        bn = 128 if wide or tall else 64
        algo = W4A16Algo.DOT_SWAP if M > 4 and not (wide or tall) else W4A16Algo.DOT
        return W4A16Config(16, bn, 128, split_k_for(-(-M // 16) * -(-N // bn), k_iters, sms, 4), 4, 3, algo)
    return W4A16Config(128, 128, 128, 1, 4, 3, W4A16Algo.DEQUANT_MATMUL)


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """Fused dequantize + matmul ``x @ W (+ bias)`` with the Triton kernel.

    Args:
        x: ``[M, K]`` fp16 or bf16 (or fp32 under the interpreter), unit stride along K.
        qweight: int32 ``[K // (32 // bits), N]``, contiguous (layout in the module docstring).
        scales: ``[K // group_size, N]`` fp16/bf16/fp32, contiguous; converted to fp32 in the kernel.
        zeros: int16 ``[K // group_size, N]``, contiguous.
        bits: 4 or 8.
        group_size: input rows per group, dividing K (pass K for per-channel / ``group_size=-1``).
        bias: optional ``[N]``.
        config: a ``W4A16Config``; default ``default_config(...)``.

    Returns:
        ``[M, N]`` in ``x.dtype`` (empty, with no launch, when ``M`` or ``N`` is 0).

    Raises:
        ValueError: a wrong dtype, device, shape or stride (the offending tensor is named), a config
            the kernel cannot run, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if triton is None:
        raise ValueError("w4a16_matmul needs triton; use w4a16_matmul_ref")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with unit stride along K, got shape {tuple(x.shape)} strides {x.stride()}")
    M, K = x.shape
    pack = 32 // bits
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] * pack != K or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous int32 [K/{pack}={K // pack}, N], got {qweight.dtype} {tuple(qweight.shape)}")
    N = qweight.shape[1]
    if group_size <= 0 or K % group_size:
        raise ValueError(f"group_size={group_size} must divide K={K}")
    G = K // group_size
    if scales.shape != (G, N) or not scales.is_floating_point() or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous float [{G}, {N}], got {scales.dtype} {tuple(scales.shape)}")
    if zeros.shape != (G, N) or zeros.dtype != torch.int16 or not zeros.is_contiguous():
        raise ValueError(f"zeros must be contiguous int16 [{G}, {N}], got {zeros.dtype} {tuple(zeros.shape)}")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{N}], got {tuple(bias.shape)}")
    allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if x.device.type == "cpu" else ())
    if x.dtype not in allowed:
        raise ValueError(f"x must be one of {allowed}, got {x.dtype}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if M == 0 or N == 0:  # nothing to compute (torch.matmul's empty result; no kernel takes an empty grid)
        return x.new_empty((M, N))
    cfg = config or default_config(M, N, K, group_size, x.device, bits, x.dtype)
    if cfg.block_k % pack:
        raise ValueError(f"config.block_k={cfg.block_k} must be a multiple of {pack}")
    if cfg.algo == W4A16Algo.GEMV and cfg.block_m != 1:
        raise ValueError(f"config {cfg}: the GEMV needs block_m == 1")
    if cfg.algo == W4A16Algo.GEMV and (M != 1 or group_size % pack):
        raise ValueError(f"config {cfg}: the GEMV needs M == 1 (got {M}) and group_size % {pack} == 0 (got {group_size})")
    tensor_cores = cfg.algo in (W4A16Algo.DOT, W4A16Algo.DOT_SWAP)
    if x.is_cuda and tensor_cores and (cfg.block_m < 16 or cfg.block_k // pack < 16):
        raise ValueError(f"config {cfg}: tl.dot needs block_m >= 16 and block_k // {pack} >= 16")
    if x.is_cuda and cfg.algo in (W4A16Algo.TC, W4A16Algo.TC_ASM) and cfg.block_m < 8:
        raise ValueError(f"config {cfg}: tl.dot needs block_m >= 8 here (a wgmma of N = 8)")  # block_k: _launch_tc

    if cfg.algo == W4A16Algo.DEQUANT_MATMUL:
        # NOTE: a [K, N] scratch weight per call (from the caching allocator); meant for prefill-sized M
        w = torch.empty((K, N), dtype=x.dtype, device=x.device)
        _kernel_for(x.device, "_dequant_kernel_fn")[(triton.cdiv(K, cfg.block_k), triton.cdiv(N, cfg.block_n))](
            qweight, scales, zeros, w, N, K, BITS=bits, GROUP_SIZE=group_size, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        out = x @ w
        return out + bias.to(x.dtype) if bias is not None else out

    if cfg.algo == W4A16Algo.GEMV:
        return _launch_gemv(x, qweight, scales, zeros, bits, group_size, bias, cfg)
    if cfg.algo in (W4A16Algo.TC, W4A16Algo.TC_ASM):
        return _launch_tc(x, qweight, scales, zeros, bits, group_size, bias, cfg)

    kernel = _kernel_for(x.device)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    num_tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
    if cfg.split_k > 1:
        ws, locks = _WORKSPACE.get(x.device, M * N, num_tiles)
    else:
        ws, locks = out, out  # unused
    # grid: one program per (output tile, K slice); tiles enumerate N-major (see the kernel)
    grid = (num_tiles, cfg.split_k)
    kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else out, out, ws, locks,
        M, N, K, x.stride(0), out.stride(0),
        BITS=bits, GROUP_SIZE=group_size, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, ALGO=_ALGO_ID[cfg.algo],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _launch_gemv(x, qweight, scales, zeros, bits, group_size, bias, cfg: W4A16Config) -> torch.Tensor:
    """``w4a16_matmul``'s launch of ``W4A16Algo.GEMV`` (arguments already validated there): ``[1, N]`` out."""
    K, N = x.shape[1], qweight.shape[1]
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    num_tiles = -(-N // cfg.block_n)
    ws, locks = _WORKSPACE.get(x.device, N, num_tiles) if cfg.split_k > 1 else (out, out)  # unused without split-K
    # grid: one program per (column tile, K slice)
    _kernel_for(x.device, "_gemv_kernel_fn")[(num_tiles, cfg.split_k)](
        x, qweight, scales, zeros, bias if bias is not None else out, out, ws, locks, N, K,
        BITS=bits, GROUP_SIZE=group_size, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, PREFETCH=cfg.prefetch, EVEN_K=K % cfg.block_k == 0, EVEN_N=N % cfg.block_n == 0,
        FOLD_EXP=cfg.fold_exp, BIASED_FMA=cfg.biased_fma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _launch_tc(x, qweight, scales, zeros, bits, group_size, bias, cfg: W4A16Config) -> torch.Tensor:
    """``w4a16_matmul``'s launch of ``W4A16Algo.TC`` / ``TC_ASM`` (other arguments validated there): ``[M, N]`` out.

    Raises:
        ValueError: ``bits != 4``, a K step that spans two groups (``group_size`` neither a multiple of
            ``block_k`` nor ``K``), ``block_k < 16``, ``TC_ASM`` off CUDA or with fp32 ``x``.
    """
    M, K = x.shape
    N = qweight.shape[1]
    if bits != 4:
        raise ValueError(f"config {cfg}: {cfg.algo.value} takes 4-bit weights only, got bits={bits}")
    if group_size % cfg.block_k and group_size != K:
        raise ValueError(f"config {cfg}: {cfg.algo.value} needs group_size ({group_size}) a multiple of block_k or K ({K})")
    if cfg.block_k < 16 or cfg.block_n < 16 or (cfg.tc_perm and cfg.block_k % 32):
        raise ValueError(f"config {cfg}: tl.dot needs block_k >= 16 and block_n >= 16; tc_perm block_k % 32 == 0")
    if cfg.algo == W4A16Algo.TC_ASM and (not x.is_cuda or x.dtype == torch.float32):
        raise ValueError(f"config {cfg}: tc_asm is inline PTX: CUDA and fp16/bf16 x only (got {x.device}, {x.dtype})")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    num_tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
    ws, locks = _WORKSPACE.get(x.device, M * N, num_tiles) if cfg.split_k > 1 else (out, out)  # unused without split-K
    # grid: one program per (output tile, K slice); tiles enumerate N-major
    _kernel_for(x.device, "_tc_kernel_fn")[(num_tiles, cfg.split_k)](
        x, qweight, scales, zeros, bias if bias is not None else out, out, ws, locks, M, N, K, x.stride(0), out.stride(0),
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, USE_ASM=cfg.algo == W4A16Algo.TC_ASM,
        EVEN_K=K % cfg.block_k == 0, PERMUTE_K=cfg.tc_perm, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


# -- torch.compile -----------------------------------------------------------------------------------


@torch.library.custom_op("paged_transformers::w4a16_matmul", mutates_args=())
def w4a16_matmul_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``w4a16_matmul`` with the default config, as the custom op ``torch.ops.paged_transformers.w4a16_matmul``.

    Dynamo keeps it as one opaque node of a compiled graph instead of tracing the Python validation, the
    Triton launch and the split-K workspace (``_WORKSPACE``, hidden state the compiler must not see); its
    fake implementation gives the ``[M, N]`` output in ``x.dtype``. Arguments, result and errors as
    ``w4a16_matmul``.
    """
    return w4a16_matmul(x, qweight, scales, zeros, bits, group_size, bias)


@w4a16_matmul_op.register_fake
def _w4a16_matmul_fake(x, qweight, scales, zeros, bits, group_size, bias=None):
    return x.new_empty((x.shape[0], qweight.shape[1]))
