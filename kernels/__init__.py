"""Attention kernels over the paged KV cache, each with a PyTorch reference of the same signature.

Installed as ``paged_transformers.kernels`` (never as a top-level ``kernels``: that name belongs to
Hugging Face's own package).

Cache layout, per layer (vLLM's flash layout)::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset          (slot_mapping entries, int64; -1 = skip)

| function (Triton) / reference (PyTorch) | what | wrapper and reference / Triton kernels |
|---|---|---|
| ``reshape_and_cache`` / ``reshape_and_cache_ref`` | write a step's K/V into its slots | ``cache_ops`` / ``cache_ops_kernels`` |
| ``paged_attention`` / ``paged_attention_ref`` | ragged prefill + decode attention, split-KV decode | ``paged_attention`` / ``paged_attention_kernels`` |

The other families have the same shape (``_launch.py``): ``argmax``, ``gemv``, and the ``w4a16`` subpackage.
The ``"torch"`` backend (CPU's path), ``torch_attention.paged_attention_torch`` / ``reshape_and_cache_torch``, has
the same contracts and attends the whole ragged batch in batched ops; it is tested against the references.
Whether a backend can be captured in a CUDA graph is declared by ``attention.AttentionOps.graph_capturable``.

Importing this package imports neither triton nor a ``@triton.jit`` kernel: they load on the first
launch (see ``_launch.py`` for why).
"""

from .cache_ops import reshape_and_cache, reshape_and_cache_ref
from .paged_attention import paged_attention, paged_attention_ref

__all__ = ["reshape_and_cache", "reshape_and_cache_ref", "paged_attention", "paged_attention_ref"]
