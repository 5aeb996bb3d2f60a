"""Attention kernels over the paged KV cache, each with a PyTorch reference of the same signature.

Installed as ``paged_transformers.kernels`` (never as a top-level ``kernels``: that name belongs to
Hugging Face's own package).

Cache layout, per layer (vLLM's flash layout)::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset          (slot_mapping entries, int64; -1 = skip)
"""

from .cache_ops import reshape_and_cache_ref
from .paged_attention import paged_attention_ref

__all__ = ["reshape_and_cache_ref", "paged_attention_ref"]
