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
it loads ``BLOCK_K // pack`` packed rows, unpacks them in registers (shift, mask, reshape to
``[BLOCK_K, BLOCK_N]``), dequantizes in fp32 (exact: an fp16 scale times an integer of at most
9 bits fits fp32's 24-bit mantissa), casts to the activation dtype and accumulates in fp32, either
with ``tl.dot`` (tensor cores) or, for a handful of rows, with broadcast FMAs + a reduction.

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


# -- Triton kernel -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class W4A16Config:
    """Launch configuration of the W4A16 kernel.

    ``BLOCK_K`` must be a multiple of ``32 // bits``; ``use_dot=False`` (broadcast FMA + reduction)
    suits ``BLOCK_M <= 4``; ``split_k > 1`` makes ``split_k`` programs share each output tile.
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True


if triton is not None:

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
        USE_DOT: tl.constexpr,
    ):
        PACK: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        tl.static_assert(BLOCK_K % PACK == 0)
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        # N-major tile order: the M-tiles of one weight tile are neighbours (weight read once from HBM)
        pid_m = pid % num_m
        pid_n = pid // num_m

        k_iters = tl.cdiv(K, BLOCK_K)
        iters_per_split = tl.cdiv(k_iters, SPLIT_K)
        it_start = pid_k * iters_per_split
        it_end = tl.minimum(it_start + iters_per_split, k_iters)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_kp = tl.arange(0, BLOCK_K // PACK)
        shifts = tl.arange(0, PACK) * BITS
        mask_m = offs_m < M
        mask_n = offs_n < N
        Kp = K // PACK
        G = K // GROUP_SIZE

        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for it in range(it_start, it_end):
            k0 = it * BLOCK_K
            kk = k0 + offs_k
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                mask=mask_m[:, None] & (kk[None, :] < K),
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            kp = k0 // PACK + offs_kp
            p = tl.load(
                qw_ptr + kp[:, None] * N + offs_n[None, :],
                mask=(kp[:, None] < Kp) & mask_n[None, :],
                other=0,
            )  # [BLOCK_K // PACK, BLOCK_N]
            q = (p[:, None, :] >> shifts[None, :, None]) & MASK  # [BLOCK_K // PACK, PACK, BLOCK_N]
            q = tl.reshape(q, [BLOCK_K, BLOCK_N]).to(tl.float32)  # row k0 + i*PACK + j
            if GROUP_SIZE % BLOCK_K == 0:
                # the whole tile lies in one group: one scale row
                g = k0 // GROUP_SIZE
                s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)
                w = (q - z[None, :]) * s[None, :]
            elif BLOCK_K % GROUP_SIZE == 0:
                # whole groups per tile: [BLOCK_K // GROUP_SIZE, BLOCK_N] scale rows, broadcast
                GPT: tl.constexpr = BLOCK_K // GROUP_SIZE
                gg = k0 // GROUP_SIZE + tl.arange(0, GPT)
                gmask = (gg[:, None] < G) & mask_n[None, :]
                s = tl.load(s_ptr + gg[:, None] * N + offs_n[None, :], mask=gmask, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + gg[:, None] * N + offs_n[None, :], mask=gmask, other=0).to(tl.float32)
                q3 = tl.reshape(q, [GPT, GROUP_SIZE, BLOCK_N])
                w = tl.reshape((q3 - z[:, None, :]) * s[:, None, :], [BLOCK_K, BLOCK_N])
            else:
                # general case (e.g. per-channel with K % BLOCK_K != 0): a group index per row
                g = kk // GROUP_SIZE
                gmask = (kk[:, None] < K) & mask_n[None, :]
                s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=gmask, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=gmask, other=0).to(tl.float32)
                w = (q - z) * s
            if USE_DOT:
                acc += tl.dot(x, w.to(x.dtype))
            else:
                xw = x.to(tl.float32)[:, :, None] * w.to(x.dtype).to(tl.float32)[None, :, :]
                acc += tl.sum(xw, axis=1)

        mask_out = mask_m[:, None] & mask_n[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)
        else:
            ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
            tl.atomic_add(ws_ptrs, acc, mask=mask_out)
            # every thread's partial must be in before this program counts itself as arrived
            tl.debug_barrier()
            arrived = tl.atomic_add(lock_ptr + pid, 1)
            if arrived == SPLIT_K - 1:
                # last program of this tile: take the sum and leave zeros behind for the next call
                zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                total = tl.atomic_add(ws_ptrs, zero, mask=mask_out)  # an L2-coherent read of the sum
                tl.store(ws_ptrs, zero, mask=mask_out)
                if HAS_BIAS:
                    total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask_out)
                tl.atomic_xchg(lock_ptr + pid, 0)

    _w4a16_kernel = triton.jit(_w4a16_kernel_fn)
    _interpreted_kernel = None


def _kernel_for(device: torch.device):
    """The compiled kernel on CUDA; on CPU the Triton interpreter (needs ``TRITON_INTERPRET=1``)."""
    global _interpreted_kernel
    if device.type == "cuda":
        return _w4a16_kernel
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"w4a16_matmul needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 or use w4a16_matmul_ref")
    if _interpreted_kernel is None:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreted_kernel = InterpretedFunction(_w4a16_kernel_fn)
    return _interpreted_kernel


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

def default_config(M: int, N: int, K: int, group_size: int, device: torch.device) -> W4A16Config:
    """The launch configuration used when none is given: the fastest of the sweep in
    ``benchmarks/bench_w4a16.py`` on an H200 (BENCHMARKS.md, "W4A16 / quantized"), as a rule.

    * M = 1: broadcast-FMA GEMV (no tensor cores), split-K 8 with 32x256 tiles (4-8 with 64x128 when
      N >= 8192);
    * 2 <= M <= 16: 16x64x128 ``tl.dot`` tiles, split-K 8 while there are at most 96 output tiles
      (N <= 6144), else 4, so that each SM has several programs streaming weights;
    * M > 16: no split; 64x128x64 tiles, 128x128x64 when N >= 8192 (and M > 64).

    Args/Returns: the GEMM sizes (``x [M, K] @ W [K, N]``) -> a ``W4A16Config``. ``group_size`` and
    ``device`` are accepted for future rules; the choice does not depend on them yet.
    """
    if M == 1:
        if N >= 8192:
            return W4A16Config(1, 64, 128, 4, num_warps=4, num_stages=3, use_dot=False)
        return W4A16Config(1, 32, 256, 8, num_warps=4, num_stages=3, use_dot=False)
    if M <= 16:
        tiles = -(-N // 64)
        return W4A16Config(16, 64, 128, 8 if tiles <= 96 else 4, num_warps=4, num_stages=4)
    if M > 64 and N >= 8192:
        return W4A16Config(128, 128, 64, 1, num_warps=4, num_stages=4)
    return W4A16Config(64, 128, 64, 1, num_warps=4, num_stages=4)


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
        ``[M, N]`` in ``x.dtype``.

    Raises:
        ValueError: a wrong dtype, device, shape or stride (the offending tensor is named), or CPU
            tensors without ``TRITON_INTERPRET=1``.
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
    kernel = _kernel_for(x.device)
    cfg = config or default_config(M, N, K, group_size, x.device)
    if cfg.block_k % pack:
        raise ValueError(f"config.block_k={cfg.block_k} must be a multiple of {pack}")

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
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, USE_DOT=cfg.use_dot,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
