"""Row argmax for greedy decoding and the sampler's exponential-race draw: ``argmax_rows`` (two Triton kernels) and
its reference ``torch.argmax(x, dim=-1)``.

Why a kernel: PyTorch reduces one row of a 128,256-entry vocabulary with one thread block, so at batch 1 one
multiprocessor reads the whole row (about 0.6% of a Llama-3-8B batch-1 decode step, ``research/profile_decode.py``).
Splitting the row over ``cdiv(V, BLOCK)`` programs and merging their (value, index) pairs in a second launch reads it at
bandwidth. The same split-then-merge shape as the split-KV decode attention (``paged_attention``).
"""

import torch

from .._launch import cdiv, load_triton_kernels, next_power_of_2

BLOCK = 2048  # entries per stage-1 program: 63 programs per row of a 128,256-entry vocabulary


def argmax_rows(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Index of the largest entry of each row, as ``torch.argmax(x, dim=-1)``: the first index among equal
    maxima, and NaN counted as larger than any number (the first NaN of a row wins).

    Args:
        x: ``[num_rows, V]`` float32, float16 or bfloat16, ``V >= 1``, unit stride along ``V`` (any row
            stride, e.g. the first ``vocab_size`` columns of padded logits).
        block: entries per stage-1 program, a power of two up to 65536 (``BLOCK`` unless testing).

    Returns:
        ``[num_rows]`` int64 on ``x.device``. Nothing is read back to the host.

    Raises:
        ValueError: ``x`` not 2-D, with no columns, of another dtype, or not unit-stride along ``V``; ``block`` not
            a power of two in [1, 65536].
        RuntimeError: a CPU tensor without the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    if x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"x must be [num_rows, V] with V >= 1, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along V, got strides {x.stride()}")
    if type(block) is not int or not 1 <= block <= 65536 or block & (block - 1):
        raise ValueError(f"block must be a power of two in [1, 65536], got {block!r}")
    num_rows, V = x.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows == 0:
        return out
    kernels = load_triton_kernels("argmax.triton_kernels", x.device)
    num_chunks = cdiv(V, block)
    values = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=x.device)
    indices = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=x.device)
    kernels._argmax_chunk_kernel[(num_rows, num_chunks)](x, values, indices, V, x.stride(0), num_chunks,
                                                         BLOCK=block, num_warps=4)
    kernels._argmax_merge_kernel[(num_rows,)](values, indices, out, num_chunks, C_PAD=next_power_of_2(num_chunks),
                                              num_warps=1)
    return out
