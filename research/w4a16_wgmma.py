"""Issue 23: a W4A16 GEMM for M = 16-256 written in Gluon (Triton's explicit-layout dialect) so that the
dequantization of one K step overlaps the tensor cores' work on the previous one.

Why Gluon: the product's Triton kernels issue one wgmma per K step and wait for it at once (triton 3.6 lowers a
``tl.dot`` whose operand was computed in registers with ``pendings = 0``), so the dequantization and the tensor cores
take turns. Here every step runs

    1. wait on the step's mbarrier for its TMA copies (x tile, packed weight words, scales, zero points; ``STAGES``
       deep, issued ``STAGES - 1`` steps ahead);
    2. dequantize the ``[BLOCK_N, BLOCK_K]`` weight tile in registers while the previous step's wgmma still runs:
       per int32 word one inline-PTX block (FasterTransformer/Marlin's LOP3 magic-number pairs give ``q - z``
       exactly, then ``(q - z) * s`` in fp32 rounded once to bf16, as ``w4a16_matmul_ref`` rounds; ``FAST``: the
       scale rounded to bf16 first and one ``mul.bf16x2`` per pair), eight consecutive K values of one column, one
       16-byte store into a 128B-swizzled shared tile, lanes on consecutive columns (no bank conflicts);
    3. fence the generic-proxy stores, issue the wgmma ``x [BLOCK_M, BLOCK_K] @ W^T`` (both operands in shared
       memory, W K-major) asynchronously, wait only for the one before it (``warpgroup_mma_wait(1)``), then issue the
       copies of step ``i + STAGES - 1`` into the slot that wgmma freed.

x is read in its own K order (no permutation, no repack): the weight tile goes through shared memory instead of being
the register operand, one 16-byte store per 8 weights. Step 0 runs before the loop (``use_acc=False``): a zeroed
accumulator reaching the last wait made ptxas serialize every wgmma (its C7515 note).

    TRITON_INTERPRET is not supported by Gluon. On the CPU machine (no GPU; torch and triton 3.6, the device's, or later):
    python research/w4a16_wgmma.py --compile-only          # sm_90: registers, spills, shared memory, SASS mix
    python -m pytest research/test_w4a16_wgmma.py           # the same compiles, asserted
    On the GPU:
    python research/w4a16_wgmma.py --out $OUT/w4a16_wgmma.json   # check against the reference, then the sweep
    python research/w4a16_wgmma.py --quick --out ...            # 5 configs, gate|up and down, M = 64 / 128 / 256

Prints a table last: per (shape, M) bf16 matmul, the product default and the best config of this kernel (us per call,
CUDA-graph clock over weight sets of > 4x L2, as ``benchmarks/bench_w4a16.py``). ``research/w4a16_wgmma_e2e.py`` runs
the workload of record with the sweep's winners in the engine.

NOTE (H100, 2026-12-06; BENCHMARKS.md, issue 23): with cp.async copies (a ``fence.proxy.async`` after each wait,
which ptxas compiles to ``MEMBAR.ALL.CTA`` and which may wait for the thread's outstanding copies; not measured apart)
the workload ran at 0.96x of the product's GPTQ, with TMA copies at 1.05x. Nsight Compute then showed the weight
tile's stores 4-way bank-conflicted (lanes 4 columns apart) and the zero points converted by I2F in the loop; without
both, gate|up at M = 128 took 60.3 us against bf16's 83.8 and the product's 195.7 (M = 256: 119.6 / 97.8 / 212.8).
That version has not run end to end. Split-K there added the partials into a ``torch.zeros`` workspace and cast
after (two more kernels per call); it is now serial in the same launch (the product's ``matmul._WORKSPACE``),
compiled but not yet run.
"""

import argparse
import json
import os
import sys
import time

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

# TMA global -> shared copy: ``async_copy_global_to_shared`` in triton 3.6 (the device's), renamed ``async_load`` later
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# a CTA-wide barrier: ``thread_barrier`` in 3.6, ``barrier`` later
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


def _dequant_asm(magic_pair: int, dtype: str) -> str:
    """PTX: int32 ``$8`` (8 fields), ``$9`` = ``B + z`` in both 16-bit halves, ``$10`` = fp32 scale ->
    ``$0..$7`` = ``(q_j - z) * s`` in ``dtype``: "bf16" rounds once (products in fp32), "fp16" too (``mul.rn.f16x2``
    of two exact operands), "bf16_fast" twice (the scale to bf16, then ``mul.rn.bf16x2``)."""
    lines = ["{", ".reg .b32 sh, t0, t1, t2, t3, lo, hi, sp;", "shr.u32 sh, $8, 4;"]
    lines += [f"prmt.b32 t{i}, $8, sh, {(4 + i) << 8 | i:#06x};" for i in range(4)]
    lines += [f"lop3.b32 t{i}, t{i}, 0x000F000F, {magic_pair:#010x}, 0xEA;" for i in range(4)]
    if dtype == "bf16_fast":  # the scale rounded to bf16 first, then one mul.bf16x2 per pair (two roundings)
        lines += [".reg .b16 sh16;", "cvt.rn.bf16.f32 sh16, $10;", "mov.b32 sp, {sh16, sh16};"]
        for i in range(4):
            lines += [f"sub.bf16x2 t{i}, t{i}, $9;", f"mul.rn.bf16x2 t{i}, t{i}, sp;"]
    elif dtype == "bf16":
        for i in range(4):
            lines += [f"sub.bf16x2 t{i}, t{i}, $9;", f"shl.b32 lo, t{i}, 16;", f"and.b32 hi, t{i}, 0xFFFF0000;",
                      "mul.rn.f32 lo, lo, $10;", "mul.rn.f32 hi, hi, $10;", f"cvt.rn.bf16x2.f32 t{i}, hi, lo;"]
    else:
        lines += [".reg .b16 sh16;", "cvt.rn.f16.f32 sh16, $10;", "mov.b32 sp, {sh16, sh16};"]
        for i in range(4):
            lines += [f"sub.f16x2 t{i}, t{i}, $9;", f"mul.rn.f16x2 t{i}, t{i}, sp;"]
    lines += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, t{i};" for i in range(4)]
    return "\n".join(lines + ["}"])


_ASM_BF16 = gl.constexpr(_dequant_asm(0x43004300, "bf16"))
_ASM_FP16 = gl.constexpr(_dequant_asm(0x64006400, "fp16"))
_ASM_BF16_FAST = gl.constexpr(_dequant_asm(0x43004300, "bf16_fast"))


@gluon.constexpr_function
def _mma_warps(BLOCK_M, num_warps):
    """``warps_per_cta`` of the accumulator: 16-row warps stacked along M while rows remain, then along N."""
    w = [4, 1]
    while w[0] * w[1] != num_warps:
        if BLOCK_M > 16 * w[0]:
            w[0] *= 2
        else:
            w[1] *= 2
    return w


@gluon.constexpr_function
def _instr_n(BLOCK_M, BLOCK_N, num_warps):
    """The largest wgmma N (a multiple of 8, <= 256) that divides the warps' share of ``BLOCK_N``."""
    w = _mma_warps(BLOCK_M, num_warps)
    max_n = max(BLOCK_N // w[1], 8)
    n = 256
    while n > max_n or BLOCK_N % n:
        n -= 8
    return n


@gluon.constexpr_function
def _p_layout(BLOCK_N, TK, num_warps):
    """Layout of the packed words ``[BLOCK_N, TK]``: one column per lane, 32 consecutive columns per warp, warps along
    K while words remain, then along N. A thread's word becomes 8 consecutive K values of one column n, one 16-byte
    store into row n of the 128B-swizzled ``[BLOCK_N, BLOCK_K]`` tile; with lanes on consecutive rows every 8 stores
    of a warp hit distinct banks (4 columns per thread, lanes 4 rows apart, made them 4-way bank-conflicted: Nsight
    Compute, 2026-12-06)."""
    lanes_n = min(32, BLOCK_N)
    lanes_k = 32 // lanes_n
    warps_k = min(num_warps, max(TK // lanes_k, 1))
    return gl.BlockedLayout([1, 1], [lanes_n, lanes_k], [num_warps // warps_k, warps_k], [0, 1])


@gluon.jit
def _issue_copies(x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, bars, slot, k0, off_m, off_n,
                  GROUP_SIZE: gl.constexpr):
    """TMA copies of one K step into ring slot ``slot``, completing on ``bars[slot]`` (rows of x past M read as 0)."""
    bar = bars.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + p_desc.block_type.nbytes + s_desc.block_type.nbytes
                    + z_desc.block_type.nbytes)
    _tma_load(x_desc, [off_m, k0], bar, x_smem.index(slot))
    _tma_load(p_desc, [k0 // 8, off_n], bar, p_smem.index(slot))
    _tma_load(s_desc, [k0 // GROUP_SIZE, off_n], bar, s_smem.index(slot))
    _tma_load(z_desc, [k0 // GROUP_SIZE, off_n], bar, z_smem.index(slot))


@gluon.jit
def _step(x_desc, p_desc, s_desc, z_desc, x_smem, w_smem, p_smem, s_smem, z_smem, bars, i, acc, use_acc, n_steps,
          k_begin, off_m, off_n, GROUP_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          STAGES: gl.constexpr, P_LAYOUT: gl.constexpr, FAST: gl.constexpr):
    """K step ``i``: wait for its copies, dequantize its weight tile into ``w_smem[i % 2]`` while wgmma ``i - 1``
    runs, issue wgmma ``i``, wait for wgmma ``i - 1``, issue the copies of step ``i + STAGES - 1``."""
    DT: gl.constexpr = x_desc.dtype
    MAGIC_BITS: gl.constexpr = 0x4300 if DT == gl.bfloat16 else 0x6400
    slot = i % STAGES
    mbarrier.wait(bars.index(slot), phase=(i // STAGES) & 1)
    pbuf = p_smem.index(slot).permute((1, 0))
    p = pbuf.load(P_LAYOUT)  # int32 [BLOCK_N, BLOCK_K // 8]
    sv = s_smem.index(slot).permute((1, 0)).load(P_LAYOUT).to(gl.float32)  # [BLOCK_N, 1]
    zv = z_smem.index(slot).permute((1, 0)).load(P_LAYOUT).to(gl.int32)
    zb = zv | MAGIC_BITS  # B + z in DT (0 <= z < 128: B's low mantissa bits are zero): integer ops only, no I2F
    zpair = zb | (zb << 16)
    if DT == gl.bfloat16 and FAST:
        f = gl.inline_asm_elementwise(_ASM_BF16_FAST, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, zpair, sv],
                                      (gl.bfloat16,) * 8, is_pure=True, pack=1)
    elif DT == gl.bfloat16:
        f = gl.inline_asm_elementwise(_ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, zpair, sv], (gl.bfloat16,) * 8,
                                      is_pure=True, pack=1)
    else:
        f = gl.inline_asm_elementwise(_ASM_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, zpair, sv], (gl.float16,) * 8,
                                      is_pure=True, pack=1)
    # fields j = 4a + 2b + c: three nested joins put j last, in order
    w = gl.join(gl.join(gl.join(f[0], f[4]), gl.join(f[2], f[6])), gl.join(gl.join(f[1], f[5]), gl.join(f[3], f[7])))
    w = gl.reshape(w, [BLOCK_N, BLOCK_K])  # row n: the step's K values in order
    wbuf = w_smem.index(i % 2)
    gl.static_assert(gl.bank_conflicts(p.type, pbuf.type) == 0)
    gl.static_assert(gl.bank_conflicts(w.type, wbuf.type) == 0)
    wbuf.store(w)  # its last reader, wgmma i - 2, was waited for at the end of step i - 1 (in every warpgroup)
    fence_async_shared()  # generic-proxy stores before the async-proxy reads of the wgmma
    _barrier()
    acc = warpgroup_mma(x_smem.index(slot), wbuf.permute((1, 0)), acc, use_acc=use_acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # wgmma i - 1 is done: slot (i - 1) % STAGES is free
    if gl.num_warps() > 4:
        _barrier()  # ... in every warpgroup
    nxt = i + STAGES - 1
    if nxt < n_steps:
        _issue_copies(x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, bars, nxt % STAGES,
                      k_begin + nxt * BLOCK_K, off_m, off_n, GROUP_SIZE)
    return acc


@gluon.jit
def w4a16_wgmma_kernel(
    x_desc,  # TMA descriptor of x [M, K] bf16/fp16, block [BLOCK_M, BLOCK_K]
    p_desc,  # of qweight int32 [K // 8, N] (4-bit GPTQ layout), block [BLOCK_K // 8, BLOCK_N]
    s_desc,  # of scales fp16 [G, N], block [1, BLOCK_N]
    z_desc,  # of zero points int16 [G, N], block [1, BLOCK_N]
    out_ptr,  # [M, N] x.dtype
    ws_ptr,  # fp32 [M, N] workspace, zero between calls (SPLIT_K > 1)
    lock_ptr,  # int32 per-tile arrival counters, zero between calls (SPLIT_K > 1)
    M, N, K, stride_om,
    GROUP_SIZE: gl.constexpr,  # a multiple of BLOCK_K (or K): every K step lies in one group
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr,
    FAST: gl.constexpr,  # bf16 x: the scale rounded to bf16, one mul.bf16x2 per pair (else fp32, one rounding)
    num_warps: gl.constexpr,
):  # fmt: skip
    """``out = x @ dequant(W)`` for one ``[BLOCK_M, BLOCK_N]`` tile, the programs ``program_id(1)`` of a tile each
    taking one K slice (split-K); N % BLOCK_N == 0 and K % (BLOCK_K * SPLIT_K) == 0 (checked by the host)."""
    DT: gl.constexpr = x_desc.dtype
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BLOCK_M)
    off_m = (pid % num_m) * BLOCK_M  # M tiles of one N tile run next to each other: its packed weight is read once
    off_n = (pid // num_m) * BLOCK_N
    k_len = K // SPLIT_K
    k_begin = gl.program_id(1) * k_len
    n_steps = k_len // BLOCK_K

    TK: gl.constexpr = BLOCK_K // 8
    P_LAYOUT: gl.constexpr = _p_layout(BLOCK_N, TK, num_warps)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=_mma_warps(BLOCK_M, num_warps),
                                                  instr_shape=[16, _instr_n(BLOCK_M, BLOCK_N, num_warps), 16])
    x_smem = gl.allocate_shared_memory(DT, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    p_smem = gl.allocate_shared_memory(gl.int32, [STAGES, TK, BLOCK_N], p_desc.layout)
    s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES, 1, BLOCK_N], s_desc.layout)
    z_smem = gl.allocate_shared_memory(gl.int16, [STAGES, 1, BLOCK_N], z_desc.layout)
    w_smem = gl.allocate_shared_memory(DT, [2, BLOCK_N, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], DT))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)

    for s in gl.static_range(STAGES - 1):
        if s < n_steps:
            _issue_copies(x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, bars, s,
                          k_begin + s * BLOCK_K, off_m, off_n, GROUP_SIZE)

    # step 0 outside the loop (use_acc=False zeroes the accumulator): no path reaches the last wait with the
    # accumulator defined by anything but a wgmma, which would make ptxas serialize every wgmma (C7515)
    acc = _step(x_desc, p_desc, s_desc, z_desc, x_smem, w_smem, p_smem, s_smem, z_smem, bars, 0,
                gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=MMA), False, n_steps, k_begin, off_m, off_n,
                GROUP_SIZE, BLOCK_N, BLOCK_K, STAGES, P_LAYOUT, FAST)
    for i in range(1, n_steps):
        acc = _step(x_desc, p_desc, s_desc, z_desc, x_smem, w_smem, p_smem, s_smem, z_smem, bars, i, acc, True,
                    n_steps, k_begin, off_m, off_n, GROUP_SIZE, BLOCK_N, BLOCK_K, STAGES, P_LAYOUT, FAST)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    om = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    on = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    optr = out_ptr + gl.expand_dims(om, 1) * stride_om + gl.expand_dims(on, 0)
    omask = gl.expand_dims(om < M, 1)
    if SPLIT_K == 1:
        gl.store(optr, acc.to(DT), mask=omask)
    else:
        # serial split-K in one launch, as the product's _write_tile: relaxed fp32 adds into the zeroed workspace, then
        # the tile's arrival counter (acq_rel); the last program reads the sum back, leaves zeros and resets the counter
        wptr = ws_ptr + gl.expand_dims(om, 1) * N + gl.expand_dims(on, 0)
        gl.atomic_add(wptr, acc, mask=omask, sem="relaxed")
        _barrier()
        arrived = gl.atomic_add(lock_ptr + pid, 1)
        if arrived == SPLIT_K - 1:
            zero = gl.zeros_like(acc)
            total = gl.atomic_add(wptr, zero, mask=omask, sem="relaxed")  # an L2-coherent read of the sum
            gl.store(wptr, zero, mask=omask)
            gl.store(optr, total.to(DT), mask=omask)
            gl.atomic_xchg(lock_ptr + pid, 0)


# ---------------------------------------------------------------------------------------------------------------------
# host side (torch imported in the functions: the module imports with triton alone)

def wgmma_matmul(x, qweight, scales, zeros, group_size, block_m, block_n, block_k, stages, num_warps, fast=False,
                 split_k=1):
    """``x @ dequant(W)`` through ``w4a16_wgmma_kernel`` (4-bit, fp16 scales, int16 zeros).

    Args: x ``[M, K]`` bf16/fp16 contiguous; qweight int32 ``[K // 8, N]``; scales fp16 ``[G, N]``; zeros int16
        ``[G, N]``; tile sizes; ``fast`` (bf16 x: the scale rounded to bf16); ``split_k`` > 1: serial split-K in the
        same launch, through the product's zeroed fp32 workspace and per-tile counters (``matmul._WORKSPACE``).
    Returns: ``[M, N]`` in x.dtype.
    Raises: ValueError when the shape does not fit the tiles (N % block_n, K % (block_k * split_k), group size).
    """
    import torch

    from paged_transformers.kernels.w4a16.matmul import _WORKSPACE

    M, K = x.shape
    N = qweight.shape[1]
    if N % block_n or K % (block_k * split_k) or (group_size % block_k and group_size != K):
        raise ValueError(f"shape M={M} N={N} K={K} g={group_size} does not fit {block_m}x{block_n}x{block_k} "
                         f"split {split_k}")
    grid = (triton.cdiv(M, block_m) * (N // block_n), split_k)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    # the product's split-K workspace and tile counters (zero between calls; the kernel leaves them so)
    ws, locks = _WORKSPACE.get(x.device, M * N, grid[0]) if split_k > 1 else (out, out)
    w4a16_wgmma_kernel[grid](*descriptors(x, qweight, scales, zeros, block_m, block_n, block_k), out, ws, locks, M, N, K,
                             out.stride(0), GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             STAGES=stages, SPLIT_K=split_k, FAST=fast, num_warps=num_warps)
    return out


def descriptors(x, qweight, scales, zeros, block_m, block_n, block_k):
    """Host TMA descriptors of the kernel's four inputs (128B-swizzled shared layouts as ``get_default_for`` picks)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t, block, dtype):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))

    dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    return (desc(x, [block_m, block_k], dt), desc(qweight, [block_k // 8, block_n], gl.int32),
            desc(scales, [1, block_n], gl.float16), desc(zeros, [1, block_n], gl.int16))


# (block_m, block_n, block_k, stages, num_warps, fast)
CANDIDATES = [
    (64, 64, 64, 4, 4, False), (64, 128, 128, 3, 4, False), (128, 128, 64, 3, 4, False), (128, 64, 64, 4, 4, False),
    (64, 64, 64, 4, 4, True), (64, 128, 128, 3, 4, True), (128, 128, 64, 3, 4, True), (128, 64, 64, 4, 4, True),
    (64, 128, 64, 3, 8, False), (64, 256, 64, 3, 8, False), (64, 128, 64, 3, 8, True), (64, 256, 64, 3, 8, True),
    (128, 256, 64, 3, 8, True), (256, 128, 64, 3, 8, True),
    (64, 128, 64, 4, 4, False),  # two CTAs per SM (84 KB of shared memory), where 64x128x128 fits one
]

# the winners of the H100 sweep of 2026-12-06 on the gate|up and down shapes
QUICK_CANDIDATES = [(64, 128, 128, 3, 4, False), (128, 128, 64, 3, 4, True), (64, 128, 64, 3, 8, True),
                    (128, 64, 64, 4, 4, True), (64, 64, 64, 4, 4, True)]


def splits_for(M, N, K, bm, bn, bk, sms=132):
    """Split-K counts to try: 1, and the powers of two (at most 8, dividing ``K // bk``) that first give at least one
    and two programs per SM."""
    tiles = -(-M // bm) * (N // bn)
    steps = K // bk
    out = {1}
    for target in (sms, 2 * sms):
        split = 1
        while tiles * split < target and split < 8 and steps % (split * 2) == 0:
            split *= 2
        out.add(split)
    return sorted(out)


def compile_sm90(dtype: str, cand: tuple, split_k: int = 2):
    """Compile the kernel for sm_90 on any machine (no GPU): ``dtype`` "bf16" / "fp16", ``cand`` a ``CANDIDATES``
    tuple, K = 4096, N = 4096, group 128 (split-K 2 compiles the serial split-K epilogue too).

    Returns: ``(compiled kernel, ptxas -v's stderr, the SASS)``. Raises: triton's CompilationError (a static assert
    of the kernel, e.g. bank conflicts, included)."""
    import subprocess
    import tempfile

    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    bm, bn, bk, st, nw, fast = cand
    K, N, M = 4096, 4096, 256
    x = torch.zeros(M, K, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)
    q, sc, z = (torch.zeros(K // 8, N, dtype=torch.int32), torch.zeros(K // 128, N, dtype=torch.float16),
                torch.zeros(K // 128, N, dtype=torch.int16))
    names = ["x_desc", "p_desc", "s_desc", "z_desc"]
    sig = {n: mangle_type(d) for n, d in zip(names, descriptors(x, q, sc, z, bm, bn, bk))}
    sig.update({"out_ptr": f"*{dtype}", "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
                "stride_om": "i32"})
    consts = dict(GROUP_SIZE=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=st, SPLIT_K=split_k, FAST=fast,
                  num_warps=nw)
    sig.update({k: "constexpr" for k in consts})
    src = GluonASTSource(w4a16_wgmma_kernel, sig, constexprs={(list(sig).index(k),): v for k, v in consts.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i in (4, 5, 6, 8, 9, 10)})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
    ptxas = get_ptxas(90).path  # the ptxas triton itself uses for this PTX version
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
        with open(os.path.join(d, "k.cubin"), "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-c", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stdout
    return kernel, r.stderr, sass


def compile_only():
    """``compile_sm90`` of every candidate, bf16 and fp16 x: registers, spills, ptxas's performance notes, the wgmma
    waits it kept, shared memory and the SASS instruction mix (the CPU machine's triton should be the device's 3.6)."""
    import collections
    import re

    for dt in ("bf16", "fp16"):
        for cand in CANDIDATES:
            t0 = time.time()
            name = f"{dt} {cand[0]}x{cand[1]}x{cand[2]} s{cand[3]} w{cand[4]} fast={cand[5]}"
            try:
                kernel, ptxas_log, sass = compile_sm90(dt, cand)
            except Exception as e:  # noqa: BLE001
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
                continue
            stats = [l.split("info    :")[-1].strip() for l in ptxas_log.splitlines()
                     if "Used" in l or "spill" in l or "Performance Loss" in l]
            # "gsb0, 0x1" leaves one wgmma group in flight; only "0x0" in the loop would serialize them
            stats.append("waits " + ", ".join(sorted(set(re.findall(r"DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)))))
            ops = collections.Counter(m.group(1).split(".")[0]
                                      for m in re.finditer(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
            print(f"{name}: {' | '.join(stats)}; smem {kernel.metadata.shared} B; SASS "
                  f"{', '.join(f'{k} {v}' for k, v in ops.most_common(14))} ({time.time() - t0:.1f}s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--shapes", default="engine", choices=["engine", "layer"])
    ap.add_argument("--quick", action="store_true", help="QUICK_CANDIDATES on gate|up and down at M = 64, 128, 256")
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
        return
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    from bench_w4a16 import graph_time_ms, random_layer, rel_err, rotating_sets
    from paged_transformers.kernels.w4a16 import w4a16_matmul, w4a16_matmul_ref

    dev = torch.device("cuda")
    report = {"check": [], "sweep": []}
    global CANDIDATES
    if args.quick:
        CANDIDATES = QUICK_CANDIDATES
    # correctness first: off the M grid, split-K; fp16 x on the smaller shape
    for K, N in ((1024, 768),) if args.quick else ((4096, 4096), (1024, 768)):
        layer = random_layer(K, N, 4, 128, dev)
        for M in (1, 70, 256):
            for dt in (torch.bfloat16, torch.float16):
                if dt == torch.float16 and (K, M) != (1024, 70):
                    continue
                x = torch.randn(M, K, device=dev, dtype=dt)
                ref = w4a16_matmul_ref(x.float(), *layer, 4, 128)
                for cand in CANDIDATES:
                    bm, bn, bk = cand[:3]
                    if dt == torch.float16 and cand[5]:
                        continue
                    for split in splits_for(M, N, K, bm, bn, bk):
                        if N % bn or K % (bk * split):
                            continue
                        row = dict(K=K, N=N, M=M, dtype=str(dt), cfg=list(cand), split=split)
                        try:
                            row["rel_err"] = rel_err(wgmma_matmul(x, *layer, 128, *cand, split), ref)
                        except Exception as e:  # noqa: BLE001
                            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        report["check"].append(row)
                        print("check", row, flush=True)
    bad = {tuple(r["cfg"]) for r in report["check"] if r.get("rel_err", 1.0) > 1e-2}  # (without the split)
    shapes = {"engine": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],
              "layer": [(4096, 4096), (4096, 14336), (14336, 4096)]}[args.shapes]
    if args.quick:
        shapes = [(4096, 28672), (14336, 4096)]
    t_start = time.perf_counter()
    for K, N in shapes:
        int4_bytes, n_q, n_b, qsets, bsets = rotating_sets(K, N, dev)
        for M in (64, 128, 256) if args.quick else (16, 32, 64, 128, 192, 256):
            xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(max(n_q, n_b))]
            row = dict(K=K, N=N, M=M, variants=[])
            row["bf16_us"] = graph_time_ms(lambda i: torch.matmul(xs[i % len(xs)], bsets[i % n_b])) * 1e3
            row["default_us"] = graph_time_ms(lambda i: w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, 128)) * 1e3
            ref = w4a16_matmul_ref(xs[0].float(), *qsets[0], 4, 128)
            for cand in CANDIDATES:
                bm, bn, bk = cand[:3]
                if cand in bad or N % bn or time.perf_counter() - t_start > args.budget_s:
                    continue
                for split in splits_for(M, N, K, bm, bn, bk):
                    c = (*cand, split)
                    fn = lambda i, c=c: wgmma_matmul(xs[i % len(xs)], *qsets[i % n_q], 128, *c)
                    try:
                        err = rel_err(fn(0), ref)
                        assert err < 1e-2, f"rel_err {err:.3g}"
                        row["variants"].append(dict(cfg=list(c), us=graph_time_ms(fn) * 1e3, rel_err=err))
                    except Exception as e:  # noqa: BLE001
                        row["variants"].append(dict(cfg=list(c), error=f"{type(e).__name__}: {str(e)[:200]}"))
            ok = [v for v in row["variants"] if "us" in v]
            row["best"] = min(ok, key=lambda v: v["us"]) if ok else None
            report["sweep"].append(row)
            b = row["best"]
            print(f"K={K} N={N} M={M} bf16 {row['bf16_us']:.1f} default {row['default_us']:.1f} "
                  f"best {b['us'] if b else float('nan'):.1f} {b['cfg'] if b else ''}", flush=True)
        del qsets, bsets
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"{'K x N':>12} {'M':>4} {'bf16':>7} {'default':>8} {'best':>7} {'x bf16':>7} {'x dflt':>7}  best config")
    for r in report["sweep"]:
        b = r["best"]
        if b:
            print(f"{r['K']:>5}x{r['N']:<6} {r['M']:4d} {r['bf16_us']:7.1f} {r['default_us']:8.1f} {b['us']:7.1f} "
                  f"{r['bf16_us'] / b['us']:7.2f} {r['default_us'] / b['us']:7.2f}  {b['cfg']}")


if __name__ == "__main__":
    main()
