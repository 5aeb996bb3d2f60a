"""Writing a step's new K/V into the paged cache (vLLM's ``reshape_and_cache_flash``): a Triton kernel,
its launch wrapper ``reshape_and_cache`` and the PyTorch reference ``reshape_and_cache_ref``.

Layout::

    key, value:              [num_tokens, num_kv_heads, head_dim]   (any row strides, unit stride on head_dim)
    key_cache, value_cache:  [num_blocks, block_size, num_kv_heads, head_dim]   (contiguous)
    slot_mapping:            [num_tokens] int64, slot = block_id * block_size + offset; -1 = skip
"""

import torch

from .._launch import check_device, load_triton_kernels, next_power_of_2


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into their cache slots, in place (Triton kernel).

    Same contract as ``reshape_and_cache_ref``. One program per token; nothing is read back to the
    host, so the call can be captured in a CUDA graph.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype; any strides on the
            first two dims, stride 1 on ``head_dim``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous,
            written in place.
        slot_mapping: ``[num_tokens]`` int64; -1 skips the token. Slots must be ``< num_blocks *
            block_size`` (not checked: that would need a device-to-host copy).

    Raises:
        ValueError: a tensor of the wrong rank, shape, dtype, device or layout (the message names it).
        RuntimeError: CPU tensors without the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    _check_cache_args(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kernels = load_triton_kernels("cache_ops.triton_kernels", key.device)
    kernels._reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        H_PAD=next_power_of_2(num_kv_heads), D_PAD=next_power_of_2(head_dim),
        num_warps=4,
    )


def _check_cache_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Raise ``ValueError`` naming the first argument of ``reshape_and_cache`` that is malformed."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if tuple(key.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(
            f"key rows [num_kv_heads, head_dim] = {tuple(key.shape[1:])} do not match the cache's "
            f"{tuple(key_cache.shape[2:])}"
        )
    for name, t in (("key", key), ("value", value), ("value_cache", value_cache)):
        if t.dtype != key_cache.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, but key_cache has {key_cache.dtype}")
    if key_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"cache dtype must be float16, bfloat16 or float32, got {key_cache.dtype}")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError(f"key and value need stride 1 on head_dim, got strides {key.stride()} and {value.stride()}")
    if not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("key_cache and value_cache must be contiguous")
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must be int64 [num_tokens={key.shape[0]}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    check_device(key_cache.device, key=key, value=value, value_cache=value_cache, slot_mapping=slot_mapping)


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
