"""W4A16 tiled GEMM for prefill-sized M: one dequantized ``[BLOCK_K, BLOCK_N]`` weight tile per K step, ONE
``tl.dot`` with the contiguous ``[BLOCK_M, BLOCK_K]`` activation tile (wgmma on sm_90).

Same function and packed layout as ``kernels/w4a16.py`` (see its docstring; nothing is re-laid out)::

    qweight  int32 [K // pack, N]   packed along K, low bits first: q[k, n] = (qweight[k // pack, n] >> bits*(k % pack)) & mask
    scales   [G, N] float;  zeros int16 [G, N];   W[k, n] = (q[k, n] - zeros[k // gs, n]) * scales[k // gs, n]
    out[m, n] = sum_k x[m, k] * W[k, n] (+ bias[n])

Why not ``w4a16.py``'s DOT: it issues ``pack`` small dots per K step (``K = BLOCK_K / pack`` each) with
stride-``pack`` activation loads, 0.05-0.2x of bf16 at M = 256 on the H200 (issue 7, round 1). Here:

* **Weight tile without per-field dots** (GemLite's int32-packing GEMM, mobiusml/gemlite): row ``k`` of the
  tile loads the word ``qweight[k // pack, n]`` (``pack`` rows share a word; the repeats are served by L1 or,
  when the compiler loads it in the dot-operand layout, by the same register) and shifts it by
  ``bits * (k % pack)``. ``UNPACK = 1`` instead loads each packed row once (``[BLOCK_K // pack, BLOCK_N]``) and
  expands it by a broadcast shift + reshape (``UNPACK = 2``: by ``tl.join`` copies, which
  keep a word's fields in one thread); which one Triton lays out better is measured, not assumed.
* **Exact dequant**: ``(q - z) * s`` in fp32 with the magic-number int -> float (OR the field into the
  mantissa of ``2**23``, subtract ``2**23 + z``: exact), one rounding to the activation dtype; the same
  weight the reference ``w4a16_matmul_ref`` feeds its matmul. Scale/zero rows are loaded once per K step when
  the tile lies in one group (``group_size % BLOCK_K == 0``), else gathered per row (group 32 < BLOCK_K).
* **Operand order**: ``SWAP = 0``: ``acc[BM, BN] += x @ w`` (the weight goes through shared memory as wgmma's
  B operand). ``SWAP = 1``: ``acc[BN, BM] += w^T @ x^T``, the dequantized weight is the left operand, which
  wgmma may read straight from registers, and BLOCK_M (tokens) is wgmma's N (up to 256), so one dequantized
  tile serves up to 256 tokens.
* **Tile order**: grouped (Triton's matmul tutorial): ``GROUP_M`` M-tiles walk the N tiles together, so a
  weight tile is read from HBM once per group and the group's activation rows stay in L2.
* **Split-K** (``SPLIT_K > 1``) for grids smaller than the SMs (M = 256 has few M-tiles): the serial
  split-K with a per-tile semaphore of ``w4a16.py`` (fp32 atomics into a zeroed workspace, the last
  program writes the output and re-zeroes), on the same shared ``_WORKSPACE``.

``w4a16_tiled_matmul`` is the launcher; ``w4a16_matmul_ref`` (``kernels/w4a16.py``) is the reference.
"""

import os
from dataclasses import dataclass

import torch

from .w4a16 import _WORKSPACE, _num_sms, w4a16_matmul_ref  # noqa: F401 (the reference of this kernel, re-exported)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path still works
    triton = None
    tl = None


@dataclass(frozen=True, slots=True)
class TiledConfig:
    """Launch configuration of ``w4a16_tiled_matmul``.

    ``block_k`` must be a multiple of ``32 // bits``; on CUDA ``block_m, block_n, block_k >= 16`` (tl.dot).
    ``group_m``: M-tiles per group of the grouped tile order. ``split_k``: programs per output tile.
    ``swap``: compute ``(W^T x^T)^T`` (weight as the left MMA operand). ``unpack``: 0 = one word load per tile
    row (GemLite), 1 = packed rows loaded once and expanded by a broadcast + reshape, 2 = the same by joins.

    Raises:
        ValueError: a non-positive size or an unknown ``unpack``.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False
    unpack: int = 0

    def __post_init__(self):
        if min(self.block_m, self.block_n, self.block_k, self.group_m, self.split_k, self.num_warps, self.num_stages) < 1:
            raise ValueError(f"TiledConfig sizes must be positive, got {self!r}")
        if self.unpack not in (0, 1, 2):
            raise ValueError(f"TiledConfig.unpack must be 0, 1 or 2, got {self.unpack}")

    def __str__(self) -> str:
        return (f"tiled{'_swap' if self.swap else ''}{'_u' + str(self.unpack) if self.unpack else ''} {self.block_m}x{self.block_n}x{self.block_k} "
                f"g{self.group_m} split{self.split_k} w{self.num_warps} s{self.num_stages}")  # fmt: skip


def default_tiled_config(M: int, N: int, K: int, num_sms: int = 132) -> TiledConfig:
    """A starting config until the H200 sweep of ``benchmarks/bench_w4a16_tiled.py`` decides: 128x128x64 tiles
    (64x128 for M <= 64), the weight tile unpacked by joins (``unpack=2``: in the sm_90 TTGIR of triton 3.9 every
    load of the loop is then a cp.async stage and the tile reaches shared memory by 16-byte stores), and split-K
    when the output tiles cannot fill the SMs (``num_sms // tiles`` programs per tile, at least 4 K steps each).

    Args: the GEMM sizes (``x [M, K] @ W [K, N]``), SMs of the device. Returns: a ``TiledConfig``.
    """
    bm, warps, stages = (64, 4, 4) if M <= 64 else (128, 8, 3)
    tiles = -(-M // bm) * -(-N // 128)
    split = max(1, min(-(-K // 64) // 4, num_sms // tiles))
    return TiledConfig(bm, 128, 64, 8, split, warps, stages, swap=False, unpack=2)


if triton is not None:

    @triton.jit
    def _dequant_tile(
        qw_ptr, s_ptr, z_ptr, k0, offs_n, mask_n, N, K, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNPACK: tl.constexpr, OUT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        """The weight rows ``k0 .. k0 + BLOCK_K`` as ``OUT_DTYPE [BLOCK_K, BLOCK_N]``, zero past ``K``.

        ``(q - z) * s`` exactly in fp32: ``q | 0x4B000000`` read as fp32 is ``2**23 + q`` (exact), minus
        ``2**23 + z`` leaves ``q - z``, times ``s``; then the one rounding to ``OUT_DTYPE``.
        """
        PACK: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        if UNPACK == 0:
            # GemLite: each tile row loads its own word (PACK rows load the same one)
            p = tl.load(qw_ptr + (offs_k // PACK)[:, None] * N + offs_n[None, :], mask=mask_k[:, None] & mask_n[None, :], other=0)
            q = (p >> ((offs_k % PACK) * BITS)[:, None]) & MASK
        else:
            offs_kp = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            p = tl.load(qw_ptr + offs_kp[:, None] * N + offs_n[None, :], mask=(offs_kp < K // PACK)[:, None] & mask_n[None, :], other=0)
            shifts = tl.arange(0, PACK) * BITS
            if UNPACK == 1:  # broadcast along a new middle dim
                q3 = (p[:, None, :] >> shifts[None, :, None]) & MASK  # [BLOCK_K // PACK, PACK, BLOCK_N]
            else:  # UNPACK == 2: replicate with joins (the copies stay in the same thread), then move the dim
                p8 = tl.join(p, p)
                p8 = tl.join(p8, p8)
                if PACK == 8:
                    p8 = tl.join(p8, p8)
                p8 = tl.reshape(p8, (BLOCK_K // PACK, BLOCK_N, PACK))
                q3 = tl.permute((p8 >> shifts[None, None, :]) & MASK, (0, 2, 1))
            q = tl.reshape(q3, (BLOCK_K, BLOCK_N))
        f = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + q
        if GROUP_SIZE % BLOCK_K == 0:  # the tile lies in one group: one scale/zero row
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)[None, :]
        else:
            gmask = mask_k[:, None] & mask_n[None, :]
            g_off = (offs_k // GROUP_SIZE)[:, None] * N + offs_n[None, :]
            s = tl.load(s_ptr + g_off, mask=gmask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g_off, mask=gmask, other=0).to(tl.float32)
        # past K (or N): s = 0 there, so the tile is 0 (x is masked to 0 too)
        return ((f - (8388608.0 + z)) * s).to(OUT_DTYPE)  # 8388608 = 2**23

    def _w4a16_tiled_kernel_fn(
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
        SPLIT_K,  # programs per output tile (a runtime int: one compile serves every split)
        BITS: tl.constexpr,
        GROUP_SIZE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        SPLIT: tl.constexpr,  # SPLIT_K > 1
        SWAP: tl.constexpr,
        UNPACK: tl.constexpr,
    ):
        tl.static_assert(BLOCK_K % (32 // BITS) == 0)
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        # grouped order (Triton's matmul tutorial): GROUP_M M-tiles share each weight tile while it is in L2
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows

        k_iters = tl.cdiv(K, BLOCK_K)
        iters_per_split = tl.cdiv(k_iters, SPLIT_K)
        it_start = pid_k * iters_per_split
        it_end = tl.minimum(it_start + iters_per_split, k_iters)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        # rows past M read row M - 1 (unmasked loads; their outputs are not stored)
        offs_xm = tl.minimum(offs_m, M - 1)
        offs_kb = tl.arange(0, BLOCK_K)

        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for it in range(it_start, it_end):
            k0 = it * BLOCK_K
            kk = k0 + offs_kb
            x = tl.load(x_ptr + offs_xm[:, None] * stride_xm + kk[None, :], mask=(kk < K)[None, :], other=0.0)
            w = _dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, mask_n, N, K, BITS, GROUP_SIZE, BLOCK_N, BLOCK_K, UNPACK,
                              x_ptr.dtype.element_ty)
            if SWAP:
                acc = tl.dot(tl.trans(w), tl.trans(x), acc)
            else:
                acc = tl.dot(x, w, acc)
        if SWAP:
            acc = tl.trans(acc)

        mask_out = mask_m[:, None] & mask_n[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        if not SPLIT:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)
        else:
            # serial split-K with a semaphore, as kernels/w4a16.py (see its NOTE on the relaxed partial sums)
            ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
            tl.atomic_add(ws_ptrs, acc, mask=mask_out, sem="relaxed")
            tl.debug_barrier()
            arrived = tl.atomic_add(lock_ptr + pid, 1)
            if arrived == SPLIT_K - 1:
                zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                total = tl.atomic_add(ws_ptrs, zero, mask=mask_out, sem="relaxed")  # an L2-coherent read of the sum
                tl.store(ws_ptrs, zero, mask=mask_out)
                if HAS_BIAS:
                    total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask_out)
                tl.atomic_xchg(lock_ptr + pid, 0)

    _w4a16_tiled_kernel = triton.jit(_w4a16_tiled_kernel_fn)
    _interpreted: dict = {}


def _kernel_for(device: torch.device):
    """The compiled kernel on CUDA; on CPU the Triton interpreter (needs ``TRITON_INTERPRET=1``)."""
    if device.type == "cuda":
        return _w4a16_tiled_kernel
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"w4a16_tiled_matmul needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 or use w4a16_matmul_ref")
    if "k" not in _interpreted:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreted["k"] = InterpretedFunction(_w4a16_tiled_kernel_fn)
    return _interpreted["k"]


def w4a16_tiled_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: TiledConfig | None = None,
) -> torch.Tensor:
    """Fused dequantize + matmul ``x @ W (+ bias)`` with the tiled kernel (meant for M >= 17).

    Args:
        x: ``[M, K]`` fp16 or bf16 (or fp32 under the interpreter), unit stride along K.
        qweight: int32 ``[K // (32 // bits), N]``, contiguous (layout in the module docstring).
        scales: ``[K // group_size, N]`` fp16/bf16/fp32, contiguous.
        zeros: int16 ``[K // group_size, N]``, contiguous.
        bits: 4 or 8.
        group_size: input rows per group, dividing K (pass K for per-channel / ``group_size=-1``).
        bias: optional ``[N]``.
        config: a ``TiledConfig``; default ``default_tiled_config(M, N, K, SMs)``.

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Raises:
        ValueError: a wrong dtype, device, shape or stride (the offending tensor is named), a config the
            kernel cannot run, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if triton is None:
        raise ValueError("w4a16_tiled_matmul needs triton; use w4a16_matmul_ref")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[0] == 0:
        raise ValueError(f"x must be [M >= 1, K] with unit stride along K, got shape {tuple(x.shape)} strides {x.stride()}")
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
    cfg = config or default_tiled_config(M, N, K, _num_sms(x.device))
    if cfg.block_k % pack:
        raise ValueError(f"config.block_k={cfg.block_k} must be a multiple of {pack}")
    if x.is_cuda and min(cfg.block_m, cfg.block_n, cfg.block_k) < 16:
        raise ValueError(f"config {cfg}: tl.dot needs block_m, block_n, block_k >= 16")

    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    num_tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
    if cfg.split_k > 1:
        ws, locks = _WORKSPACE.get(x.device, M * N, num_tiles)
    else:
        ws, locks = out, out  # unused
    # grid: one program per (output tile, K slice); tiles in grouped order (see the kernel)
    _kernel_for(x.device)[(num_tiles, cfg.split_k)](
        x, qweight, scales, zeros, bias if bias is not None else out, out, ws, locks,
        M, N, K, x.stride(0), out.stride(0), cfg.split_k,
        BITS=bits, GROUP_SIZE=group_size, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SPLIT=cfg.split_k > 1, SWAP=cfg.swap, UNPACK=cfg.unpack,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
