"""Triton kernel of ``checksum.checksums`` (its only caller, which validates the inputs and builds the chunk table).

Grid ``(num_chunks,)``: program ``c`` reads chunk ``c`` of the table, up to ``BLOCK * ITERS`` int32 words of one
array starting at word ``start``, and writes ``sum(w_i * (i * K + 1))`` over them (int64 arithmetic, wrapping
modulo 2**64; ``i`` is the word's index in its array) to ``out[c]``. The caller adds the chunks of each array.
"""

import triton
import triton.language as tl


@triton.jit
def _checksum_chunk_kernel(
    base_ptr,  # [num_chunks] int64: address of the first word of the chunk's array
    start_ptr,  # [num_chunks] int64: index of the chunk's first word in its array
    length_ptr,  # [num_chunks] int64: words in the chunk (1 .. BLOCK * ITERS)
    out_ptr,  # [num_chunks] int64: the chunk's sum
    K: tl.constexpr,  # the even multiplier of the position weight i * K + 1
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    c = tl.program_id(0)
    words = tl.load(base_ptr + c).to(tl.pointer_type(tl.int32))
    start = tl.load(start_ptr + c)
    length = tl.load(length_ptr + c)
    lanes = tl.arange(0, BLOCK)
    lane_weights = lanes.to(tl.int64) * K  # the weight of word start + it * BLOCK + j is this + (start + it * BLOCK) * K + 1
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for it in range(ITERS):
        first = start + it * BLOCK  # int64
        mask = it * BLOCK + lanes < length
        w = tl.load(words + first + lanes, mask=mask, other=0).to(tl.int64)  # sign-extended
        acc += w * (lane_weights + (first * K + 1))
    tl.store(out_ptr + c, tl.sum(acc, axis=0))
