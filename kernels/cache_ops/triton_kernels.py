"""Triton kernel of ``cache_ops.reshape_and_cache`` (its only caller, which validates the inputs).

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous; ``slot_mapping`` entries
are ``block_id * block_size + offset`` (int64), -1 = skip.
"""

import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_dim], unit stride on head_dim
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    stride_kt, stride_kh, stride_vt, stride_vh,  # key / value strides of token and head (elements)
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    """Copy token ``t``'s K and V rows to cache slot ``slot_mapping[t]``; grid ``(num_tokens,)``."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    if slot < 0:  # padding token
        return
    offs_h = tl.arange(0, H_PAD)[:, None]
    offs_d = tl.arange(0, D_PAD)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    # the cache is contiguous: slot s starts at element s * NUM_KV_HEADS * HEAD_DIM
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h * HEAD_DIM + offs_d
    k = tl.load(key_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)
