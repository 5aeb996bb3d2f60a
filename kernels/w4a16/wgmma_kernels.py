"""Gluon kernel of ``W4A16Algo.WGMMA``, the Hopper (sm_90) W4A16 matmul for 17-256 rows, and its host-side TMA
descriptors (imported on the first launch, see ``kernels._launch``).

Each program computes one ``[BLOCK_M, BLOCK_N]`` output tile over its K slice. Every K step:

1. waits on the step's mbarrier for its TMA copies (x tile, packed words, scales, zero points), issued ``STAGES - 1``
   steps ahead into a ring of ``STAGES`` shared-memory slots;
2. dequantizes the ``[BLOCK_N, BLOCK_K]`` weight tile in registers while the previous step's wgmma still runs: per
   int32 word one inline-PTX block (FasterTransformer / Marlin's LOP3 magic-number pairs give ``q - z`` exactly),
   then ``(q - z) * s`` rounded once to ``x.dtype``, as ``w4a16_matmul_ref`` rounds; the 8 consecutive K values of
   one column go to shared memory in one 16-byte store (a 128B-swizzled tile, lanes on consecutive columns: no bank
   conflicts, a static assert);
3. fences the stores for the async proxy, issues the wgmma ``x [BLOCK_M, BLOCK_K] @ W^T`` with both operands in
   shared memory, waits only for the previous one (``warpgroup_mma_wait(1)``), then issues the copies of step
   ``i + STAGES - 1`` into the slot that wgmma freed.

So the dequantization of step ``i`` overlaps the tensor cores' work on step ``i - 1``; a ``tl.dot`` on a weight
computed in registers waits for its wgmma at once (triton 3.6), which is why this kernel is written in Gluon,
Triton's explicit-layout dialect. Step 0 is issued before the loop (``use_acc=False``): an accumulator reaching the
last wait defined by anything but a wgmma makes ptxas serialize every wgmma (its C7515 note).

Sources: the software pipeline over TMA and mbarriers and the async wgmma are CUTLASS's Hopper mainloop; the
mixed-input scheme (dequantize in registers, then the tensor cores) is Machete's and Marlin's; the serial split-K is
the package's (``common_kernels._write_tile``). Gluon has no interpreter: CI compiles this module for sm_90 on the
CPU (``tests/test_w4a16_wgmma.py``); CUDA tests check it against the reference.
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# names that changed between Triton 3.6 and 3.7+: the TMA global -> shared copy and the CTA-wide barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


def _dequant_asm(magic_bits: int, out: str, fp32_scale: bool) -> str:
    """PTX: int32 ``$8`` (8 four-bit fields, low first), ``$9`` = ``B + z`` in both 16-bit halves (``B`` the magic
    number of ``out``: 128 for bf16, 1024 for fp16), ``$10`` = the fp32 scale -> ``$0..$7`` = ``(q_j - z) * s`` in
    ``out`` ("bf16" / "f16"), rounded once: in fp32 when ``fp32_scale``, else (fp16 out, fp16 scale: both operands
    exact in fp16) one ``mul.rn.f16x2``. Outputs come in LOP3-pair order: ``$2i, $2i+1`` = fields ``i, i + 4``."""
    pair = magic_bits * 0x10001
    lines = ["{", ".reg .b32 sh, t0, t1, t2, t3, lo, hi;", ".reg .b16 l16, h16, s16;", ".reg .b32 sp;",
             "shr.u32 sh, $8, 4;"]
    # prmt: result byte 0 <- byte i of $8 (field 2i), byte 2 <- byte i of $8 >> 4 (field 2i + 1); LOP3 0xEA: (a & b) | c
    lines += [f"prmt.b32 t{i}, $8, sh, {(4 + i) << 8 | i:#06x};" for i in range(4)]
    lines += [f"lop3.b32 t{i}, t{i}, 0x000F000F, {pair:#010x}, 0xEA;" for i in range(4)]
    lines += [f"sub.{out}x2 t{i}, t{i}, $9;" for i in range(4)]  # exact: q - z, both halves
    if not fp32_scale:
        lines += ["cvt.rn.f16.f32 s16, $10;", "mov.b32 sp, {s16, s16};"]  # exact: the scale was fp16
        lines += [f"mul.rn.f16x2 t{i}, t{i}, sp;" for i in range(4)]
    else:
        for i in range(4):
            if out == "bf16":  # bf16 -> fp32 is a 16-bit shift
                lines += [f"shl.b32 lo, t{i}, 16;", f"and.b32 hi, t{i}, 0xFFFF0000;"]
            else:
                lines += [f"mov.b32 {{l16, h16}}, t{i};", "cvt.f32.f16 lo, l16;", "cvt.f32.f16 hi, h16;"]
            lines += ["mul.rn.f32 lo, lo, $10;", "mul.rn.f32 hi, hi, $10;", f"cvt.rn.{out}x2.f32 t{i}, hi, lo;"]
    lines += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, t{i};" for i in range(4)]
    return "\n".join(lines + ["}"])


_ASM_BF16 = gl.constexpr(_dequant_asm(0x4300, "bf16", fp32_scale=True))
_ASM_FP16 = gl.constexpr(_dequant_asm(0x6400, "f16", fp32_scale=False))
_ASM_FP16_FP32_SCALE = gl.constexpr(_dequant_asm(0x6400, "f16", fp32_scale=True))


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
    """The largest wgmma N (a multiple of 8, at most 256) that divides the warps' share of ``BLOCK_N``."""
    w = _mma_warps(BLOCK_M, num_warps)
    max_n = max(BLOCK_N // w[1], 8)
    n = 256
    while n > max_n or BLOCK_N % n:
        n -= 8
    return n


@gluon.constexpr_function
def _p_layout(BLOCK_N, TK, num_warps):
    """Layout of the packed words ``[BLOCK_N, TK]``: one column per lane, 32 consecutive columns per warp, warps along
    K while words remain, then along N. A thread's word becomes 8 consecutive K values of one column, one 16-byte
    store into that column's row of the 128B-swizzled ``[BLOCK_N, BLOCK_K]`` tile; lanes on consecutive rows put
    every 8 stores of a warp in distinct banks."""
    lanes_n = min(32, BLOCK_N)
    lanes_k = 32 // lanes_n
    warps_k = min(num_warps, max(TK // lanes_k, 1))
    return gl.BlockedLayout([1, 1], [lanes_n, lanes_k], [num_warps // warps_k, warps_k], [0, 1])


@gluon.jit
def _issue_copies(x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, bars, slot, k0, off_m, off_n,
                  GROUP_SIZE: gl.constexpr):
    """TMA copies of one K step into ring slot ``slot``, completing on ``bars[slot]`` (out of bounds reads as 0)."""
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
          STAGES: gl.constexpr, P_LAYOUT: gl.constexpr):
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
    zb = zv | MAGIC_BITS  # B + z in DT (0 <= z < 128, B's low mantissa bits are zero): integer ops, no I2F
    zpair = zb | (zb << 16)
    if DT == gl.bfloat16:
        f = gl.inline_asm_elementwise(_ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, zpair, sv], (gl.bfloat16,) * 8,
                                      is_pure=True, pack=1)
    elif s_desc.dtype == gl.float16:
        f = gl.inline_asm_elementwise(_ASM_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, zpair, sv], (gl.float16,) * 8,
                                      is_pure=True, pack=1)
    else:
        f = gl.inline_asm_elementwise(_ASM_FP16_FP32_SCALE, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, zpair, sv],
                                      (gl.float16,) * 8, is_pure=True, pack=1)
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
def _w4a16_wgmma_kernel(
    x_desc,  # TMA descriptor of x [M, K] bf16/fp16, block [BLOCK_M, BLOCK_K]
    p_desc,  # of qweight int32 [K // 8, N] (4-bit, the package layout), block [BLOCK_K // 8, BLOCK_N]
    s_desc,  # of scales fp16/bf16/fp32 [G, N], block [1, BLOCK_N]
    z_desc,  # of zero points int16 [G, N], block [1, BLOCK_N]
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] x.dtype
    ws_ptr,  # fp32 [M, N] workspace, zero between calls (SPLIT_K > 1)
    lock_ptr,  # int32 per-tile arrival counters, zero between calls (SPLIT_K > 1)
    M, N, K, stride_om,
    HAS_BIAS: gl.constexpr,
    GROUP_SIZE: gl.constexpr,  # a multiple of BLOCK_K, or K: every K step lies in one group
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """``out = x @ dequant(W) (+ bias)`` for one ``[BLOCK_M, BLOCK_N]`` tile (tiles N-major: the M tiles of one
    weight tile run next to each other, so it is read from HBM once), ``program_id(1)`` taking one of ``SPLIT_K``
    equal K slices. The host guarantees ``K % (BLOCK_K * SPLIT_K) == 0``; rows past M and columns past N read as 0
    and are not stored."""
    DT: gl.constexpr = x_desc.dtype
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BLOCK_M)
    off_m = (pid % num_m) * BLOCK_M
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

    acc = _step(x_desc, p_desc, s_desc, z_desc, x_smem, w_smem, p_smem, s_smem, z_smem, bars, 0,
                gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=MMA), False, n_steps, k_begin, off_m, off_n,
                GROUP_SIZE, BLOCK_N, BLOCK_K, STAGES, P_LAYOUT)
    for i in range(1, n_steps):
        acc = _step(x_desc, p_desc, s_desc, z_desc, x_smem, w_smem, p_smem, s_smem, z_smem, bars, i, acc, True,
                    n_steps, k_begin, off_m, off_n, GROUP_SIZE, BLOCK_N, BLOCK_K, STAGES, P_LAYOUT)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    om = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    on = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    optr = out_ptr + gl.expand_dims(om, 1) * stride_om + gl.expand_dims(on, 0)
    mask_n = on < N
    omask = gl.expand_dims(om < M, 1) & gl.expand_dims(mask_n, 0)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(bias_ptr + on, mask=mask_n, other=0.0).to(gl.float32), 0)
        gl.store(optr, acc.to(DT), mask=omask)
    else:
        # as common_kernels._write_tile: relaxed fp32 adds into the zeroed workspace, then the tile's arrival counter
        # (acq_rel); the last program reads the sum back, leaves zeros, writes the tile and resets the counter
        wptr = ws_ptr + gl.expand_dims(om, 1) * N + gl.expand_dims(on, 0)
        gl.atomic_add(wptr, acc, mask=omask, sem="relaxed")
        _barrier()
        arrived = gl.atomic_add(lock_ptr + pid, 1)
        if arrived == SPLIT_K - 1:
            zero = gl.zeros_like(acc)
            total = gl.atomic_add(wptr, zero, mask=omask, sem="relaxed")  # an L2-coherent read of the sum
            gl.store(wptr, zero, mask=omask)
            if HAS_BIAS:
                total = total + gl.expand_dims(gl.load(bias_ptr + on, mask=mask_n, other=0.0).to(gl.float32), 0)
            gl.store(optr, total.to(DT), mask=omask)
            gl.atomic_xchg(lock_ptr + pid, 0)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
              torch.int32: gl.int32, torch.int16: gl.int16}


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, int], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def descriptors(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, block_m: int,
                block_n: int, block_k: int) -> tuple:
    """Host TMA descriptors of the kernel's four inputs, in the 128B-swizzled shared layouts ``get_default_for``
    picks: x ``[M, K]`` with block ``[block_m, block_k]``, qweight ``[K // 8, N]`` with ``[block_k // 8, block_n]``,
    scales and zeros ``[G, N]`` with ``[1, block_n]``. Each tensor needs unit stride along its last dim, a 16-byte
    aligned base and row stride (``w4a16_matmul`` checks)."""

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, list(block), _smem_layout(block, t.dtype))

    return (desc(x, (block_m, block_k)), desc(qweight, (block_k // 8, block_n)), desc(scales, (1, block_n)),
            desc(zeros, (1, block_n)))

