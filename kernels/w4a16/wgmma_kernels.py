"""Gluon kernel of ``W4A16Algo.WGMMA``, the Hopper (sm_90) W4A16 matmul for 17-256 rows, and its host-side TMA
descriptors (imported on the first launch, see ``kernels._launch``).

The product is computed transposed, ``out^T [N, M] = W^T [N, K] @ x^T [K, M]``: the dequantized weight tile is
wgmma's A operand, which wgmma reads from registers, and x is its B operand in shared memory (Machete's layout for
mixed-input GEMMs: the weight never goes through shared memory after it is dequantized). Each program computes one
``[BLOCK_N, BLOCK_M]`` tile of ``out^T`` over its K slice; its weight rows go to the warps in 16-row slices (warp
``w`` takes slices ``w, w + num_warps, ...``). The K steps run through a ``STAGES``-deep ring of shared memory, filled
by a producer warp (``gl.warp_specialize``, CUTLASS's producer/consumer split): for every step it waits until the
step's slot is free (its "empty" mbarrier) and issues the TMA copies of the x tile, packed words, scales and zero
points into it (completing on the slot's "ready" mbarrier). x goes in boxes of ``min(BLOCK_M, X_BOX_ROWS)`` rows,
and boxes wholly past M are not copied: a TMA box whose rows lie partly past the tensor takes longer the more rows lie
past it. The warps of the default partition (the consumer), every K step ``i``:

1. wait until one wgmma is in flight (``warpgroup_mma_wait(1)``: wgmma ``i - 2`` is done, which frees its registers)
   and free wgmma ``i - 2``'s slot for the producer;
2. wait on step ``i``'s "ready" mbarrier and dequantize its weight tile straight into the wgmma A register layout
   while wgmma ``i - 1`` runs. A thread holds, per weight row and 16-K block, ``k = 2c, 2c + 1, 2c + 8, 2c + 9``
   (``c`` = lane % 4). In the package's layout (int32 word ``w`` of a column holds ``k = 8w .. 8w + 7``) those are
   byte ``c`` of every word of its rows, so each thread reads its rows' words (the 4 threads of a quad read the same
   word) and turns byte ``c`` into 2 values with one LOP3 pair (FasterTransformer / Marlin's magic numbers give ``q -
   z`` exactly), then ``(q - z) * s`` in ``x.dtype``, rounded once as ``w4a16_matmul_ref`` rounds: one ``mul.rn``
   where the scale is in x's dtype; for bf16 x with fp16 scales (GPTQ / AWQ on a bf16 model) the scale splits into
   two bf16 parts, and a bf16x2 ``mul`` and ``fma`` round the exact product (``_pair_asm``); other scales multiply
   in fp32 (an fp32 scale's product is rounded to fp32 first, as there). No repack of ``qweight`` is needed;
   ``convert_layout(..., assert_trivial=True)`` checks at compile time that the values come out in the A layout;
3. issue wgmma ``i``. Even and odd steps use two register sets, so wgmma ``i`` queues behind wgmma ``i - 1``.

Why a producer warp: with the copies issued by the default partition itself, its warps issue about 290 instructions a
K step and pass six CTA-wide barriers; with the producer, about 210 and two mbarriers of their own (Triton 3.6, sm_90).
The launch sets ``maxnreg`` (``dispatch.wgmma_maxnreg``) so the default partition gets the registers the producer
does not use.

Two consumers (``CONSUMERS = 2``, a 64-column tile on 8 warps): a second warpgroup, a worker partition, takes the odd
K steps into an fp32 tile of its own, the default partition the even ones (each frees a slot two of its steps, four
of the program's, after it used it), and the default partition adds the second's tile from shared memory before the
epilogue (it needs 4 stages at least, see the kernel's docstring, and tiles of at most 128 rows: the second
partition's registers). With one warp a scheduler a step takes about 2.5 times its wgmma's 256 cycles by the timings
(a 64-column tile's step issues about 180 instructions a warp); two warps a scheduler overlap more of it, with no
more programs and no split-K through memory: o (4096 x 4096) at M = 256 took about 9% less time than with one
consumer and the same ring (docs/benchmark-history.md).

The finished tile is moved (through shared memory, which the ring no longer needs) from wgmma's layout, where a
thread's values of one row of ``out`` are single columns 8 apart, to one where each thread holds 8 consecutive
columns (``_epilogue_layout``): every store of ``out`` and every split-K add into the fp32 workspace then moves 16
bytes, and the epilogue of 256-row x tiles with split-K fits in registers.

Sources: the warp-specialized pipeline over TMA and mbarriers and the async wgmma are CUTLASS's Hopper mainloop; the
swap of A and B with the weight in registers is Machete's (vLLM); the LOP3 dequantization is Marlin's; the serial
split-K is the package's (``common_kernels._write_tile``). Gluon has no interpreter: CI compiles this module for
sm_90 on the CPU (``tests/test_w4a16_wgmma.py``); CUDA tests check it against the reference.
"""

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# names that changed between Triton 3.6 and 3.7+: the TMA global -> shared copy and the CTA-wide barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


def _pair_asm(magic_bits: int, out: str, scale: str) -> str:
    """PTX: int32 word ``$2`` (8 four-bit fields, low first), prmt selector ``$3`` = ``c | (4 + c) << 8``, ``$4`` =
    ``B + z`` in both 16-bit halves (``B`` the magic number of ``out``: 128 for bf16, 1024 for fp16), then the scale
    -> ``$0, $1`` = fields ``2c, 2c + 1`` as ``(q - z) * s`` in ``out`` ("bf16" / "f16"), the exact product rounded
    once, as ``w4a16_matmul_ref`` rounds. ``scale``:

    - ``"x2"``: ``$5`` = ``s`` in both halves, already in ``out`` (fp16 scale and x, or bf16 both): one ``mul.rn``.
    - ``"split"``: bf16 ``out``, fp16 ``s`` = ``s_hi + s_lo`` in bf16 exactly (``s_lo`` has at most 2 significant
      bits); ``$5`` = ``s_hi``, ``$6`` = ``s_lo`` in both halves. ``p = (q - z) * s_lo`` is exact, then
      ``fma((q - z), s_hi, p)`` rounds the exact product once: three bf16x2 instructions instead of the fp32 round
      trip (checked exhaustively over every fp16 scale for ``-89 <= q - z <= 15``; 4-bit zero points are at most 16).
      A zero product may come out as +0 where the reference has -0.
    - ``"f32"``: ``$5`` = the fp32 scale; the product in fp32 (exact for a 16-bit scale), rounded to ``out``.
    """
    pair = magic_bits * 0x10001
    lines = ["{", ".reg .b32 sh, t, lo, hi;", ".reg .b16 l16, h16;",
             # byte 0 <- byte c of the word (field 2c low), byte 2 <- byte c of word >> 4 (field 2c + 1 low)
             "shr.u32 sh, $2, 4;", "prmt.b32 t, $2, sh, $3;",
             f"lop3.b32 t, t, 0x000F000F, {pair:#010x}, 0xEA;",  # (t & 0xF000F) | B pair: B + q in each half
             f"sub.{out}x2 t, t, $4;"]  # exact: q - z, both halves
    if scale == "x2":
        lines += [f"mul.rn.{out}x2 t, t, $5;"]
    elif scale == "split":
        lines += ["mul.rn.bf16x2 lo, t, $6;", "fma.rn.bf16x2 t, t, $5, lo;"]
    else:
        if out == "bf16":  # bf16 -> fp32 is a 16-bit shift
            lines += ["shl.b32 lo, t, 16;", "and.b32 hi, t, 0xFFFF0000;"]
        else:
            lines += ["mov.b32 {l16, h16}, t;", "cvt.f32.f16 lo, l16;", "cvt.f32.f16 hi, h16;"]
        lines += ["mul.rn.f32 lo, lo, $5;", "mul.rn.f32 hi, hi, $5;", f"cvt.rn.{out}x2.f32 t, hi, lo;"]
    return "\n".join(lines + ["mov.b32 {$0, $1}, t;", "}"])


_ASM_BF16_X2 = gl.constexpr(_pair_asm(0x4300, "bf16", "x2"))
_ASM_BF16_SPLIT = gl.constexpr(_pair_asm(0x4300, "bf16", "split"))
_ASM_BF16_F32 = gl.constexpr(_pair_asm(0x4300, "bf16", "f32"))
_ASM_FP16_X2 = gl.constexpr(_pair_asm(0x6400, "f16", "x2"))
_ASM_FP16_F32 = gl.constexpr(_pair_asm(0x6400, "f16", "f32"))


@gluon.jit
def _half_pair(v, DT: gl.constexpr):
    """int32 holding ``v`` (any float, rounded to nearest even in ``DT``) in both 16-bit halves."""
    b = v.to(DT).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return b | (b << 16)


@gluon.constexpr_function
def _word_layout(BLOCK_N, TK, num_warps):
    """Layout of ``[BLOCK_N, TK, 4]``: packed word ``(n, w)`` for the thread at quad position ``c`` (dim 2), laid out
    as the wgmma A operand's rows (lanes // 4 -> rows 0-7, a register -> row + 8, warps -> 16-row slices, registers
    -> further repeats) and K bits (lanes % 4 -> c, registers -> the words)."""
    reg = [[8, 0, 0]] + [[0, 1 << b, 0] for b in range(int(math.log2(TK)))]
    reg += [[16 * num_warps << r, 0, 0] for r in range(int(math.log2(BLOCK_N // (16 * num_warps))))]
    lane = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warp = [[16 << w, 0, 0] for w in range(int(math.log2(num_warps)))]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [BLOCK_N, TK, 4])


@gluon.constexpr_function
def _epilogue_layout(BLOCK_N, BLOCK_M, num_warps):
    """Layout of the ``[BLOCK_N, BLOCK_M]`` tile for its stores: 8 consecutive columns of ``out`` per thread (one
    16-byte store in 16 bits, two 16-byte reductions in fp32, where N and out's row stride are multiples of 16 as
    Triton's divisibility hints see them; narrower otherwise), a warp's lanes along N first. It covers at most 16
    rows, so on the tiles ``wgmma_fits`` allows no thread holds a copy of another's values (the split-K adds must
    happen once; the assert refuses a tile where one would)."""
    tn = min(BLOCK_N // 8, 32)
    wn = min(BLOCK_N // (8 * tn), num_warps)
    assert 8 * tn * wn <= BLOCK_N and 32 // tn * (num_warps // wn) <= BLOCK_M, "the layout would copy values"
    return gl.BlockedLayout([8, 1], [tn, 32 // tn], [wn, num_warps // wn], [0, 1])


@gluon.jit
def _issue_copies(x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, bars, slot, k0, off_m, off_n,
                  n_xbox, GROUP_SIZE: gl.constexpr):
    """TMA copies of one K step into ring slot ``slot``, completing on ``bars[slot]``: the packed words, scales and
    zero points, and the first ``n_xbox`` row boxes of the x tile (out of bounds reads as 0). The boxes wholly past
    M are not copied: their rows of the slot keep what they held, which only reaches rows of ``out`` past M (never
    stored)."""
    XB: gl.constexpr = x_desc.block_type.shape[0]
    NB: gl.constexpr = x_smem.shape[1] // XB
    gl.static_assert(NB * XB == x_smem.shape[1], "the x box rows must divide BLOCK_M")
    bar = bars.index(slot)
    rest: gl.constexpr = p_desc.block_type.nbytes + s_desc.block_type.nbytes + z_desc.block_type.nbytes
    for nb in gl.static_range(1, NB + 1):  # the byte count is a constant: one predicated expect per box count
        mbarrier.expect(bar, nb * x_desc.block_type.nbytes + rest, pred=n_xbox == nb)
    x_slot = x_smem.index(slot)
    for r in gl.static_range(NB):
        _tma_load(x_desc, [off_m + r * XB, k0], bar, x_slot.slice(r * XB, XB), pred=r < n_xbox)
    _tma_load(p_desc, [k0 // 8, off_n], bar, p_smem.index(slot))
    _tma_load(s_desc, [k0 // GROUP_SIZE, off_n], bar, s_smem.index(slot))
    _tma_load(z_desc, [k0 // GROUP_SIZE, off_n], bar, z_smem.index(slot))


@gluon.jit
def _dequant(p_smem, s_smem, z_smem, slot, DT: gl.constexpr, S_DT: gl.constexpr, BLOCK_N: gl.constexpr,
             BLOCK_K: gl.constexpr, L3: gl.constexpr, A: gl.constexpr):
    """Ring slot ``slot``'s weight tile ``[BLOCK_N, BLOCK_K]`` in ``DT``, in the wgmma A register layout ``A``."""
    MAGIC_BITS: gl.constexpr = 0x4300 if DT == gl.bfloat16 else 0x6400
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    pbuf = p_smem.index(slot).permute((1, 0))
    p = pbuf.load(L2)  # int32 [BLOCK_N, TK], each word read by the 4 threads of a quad
    gl.static_assert(gl.bank_conflicts(p.type, pbuf.type) == 0)
    p = gl.expand_dims(p, 2)  # [BLOCK_N, TK, 1]
    sv = gl.expand_dims(s_smem.index(slot).permute((1, 0)).load(L2), 2)  # [BLOCK_N, 1, 1] in S_DT
    zv = gl.expand_dims(z_smem.index(slot).permute((1, 0)).load(L2).to(gl.int32), 2)
    zb = zv | MAGIC_BITS  # B + z in DT (0 <= z < 128, B's low mantissa bits are zero): integer ops, no I2F
    zpair = zb | (zb << 16)
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3)))
    sel = gl.expand_dims(gl.expand_dims(c | ((c + 4) << 8), 0), 0)  # [1, 1, 4]
    if DT == gl.bfloat16 and S_DT == gl.bfloat16:
        f = gl.inline_asm_elementwise(_ASM_BF16_X2, "=h,=h,r,r,r,r", [p, sel, zpair, _half_pair(sv, DT)],
                                      (gl.bfloat16,) * 2, is_pure=True, pack=1)
    elif DT == gl.bfloat16 and S_DT == gl.float16:
        s32 = sv.to(gl.float32)
        s_hi = s32.to(gl.bfloat16)
        s_lo = s32 - s_hi.to(gl.float32)  # exact in fp32, and in bf16
        f = gl.inline_asm_elementwise(_ASM_BF16_SPLIT, "=h,=h,r,r,r,r,r",
                                      [p, sel, zpair, _half_pair(s_hi, DT), _half_pair(s_lo, DT)], (gl.bfloat16,) * 2,
                                      is_pure=True, pack=1)
    elif DT == gl.bfloat16:
        f = gl.inline_asm_elementwise(_ASM_BF16_F32, "=h,=h,r,r,r,r", [p, sel, zpair, sv.to(gl.float32)],
                                      (gl.bfloat16,) * 2, is_pure=True, pack=1)
    elif S_DT == gl.float16:
        f = gl.inline_asm_elementwise(_ASM_FP16_X2, "=h,=h,r,r,r,r", [p, sel, zpair, _half_pair(sv, DT)],
                                      (gl.float16,) * 2, is_pure=True, pack=1)
    else:
        f = gl.inline_asm_elementwise(_ASM_FP16_F32, "=h,=h,r,r,r,r", [p, sel, zpair, sv.to(gl.float32)],
                                      (gl.float16,) * 2, is_pure=True, pack=1)
    w = gl.reshape(gl.join(f[0], f[1]), [BLOCK_N, BLOCK_K])  # [n, word, c, e] -> k = 8 word + 2c + e
    return gl.convert_layout(w, A, assert_trivial=True)


@gluon.jit
def _producer(x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, ready, empty, k_begin, n_steps, off_m,
              off_n, M, GROUP_SIZE: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """The producer warp: the copies of every K step, each into its ring slot once the default partition freed it."""
    XB: gl.constexpr = x_desc.block_type.shape[0]
    n_xbox = gl.cdiv(gl.minimum(M - off_m, x_smem.shape[1]), XB)  # the x tile's row boxes that hold rows < M
    for i in range(n_steps):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a fresh mbarrier passes phase 1 at once
        _issue_copies(x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, ready, slot,
                      k_begin + i * BLOCK_K, off_m, off_n, n_xbox, GROUP_SIZE)


@gluon.jit
def _step(x_smem, p_smem, s_smem, z_smem, ready, empty, i, acc, a_same, DT: gl.constexpr, S_DT: gl.constexpr,
          BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, STRIDE: gl.constexpr, L3: gl.constexpr,
          A: gl.constexpr):
    """A warpgroup's K step ``i`` (its third or later; it takes every ``STRIDE``-th step): wait until one wgmma is in
    flight (its wgmma of step ``i - 2 * STRIDE`` done: its registers ``a_same``), free that step's slot (a proxy
    fence orders this partition's reads of it before the producer's next TMA write), dequantize step ``i`` into
    ``a_same``'s register set while its previous wgmma runs, issue wgmma ``i``."""
    acc, a_same = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_same))
    if gl.num_warps() > 4:
        _barrier()  # ... in every warpgroup
    fence_async_shared()
    mbarrier.arrive(empty.index((i - 2 * STRIDE) % STAGES), count=1)
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), phase=(i // STAGES) & 1)
    a_same = _dequant(p_smem, s_smem, z_smem, slot, DT, S_DT, BLOCK_N, BLOCK_K, L3, A)
    acc = warpgroup_mma(a_same, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
    return acc, a_same


@gluon.jit
def _k_loop(x_smem, p_smem, s_smem, z_smem, ready, empty, first, n_steps, DT: gl.constexpr, S_DT: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
            STRIDE: gl.constexpr, num_warps: gl.constexpr):
    """One consumer's K loop over the program's steps ``first, first + STRIDE, ... < n_steps`` (at least 2): its fp32
    tile ``[BLOCK_N, BLOCK_M]``."""
    L3: gl.constexpr = _word_layout(BLOCK_N, BLOCK_K // 8, num_warps)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    n_own = (n_steps - first + STRIDE - 1) // STRIDE
    # its first two steps (use_acc=False first: an accumulator reaching a wait defined by anything but a wgmma makes
    # ptxas serialize every wgmma, its C7515 note), then pairs of steps, even ones in register set `a`, odd ones in
    # `a_odd`
    i = first
    mbarrier.wait(ready.index(i % STAGES), phase=(i // STAGES) & 1)
    a = _dequant(p_smem, s_smem, z_smem, i % STAGES, DT, S_DT, BLOCK_N, BLOCK_K, L3, A)
    acc = warpgroup_mma(a, x_smem.index(i % STAGES).permute((1, 0)),
                        gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=MMA), use_acc=False, is_async=True)
    i = first + STRIDE
    mbarrier.wait(ready.index(i % STAGES), phase=(i // STAGES) & 1)
    a_odd = _dequant(p_smem, s_smem, z_smem, i % STAGES, DT, S_DT, BLOCK_N, BLOCK_K, L3, A)
    acc = warpgroup_mma(a_odd, x_smem.index(i % STAGES).permute((1, 0)), acc, is_async=True)
    for j in range(1, n_own // 2):
        acc, a = _step(x_smem, p_smem, s_smem, z_smem, ready, empty, first + 2 * j * STRIDE, acc, a, DT, S_DT,
                       BLOCK_N, BLOCK_K, STAGES, STRIDE, L3, A)
        acc, a_odd = _step(x_smem, p_smem, s_smem, z_smem, ready, empty, first + (2 * j + 1) * STRIDE, acc, a_odd,
                           DT, S_DT, BLOCK_N, BLOCK_K, STAGES, STRIDE, L3, A)
    if n_own % 2 == 1:
        acc, a = _step(x_smem, p_smem, s_smem, z_smem, ready, empty, first + (n_own - 1) * STRIDE, acc, a, DT, S_DT,
                       BLOCK_N, BLOCK_K, STAGES, STRIDE, L3, A)
    acc, a, a_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a, a_odd))
    return acc


@gluon.jit
def _consumer(x_smem, p_smem, s_smem, z_smem, ready, empty, n_steps, DT: gl.constexpr, S_DT: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              CONSUMERS: gl.constexpr, num_warps: gl.constexpr):
    """The default partition: the K steps ``0, CONSUMERS, ...``; its fp32 tile, as a 1-tuple (Triton 3.6 returns a
    partition's results as one)."""
    return (_k_loop(x_smem, p_smem, s_smem, z_smem, ready, empty, 0, n_steps, DT, S_DT, BLOCK_M, BLOCK_N, BLOCK_K,
                    STAGES, CONSUMERS, num_warps),)


@gluon.jit
def _second_consumer(x_smem, p_smem, s_smem, z_smem, ready, empty, sum_smem, n_steps, DT: gl.constexpr,
                     S_DT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                     STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The second consumer warpgroup (a worker partition, ``CONSUMERS == 2``): the odd K steps, its fp32 tile left in
    ``sum_smem`` for the default partition to add."""
    acc = _k_loop(x_smem, p_smem, s_smem, z_smem, ready, empty, 1, n_steps, DT, S_DT, BLOCK_M, BLOCK_N, BLOCK_K,
                  STAGES, 2, num_warps)
    sum_smem.store(acc)


@gluon.jit
def _write_out(acc, bias_ptr, out_ptr, ws_ptr, lock_ptr, off_m, off_n, M, N, stride_om, HAS_BIAS: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT_K: gl.constexpr, num_warps: gl.constexpr):
    """The program's fp32 tile ``acc [BLOCK_N, BLOCK_M]`` (``out^T``) into ``out`` (+ bias): stored, or with split-K
    added into the workspace, the last of the tile's ``SPLIT_K`` programs writing the sum."""
    DT: gl.constexpr = out_ptr.dtype.element_ty
    EPI: gl.constexpr = _epilogue_layout(BLOCK_N, BLOCK_M, num_warps)
    acc = gl.convert_layout(acc, EPI)
    on = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, EPI))
    om = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, EPI))
    optr = out_ptr + gl.expand_dims(om, 0) * stride_om + gl.expand_dims(on, 1)
    mask_n = on < N
    omask = gl.expand_dims(om < M, 0) & gl.expand_dims(mask_n, 1)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(bias_ptr + on, mask=mask_n, other=0.0).to(gl.float32), 1)
        gl.store(optr, acc.to(DT), mask=omask)
    else:
        # as common_kernels._write_tile: relaxed fp32 adds into the zeroed workspace, then the tile's arrival counter
        # (acq_rel); the last program reads the sum back, leaves zeros, writes the tile and resets the counter
        wptr = ws_ptr + gl.expand_dims(om, 0) * N + gl.expand_dims(on, 1)
        gl.atomic_add(wptr, acc, mask=omask, sem="relaxed")
        _barrier()
        arrived = gl.atomic_add(lock_ptr + gl.program_id(0), 1)
        if arrived == SPLIT_K - 1:
            zero = gl.zeros_like(acc)
            total = gl.atomic_add(wptr, zero, mask=omask, sem="relaxed")  # an L2-coherent read of the sum
            gl.store(wptr, zero, mask=omask)
            if HAS_BIAS:
                total = total + gl.expand_dims(gl.load(bias_ptr + on, mask=mask_n, other=0.0).to(gl.float32), 1)
            gl.store(optr, total.to(DT), mask=omask)
            gl.atomic_xchg(lock_ptr + gl.program_id(0), 0)


@gluon.jit
def _program_tile(M, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr):
    """This program's output tile and K slice: ``(off_m, off_n, k_begin, n_steps)``; tiles N-major (the M tiles of
    one weight tile run next to each other, so it is read from HBM once), ``program_id(1)`` the K slice."""
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BLOCK_M)
    k_len = K // SPLIT_K
    return (pid % num_m) * BLOCK_M, (pid // num_m) * BLOCK_N, gl.program_id(1) * k_len, k_len // BLOCK_K


@gluon.jit
def _allocate_ring(x_desc, p_desc, s_desc, z_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """The ``STAGES``-deep ring of the TMA copies: x ``[BLOCK_M, BLOCK_K]``, packed words ``[BLOCK_K // 8, BLOCK_N]``,
    a row of scales and of zero points per slot, in the descriptors' shared layouts."""
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    p_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_K // 8, BLOCK_N], p_desc.layout)
    s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES, 1, BLOCK_N], s_desc.layout)
    z_smem = gl.allocate_shared_memory(gl.int16, [STAGES, 1, BLOCK_N], z_desc.layout)
    return x_smem, p_smem, s_smem, z_smem


@gluon.jit
def _w4a16_wgmma_kernel(
    x_desc,  # TMA descriptor of x [M, K] bf16/fp16, block [a divisor of BLOCK_M, BLOCK_K]
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
    BLOCK_M: gl.constexpr,  # x rows per tile: wgmma's N, a power of two, 16-256
    BLOCK_N: gl.constexpr,  # weight columns per tile: wgmma's M, a multiple of 16 * num_warps
    BLOCK_K: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr,
    CONSUMERS: gl.constexpr,  # consumer warpgroups, taking alternate K steps: 1, or 2 (num_warps each)
    num_warps: gl.constexpr,  # of a consumer warpgroup's partition: 4, or 8 (two warpgroups splitting BLOCK_N)
):  # fmt: skip
    """``out = x @ dequant(W) (+ bias)`` for one ``[BLOCK_M, BLOCK_N]`` tile of ``out`` (tiles N-major: the M tiles of
    one weight tile run next to each other, so it is read from HBM once), ``program_id(1)`` taking one of ``SPLIT_K``
    equal K slices. The host guarantees ``K % (BLOCK_K * SPLIT_K) == 0`` with at least 2 steps per slice and
    consumer, and ``STAGES >= 2 + CONSUMERS`` (3 or 4). A consumer frees a step's slot at the start of its second
    step after it (step ``t + 2 * CONSUMERS``), and the producer copies step ``t + STAGES`` into it: with ``STAGES >=
    2 * CONSUMERS`` that freeing step comes no later than the step copied, and the consumer that frees reaches it
    without waiting for that copy (with two consumers and 3 stages, step ``t + 4`` can be past the freeing consumer's
    last step, and the program's last copy would wait forever; one consumer would run on 2 stages, but takes 3 for a
    step of prefetch); rows past M (zeros, or stale values where a whole x box lies past M) and columns past N
    (zeros) are not stored."""
    DT: gl.constexpr = x_desc.dtype
    off_m, off_n, k_begin, n_steps = _program_tile(M, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)

    x_smem, p_smem, s_smem, z_smem = _allocate_ring(x_desc, p_desc, s_desc, z_desc, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    if CONSUMERS == 1:
        (acc,) = gl.warp_specialize([
            (_consumer, (x_smem, p_smem, s_smem, z_smem, ready, empty, n_steps, DT, s_desc.dtype, BLOCK_M, BLOCK_N,
                         BLOCK_K, STAGES, 1, num_warps)),
            (_producer, (x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, ready, empty, k_begin,
                         n_steps, off_m, off_n, M, GROUP_SIZE, BLOCK_K, STAGES)),
        ], [1], [24])  # the producer: 1 warp, 24 registers a thread
    else:
        sum_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M],
                                             gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        (acc,) = gl.warp_specialize([
            (_consumer, (x_smem, p_smem, s_smem, z_smem, ready, empty, n_steps, DT, s_desc.dtype, BLOCK_M, BLOCK_N,
                         BLOCK_K, STAGES, 2, num_warps)),
            (_second_consumer, (x_smem, p_smem, s_smem, z_smem, ready, empty, sum_smem, n_steps, gl.constexpr(DT),
                                gl.constexpr(s_desc.dtype), BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps)),
            (_producer, (x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, ready, empty, k_begin,
                         n_steps, off_m, off_n, M, GROUP_SIZE, BLOCK_K, STAGES)),
        ], [num_warps, 1], [160, 24])  # the second consumer: 160 registers a thread (the default partition gets the
        # rest of three warpgroups' maxnreg, at most 256); the producer: 1 warp, 24
        _barrier()
        acc = acc + sum_smem.load(acc.type.layout)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))

    _write_out(acc, bias_ptr, out_ptr, ws_ptr, lock_ptr, off_m, off_n, M, N, stride_om, HAS_BIAS, BLOCK_M, BLOCK_N,
               SPLIT_K, num_warps)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
              torch.int32: gl.int32, torch.int16: gl.int16}


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, int], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


# Rows of x per TMA box. A box partly past M is slower the more of its rows lie past M (docs/benchmark-history.md): with
# 64-row boxes at most 48 rows of one box lie past M where batches are multiples of 16 rows (the decode graphs), which
# cost about 1 us on a 256-row tile; 16-row boxes, which would leave none, measured slower at every row count.
X_BOX_ROWS = 64


def descriptors(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, block_m: int,
                block_n: int, block_k: int) -> tuple:
    """Host TMA descriptors of the kernel's four inputs, in the 128B-swizzled shared layouts ``get_default_for``
    picks: x ``[M, K]`` with block ``[min(block_m, X_BOX_ROWS), block_k]`` (the kernel copies an x tile in row
    boxes, the ones wholly past M not at all), qweight ``[K // 8, N]`` with ``[block_k // 8, block_n]``,
    scales and zeros ``[G, N]`` with ``[1, block_n]``. Each tensor needs unit stride along its last dim, a 16-byte
    aligned base and row stride (``w4a16_matmul`` checks)."""

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, list(block), _smem_layout(block, t.dtype))

    return (desc(x, (min(block_m, X_BOX_ROWS), block_k)), desc(qweight, (block_k // 8, block_n)),
            desc(scales, (1, block_n)), desc(zeros, (1, block_n)))

