"""Attention of a ragged batch of query chunks over a paged KV cache.

One call covers prefill chunks and decode tokens alike. Sequence ``s`` owns the query rows
``query_start_loc[s] : query_start_loc[s+1]`` (``q_len`` rows) and has ``seq_lens[s]`` tokens of
context *including* those rows, so its new tokens sit at positions ``seq_lens[s] - q_len ...
seq_lens[s] - 1``::

    context of s:  | cached (computed in earlier steps) | new (this step's q_len tokens) |
                   0                       seq_lens[s]-q_len                  seq_lens[s]
    query row i attends to key j  iff  j <= pos(i)  and  pos(i) - j < sliding_window

The K/V of the whole context, new tokens included, are read from the cache through
``block_tables[s]``: write the new K/V first (``reshape_and_cache``).

Scores are ``scale * q.k``, then ``softcap * tanh(score / softcap)`` when a softcap is given
(Gemma-2), then softmax over the allowed keys; the softmax is computed in float32.
"""

import torch


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention for a ragged batch (PyTorch reference; also the ``"torch"`` backend).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, fp32/fp16/bf16.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, query's dtype.
            ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA/MQA/MHA).
        block_tables: ``[num_seqs, max_num_blocks_per_seq]`` int32; entries past a sequence's
            ``ceil(seq_lens[s] / block_size)`` blocks are ignored.
        seq_lens: ``[num_seqs]`` int32, context length in tokens including this step's queries.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query rows; ``[-1] == num_tokens``.
        scale: multiplier of ``q.k`` (usually ``head_dim ** -0.5``).
        sliding_window: if given, a query at position ``p`` sees keys ``p - sliding_window + 1 .. p``
            (transformers' convention).
        softcap: if given and > 0, logit soft-capping ``softcap * tanh(score / softcap)``.
        max_query_len, max_seq_len: host-side upper bounds (tokens) of the query rows and context of any
            sequence; kernels size their grids from them, this reference does not need them.
        out: optional ``[num_tokens, num_heads, head_dim]`` output buffer.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    groups = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[s, :num_blocks].long()
        # [num_blocks, block_size, Hkv, D] -> [seq_len, Hkv, D] -> [H, seq_len, D]
        k = key_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(groups, dim=1).transpose(0, 1)
        v = value_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(groups, dim=1).transpose(0, 1)
        q = query[q_start:q_end].float().transpose(0, 1)  # [H, q_len, D]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, q_len, seq_len]
        if softcap is not None and softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out
