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

| module | what |
|---|---|
| ``reference`` | ``pack_rows`` / ``unpack_rows``, ``dequantize_packed``, ``w4a16_matmul_ref`` (the reference and CPU path) |
| ``dispatch`` | ``W4A16Config``, what each kernel can run, ``default_config``: the first candidate that can from the device's table |
| ``tables`` | the per-device tuning tables (``configs/<device name>.json``, written by ``research/w4a16_tables.py``) and the rule for devices without one |
| ``matmul`` | ``w4a16_matmul`` (checks + launch), the split-K workspace, the custom op ``w4a16_matmul_op`` |
| ``gemv_kernels`` | ``GEMV``, M = 1: a 1-D fp32 accumulator, one FFMA per weight of its biased value |
| ``tc_kernels`` | ``TC``, M = 2-64 on CUDA: the weight tile dequantized to exact ``q - z`` in MMA-fragment order, one ``tl.dot`` per K step |
| ``wgmma_kernels`` | ``WGMMA``, M = 17-256 on Hopper (Gluon): TMA copies; swap AB, the weight tile dequantized straight into wgmma's register operand while the previous K step's async wgmma runs |
| ``dot_kernels`` | ``DOT`` / ``DOT_SWAP`` (no TC: 8-bit, fp32 x, small groups, CPU), one ``tl.dot`` per packed field; ``DEQUANT_MATMUL``'s pass |
| ``common_kernels`` | the magic-number field unpack, group rows, the split-K grid and epilogue |

Int -> float is the magic-number trick: OR a field into the mantissa of a power of two (``2**23`` for fp32,
128 / 1024 for bf16 / fp16), which is exact and needs no I2F; the zero point comes off with one subtract.

* Small M (decode): split-K. ``SPLIT_K`` programs share an output tile; each adds its fp32 partial
  into a zeroed workspace with atomics, then bumps a per-tile counter; the last one to arrive reads
  the sum back with an atomic (add of zero), re-zeroes the workspace, writes the output and
  resets the counter, so one launch does the whole GEMM and leaves the workspace clean for the next
  call (the "serial split-K with semaphore" scheme of CUTLASS, done with atomics).
* Decode batches on Hopper (17-256 rows): ``WGMMA`` computes ``out^T = W^T x^T`` with the dequantized weight as
  wgmma's register operand and pipelines each K step (TMA copies several steps ahead, the dequantization of step i
  beside the tensor cores' step i - 1; CUTLASS's Hopper mainloop, Machete's mixed-input scheme), where the device's
  table has it; ``default_config`` falls back to ``TC`` / ``DEQUANT_MATMUL`` off sm_90 or without Gluon.
* Large M (prefill): the weight dequantized to ``x.dtype``, then cuBLAS (exllama's large-batch path).

Sources of the tricks: FasterTransformer / Marlin (magic-number dequant, LOP3 pairs), exllama (dequant + GEMM for
large batches), CUTLASS (serial split-K, the TMA + mbarrier + async wgmma pipeline), Machete (mixed-input wgmma). Importing this package imports no triton: the kernel modules load on
the first launch (``kernels._launch``).
"""

from .dispatch import W4A16Algo, W4A16Config, default_config, split_k_for
from .matmul import w4a16_matmul, w4a16_matmul_op
from .reference import dequantize_packed, pack_rows, unpack_rows, w4a16_matmul_ref

__all__ = [
    "W4A16Algo",
    "W4A16Config",
    "default_config",
    "dequantize_packed",
    "pack_rows",
    "split_k_for",
    "unpack_rows",
    "w4a16_matmul",
    "w4a16_matmul_op",
    "w4a16_matmul_ref",
]
