"""The Triton kernels: attention over the paged KV cache and the rest, each with a PyTorch reference of the same
signature.

Installed as ``paged_transformers.kernels`` (never as a top-level ``kernels``: that name belongs to
Hugging Face's own package). The folder has no ``__init__.py``, so that from the checkout root (the current
directory first on ``sys.path``) ``import kernels`` still finds Hugging Face's: a folder without one is only a
namespace portion, and a regular package later on the path wins over it. What a package init would export is
here: import it from ``paged_transformers.kernels.api`` (or a family's folder).

Cache layout, per layer (vLLM's flash layout)::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset          (slot_mapping entries, int64; -1 = skip)

One folder per family, ``kernels/<family>/``: its ``__init__`` holds the wrapper (which validates every argument and
launches the kernels) and the PyTorch reference of the same signature; ``triton_kernels.py`` holds the
``@triton.jit`` kernels (``_launch.py`` says why they are a module of their own).

| function (Triton) / reference (PyTorch) | what | family |
|---|---|---|
| ``reshape_and_cache`` / ``reshape_and_cache_ref`` | write a step's K/V into its slots | ``cache_ops/`` |
| ``paged_attention`` / ``paged_attention_ref`` | ragged prefill + decode attention, split-KV decode | ``paged_attention/`` |
| ``argmax_rows`` / ``torch.argmax`` | the greedy sampler's row argmax (NaN and ties as torch) | ``argmax/`` |
| ``gemv`` / ``gemv_ref`` | the batch-1 bf16/fp16 projections | ``gemv/`` |
| ``rms_norm``, ``rotary_embedding``, ``silu_and_mul`` / ``*_ref`` | a Llama layer's ops between its projections | ``layer_ops/`` |
| ``w4a16_matmul`` / ``w4a16_matmul_ref`` | GPTQ/AWQ 4-bit projections, a table-driven dispatch | ``w4a16/`` |

The ``"torch"`` backend (CPU's path), ``torch_attention.paged_attention_torch`` / ``reshape_and_cache_torch``, has
the same contracts and attends the whole ragged batch in batched ops; it is tested against the references.
Whether a backend can be captured in a CUDA graph is declared by ``attention.AttentionOps.graph_capturable``.

``compile_only()`` turns launches into compiles without a run, in a pool of threads, for the engine's dummy warm-up
forwards (``_launch.py``).

Importing this package imports neither triton nor a ``@triton.jit`` kernel: they load on the first
launch (see ``_launch.py`` for why).
"""

from ._launch import compile_only
from .cache_ops import reshape_and_cache, reshape_and_cache_ref
from .paged_attention import paged_attention, paged_attention_ref

__all__ = ["compile_only", "reshape_and_cache", "reshape_and_cache_ref", "paged_attention", "paged_attention_ref"]
