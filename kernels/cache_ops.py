"""Writing a step's new K/V into the paged cache (vLLM's ``reshape_and_cache_flash``).

Layout::

    key, value:              [num_tokens, num_kv_heads, head_dim]
    key_cache, value_cache:  [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:            [num_tokens] int64, slot = block_id * block_size + offset; -1 = skip
"""

import torch


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into their cache slots, in place (PyTorch reference).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: ``[num_tokens]`` int64; token ``t`` goes to block ``slot // block_size``, row
            ``slot % block_size``. Entries equal to -1 are skipped (padding).
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = key[valid]
    value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = value[valid]
