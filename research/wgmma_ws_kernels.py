"""Issue 23, research: the ``W4A16Algo.WGMMA`` kernel with a producer warp (warp specialization).

The product's kernel (``kernels/w4a16/wgmma_kernels.py``) issues each K step's four TMA copies from the warps that
dequantize and run wgmma. In its SASS (sm_90, Triton 3.6) that issue block is about 90 instructions per K step with
six CTA-wide barriers (``BAR.SYNC``: Triton orders the copies after the step's shared-memory reads and after each
other), out of about 290 instructions a warp issues per K step, while the step's 64 x 128 x 64 of wgmma takes about
256 tensor-core cycles: the loop is bound by instruction issue (BENCHMARKS.md, issue 23, fourth session). Here one
extra warp issues the copies (``gl.warp_specialize``, CUTLASS's producer/consumer split) and waits on an "empty"
mbarrier per ring slot; the warps of the default partition only wait on the "ready" mbarriers, dequantize and run
wgmma, and free a slot (fence, then arrive on its empty mbarrier) once the wgmma that read it is done. The
dequantization, the TMA copies and the epilogue are the product's own functions.

``_w4a16_wgmma_kernel`` here takes the product kernel's arguments and launches with ``maxnreg`` set, so
``research/w4a16_wgmma.py --ab research/wgmma_ws_kernels.py`` times it against the product's in one process.

Measured (H100, 2026-12-07, BENCHMARKS.md issue 23): equal to the reference as the product's kernel is (bf16, every
config of the sweep), and its best config 8-22% faster than the product kernel's best among the same candidates on
every engine shape at M = 128 and 256 (``benchmarks/results/w4a16_wgmma_h100_2026-12-07_ab.json``); gate|up at M =
128 keeps the product's 128x128x64 rule (59.2 us), a tile the candidates did not include.
``research/wgmma_ws_product.diff`` moves it into the product; it waits for the CUDA tests, the fixtures' goldens and
the workload of record to run on it, and for timings at M = 32 and 64 (its ``maxnreg`` allows two programs an SM,
where the product's small-M tiles fit four or more).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

from paged_transformers.kernels.w4a16 import W4A16Algo, W4A16Config
from paged_transformers.kernels.w4a16.dispatch import _HOPPER_SMEM_BYTES, _wgmma_smem_bytes
from paged_transformers.kernels.w4a16.wgmma_kernels import (
    _allocate_ring,
    _barrier,
    _dequant,
    _issue_copies,
    _program_tile,
    _word_layout,
    _write_out,
)


@gluon.jit
def _producer(x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, ready, empty, k_begin, n_steps, off_m,
              off_n, GROUP_SIZE: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the copies of every K step, each into its ring slot once the consumers freed it."""
    for i in range(n_steps):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a fresh mbarrier passes phase 1 at once
        _issue_copies(x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, ready, slot,
                      k_begin + i * BLOCK_K, off_m, off_n, GROUP_SIZE)


@gluon.jit
def _consume(x_smem, p_smem, s_smem, z_smem, ready, empty, i, acc, a_same, DT: gl.constexpr, S_DT: gl.constexpr,
             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, L3: gl.constexpr, A: gl.constexpr):
    """K step ``i >= 2``: wgmma ``i - 2`` done frees its registers and its slot, then step ``i`` as the product's."""
    acc, a_same = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_same))
    if gl.num_warps() > 4:
        _barrier()
    fence_async_shared()
    mbarrier.arrive(empty.index((i - 2) % STAGES), count=1)
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), phase=(i // STAGES) & 1)
    a_same = _dequant(p_smem, s_smem, z_smem, slot, DT, S_DT, BLOCK_N, BLOCK_K, L3, A)
    acc = warpgroup_mma(a_same, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
    return acc, a_same


@gluon.jit
def _consumer(x_smem, p_smem, s_smem, z_smem, ready, empty, n_steps, DT: gl.constexpr, S_DT: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              num_warps: gl.constexpr):
    """The default partition's K loop (the product's order of steps and register sets): the fp32 tile."""
    L3: gl.constexpr = _word_layout(BLOCK_N, BLOCK_K // 8, num_warps)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    mbarrier.wait(ready.index(0), phase=0)
    a = _dequant(p_smem, s_smem, z_smem, 0, DT, S_DT, BLOCK_N, BLOCK_K, L3, A)
    acc = warpgroup_mma(a, x_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=MMA),
                        use_acc=False, is_async=True)
    mbarrier.wait(ready.index(1), phase=0)
    a_odd = _dequant(p_smem, s_smem, z_smem, 1, DT, S_DT, BLOCK_N, BLOCK_K, L3, A)
    acc = warpgroup_mma(a_odd, x_smem.index(1).permute((1, 0)), acc, is_async=True)
    for j in range(1, n_steps // 2):
        acc, a = _consume(x_smem, p_smem, s_smem, z_smem, ready, empty, 2 * j, acc, a, DT, S_DT, BLOCK_N, BLOCK_K,
                          STAGES, L3, A)
        acc, a_odd = _consume(x_smem, p_smem, s_smem, z_smem, ready, empty, 2 * j + 1, acc, a_odd, DT, S_DT, BLOCK_N,
                              BLOCK_K, STAGES, L3, A)
    if n_steps % 2 == 1:
        acc, a = _consume(x_smem, p_smem, s_smem, z_smem, ready, empty, n_steps - 1, acc, a, DT, S_DT, BLOCK_N,
                          BLOCK_K, STAGES, L3, A)
    acc, a, a_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a, a_odd))
    return (acc,)  # a tuple: Triton 3.6 flattens the default partition's results as one


@gluon.jit
def _w4a16_wgmma_ws_kernel(
    x_desc, p_desc, s_desc, z_desc, bias_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K, stride_om,
    HAS_BIAS: gl.constexpr, GROUP_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """The product kernel's contract (``wgmma_kernels._w4a16_wgmma_kernel``), its copies issued by a producer warp."""
    DT: gl.constexpr = x_desc.dtype
    off_m, off_n, k_begin, n_steps = _program_tile(M, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    x_smem, p_smem, s_smem, z_smem = _allocate_ring(x_desc, p_desc, s_desc, z_desc, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    (acc,) = gl.warp_specialize([
        (_consumer, (x_smem, p_smem, s_smem, z_smem, ready, empty, n_steps, DT, s_desc.dtype, BLOCK_M, BLOCK_N,
                     BLOCK_K, STAGES, num_warps)),
        (_producer, (x_desc, p_desc, s_desc, z_desc, x_smem, p_smem, s_smem, z_smem, ready, empty, k_begin, n_steps,
                     off_m, off_n, GROUP_SIZE, BLOCK_K, STAGES)),
    ], [1], [24])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))

    _write_out(acc, bias_ptr, out_ptr, ws_ptr, lock_ptr, off_m, off_n, M, N, stride_om, HAS_BIAS, BLOCK_M, BLOCK_N,
               SPLIT_K, num_warps)


class _WithRegisterLimit:
    """``kernel[grid](...)`` as the product launches it, with ``maxnreg`` added: the default partition's warps and
    the producer's warpgroup (launched as 4 warps, which keep 24 registers a thread) share the registers of one SM,
    or of half of one when 4 warps' ring fits twice in shared memory (two programs an SM)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, num_warps, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, **kwargs):
            ring = _wgmma_smem_bytes(W4A16Config(BLOCK_M, BLOCK_N, BLOCK_K, 1, num_warps, STAGES, W4A16Algo.WGMMA))
            ring += STAGES * 8  # the empty mbarriers
            registers = 32768 if num_warps == 4 and 2 * ring <= _HOPPER_SMEM_BYTES else 65536
            maxnreg = min(256, registers // (32 * (num_warps + 4)) // 8 * 8)
            return self.kernel[grid](*args, num_warps=num_warps, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                     STAGES=STAGES, maxnreg=maxnreg, **kwargs)

        return launch


_w4a16_wgmma_kernel = _WithRegisterLimit(_w4a16_wgmma_ws_kernel)
