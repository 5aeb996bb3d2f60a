"""Triton kernels of ``argmax.argmax_rows`` (its only caller, which validates the inputs): a two-stage row argmax.

Stage 1, grid ``(num_rows, num_chunks)``: program ``(r, c)`` reduces ``BLOCK`` entries of row ``r`` to a (value,
index) pair. Stage 2, grid ``(num_rows,)``: reduces a row's ``num_chunks`` pairs to its index. Both stages order
pairs as PyTorch's ``argmax`` does, so the result is ``torch.argmax``'s: NaN counts as the largest value, and
equal values (or two NaNs) go to the lower index.
"""

import triton
import triton.language as tl


@triton.jit
def _first_max(a, ia, b, ib):
    """``tl.reduce`` combine of (value, index) pairs: the pair ``torch.argmax`` keeps (its ``greater_or_nan``)."""
    a_nan = a != a
    b_nan = b != b
    first = ia < ib
    a_wins = (a_nan & (~b_nan | first)) | (~a_nan & ~b_nan & ((a > b) | ((a == b) & first)))
    return tl.where(a_wins, a, b), tl.where(a_wins, ia, ib)


@triton.jit
def _argmax_chunk_kernel(
    x_ptr,  # [num_rows, V], row stride stride_row, unit column stride
    val_ptr,  # [num_rows, NUM_CHUNKS] float32 partial maxima
    idx_ptr,  # [num_rows, NUM_CHUNKS] int32 their indices
    V,
    stride_row,
    NUM_CHUNKS,
    BLOCK: tl.constexpr,
):
    """Stage 1: the first maximum of columns ``c * BLOCK .. (c + 1) * BLOCK - 1`` of row ``r``. Columns past ``V``
    read -inf with an index past every real column, so they never win against a real entry."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    # compared in float32 (exact for fp16/bf16); the masked columns are set after the load, as float32
    x = tl.where(mask, tl.load(x_ptr + row * stride_row + offs, mask=mask).to(tl.float32), float("-inf"))
    v, i = tl.reduce((x, offs), 0, _first_max)
    tl.store(val_ptr + row * NUM_CHUNKS + chunk, v)
    tl.store(idx_ptr + row * NUM_CHUNKS + chunk, i)


@triton.jit
def _argmax_merge_kernel(
    val_ptr,  # [num_rows, NUM_CHUNKS] float32
    idx_ptr,  # [num_rows, NUM_CHUNKS] int32
    out_ptr,  # [num_rows] int64
    NUM_CHUNKS,
    C_PAD: tl.constexpr,  # next power of two >= NUM_CHUNKS
):
    """Stage 2: row ``r``'s index from its chunks' pairs."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, C_PAD)
    mask = offs < NUM_CHUNKS
    v = tl.load(val_ptr + row * NUM_CHUNKS + offs, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + row * NUM_CHUNKS + offs, mask=mask, other=2147483647)
    _, best = tl.reduce((v, i), 0, _first_max)
    tl.store(out_ptr + row, best.to(tl.int64))
