"""The attention function registered with transformers: write the step's K/V into the paged cache,
then attend through the block tables.

transformers calls it in place of eager/SDPA attention once the model's ``attn_implementation`` is
``ATTENTION_NAME``. The runner hands each step's metadata to ``model(...)`` as the keyword argument
``paged_metadata``; transformers forwards unknown keyword arguments down to the attention function.
Some models' decoder layers drop those keyword arguments (StableLM, in transformers 5.24), so the
engine also installs ``forward_context.install_step_hooks`` on the model: they keep the metadata of the
forward in progress, and the attention function falls back to it (``current_metadata``).
"""

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AttentionInterface

from ..config import AttentionBackend
from ..forward_context import current_metadata
from .kv_pool import KVPool

# NOTE: transformers keys behaviour off the substrings flash, sdpa, flex, "paged|" and "/" in an
# implementation name; this one contains none of them, so it gets attention_mask=None.
ATTENTION_NAME = "paged_transformers"


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's ragged batch, as the attention function needs it.

    The step packs ``num_seqs`` sequences into ``num_tokens`` query rows::

        rows:  | seq 0: q_len_0 rows | seq 1: q_len_1 rows | ... |
               query_start_loc[0]=0  query_start_loc[1]   ...   query_start_loc[num_seqs]=num_tokens
    """

    cache: KVPool  # the engine's K/V tensors (key_cache[layer], value_cache[layer])
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V goes to
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context length in tokens, this step's tokens included
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query rows
    max_query_len: int  # tokens; max over seqs of this step's rows
    max_seq_len: int  # tokens; max(seq_lens)
    write_kv: Callable[..., None]  # reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    attend: Callable[..., torch.Tensor]  # paged_attention(query, key_cache, value_cache, block_tables, ...)
    attend_plan: object = None  # attend.plan(...) of this step, given to every layer's attend (backends with one)


@dataclass(frozen=True, slots=True)
class AttentionOps:
    """One attention backend: the functions the attention calls, and whether a CUDA graph can capture them.

    An ``attend`` with a ``plan`` attribute gets ``plan=attend.plan(block_tables, seq_lens, query_start_loc,
    block_size, num_tokens, max_query_len, max_seq_len)``, made once per step by the runner and shared by every layer.
    """

    write_kv: Callable[..., None]  # reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    attend: Callable[..., torch.Tensor]  # paged_attention(query, key_cache, value_cache, block_tables, ...)
    # True: given max_query_len / max_seq_len, neither function reads metadata on the host (.tolist(), int(...)),
    # so a decode step can be recorded in a CUDA graph (``ModelRunner``)
    graph_capturable: bool


def resolve_backend(backend: AttentionBackend, device: torch.device) -> AttentionOps:
    """The functions of ``backend`` on ``device``.

    ``AUTO`` is Triton on CUDA and the PyTorch implementation elsewhere (``kernels/torch_attention.py``: the
    whole ragged batch in batched ops, reading metadata on the host, so no CUDA graph; ``paged_attention_ref``
    stays the reference it is tested against). ``TRITON`` on a CPU tensor needs the Triton interpreter
    (``TRITON_INTERPRET=1`` set before triton is imported); its wrappers read nothing back, so graphs can
    capture them.

    Raises:
        RuntimeError: Triton asked for on CPU without ``TRITON_INTERPRET=1``, or triton not installed.
    """
    if backend is AttentionBackend.AUTO:
        backend = AttentionBackend.TRITON if device.type == "cuda" else AttentionBackend.TORCH
    if backend is AttentionBackend.TORCH:
        from ..kernels.torch_attention import paged_attention_torch, reshape_and_cache_torch

        return AttentionOps(reshape_and_cache_torch, paged_attention_torch, graph_capturable=False)
    import os

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"attention_backend='triton' on device {device} needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before starting Python, or use attention_backend='torch'"
        )
    try:
        from ..kernels.api import paged_attention, reshape_and_cache
    except ImportError as e:
        raise RuntimeError(f"attention_backend='triton' needs the triton package: {e}") from e
    return AttentionOps(reshape_and_cache, paged_attention, graph_capturable=True)


@torch.compiler.disable  # the split point of compiled decoder layers (``compilation.layers``): never traced
def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    paged_metadata: AttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged cache, with transformers' attention-function signature.

    Args:
        module: the attention layer (``layer_idx`` selects the cache tensors).
        query: ``[1, num_heads, num_tokens, head_dim]``; key, value: ``[1, num_kv_heads, num_tokens, head_dim]``.
        attention_mask: ignored (None for this implementation); masking comes from the metadata.
        scaling: multiplier of ``q.k``; default ``head_dim ** -0.5``.
        sliding_window: the layer's window in tokens (Mistral, Qwen2, Gemma-2), or None.
        softcap: attention logit soft-capping (Gemma-2), or None.
        paged_metadata: the step's ``AttentionMetadata``.

    Returns:
        ``([1, num_tokens, num_heads, head_dim], None)``.

    Raises:
        RuntimeError: called without ``paged_metadata`` (a plain forward on a model switched to the paged
            implementation), or with dropout in training mode.
    """
    if paged_metadata is None:
        paged_metadata = current_metadata()
    if paged_metadata is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation={ATTENTION_NAME!r}, which only works inside the paged "
            "engine; switch the model back with model.set_attn_implementation('sdpa') for plain forwards"
        )
    if dropout and module.training:
        raise RuntimeError(
            f"{type(module).__name__} is in training mode with attention dropout {dropout}; the paged engine "
            "only runs inference: call model.eval() first"
        )
    md = paged_metadata
    # [1, H, T, D] -> [T, H, D]
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    layer = module.layer_idx
    key_cache, value_cache = md.cache.key_cache[layer], md.cache.value_cache[layer]
    md.write_kv(k, v, key_cache, value_cache, md.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    extra = {} if md.attend_plan is None else {"plan": md.attend_plan}
    out = md.attend(
        q, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale,
        sliding_window=sliding_window, softcap=softcap, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
        **extra,
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
