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

``paged_attention`` launches the Triton kernels of ``triton_kernels.py``; ``paged_attention_ref``
is the PyTorch reference (and the ``"torch"`` backend). Launch plan of the Triton path::

    launch 1 (decode tiles, 16 rows): sequences with q_len <= BLOCK_Q     grid (num_seqs, num_kv_heads, num_kv_splits)
    launch 2 (prefill tiles, 128 rows), only if max_query_len > that BLOCK_Q: the other sequences
                                               grid (num_tokens // BLOCK_Q + num_seqs, num_kv_heads, num_kv_splits)
      (an upper bound of the query tiles; spare tiles and the other launch's sequences exit at once)
    num_kv_splits > 1 (flash-decoding, decode-only batches by default): each program covers
      1/num_kv_splits of its sequence's KV tiles and writes fp32 partials; a third kernel merges them
      by log-sum-exp.
"""

from dataclasses import dataclass

import torch

from .._launch import cdiv, check_device, load_triton_kernels, next_power_of_2, num_sms

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# Flash-decoding split heuristic: aim for SPLIT_PROGRAMS_PER_SM programs per multiprocessor, but give
# each split at least MIN_KEYS_PER_SPLIT keys (fewer would spend more on the merge than they save). 192: a batch-1
# decode at context 512, with graphs captured for the bound 1536, gets 8 splits of 64-key tiles, one tile in each
# split; 256 gives 6 splits, 2 of them idle, and attention + merge took about 20% longer
# (``bench_kernels.py --batch1-sweep``).
SPLIT_PROGRAMS_PER_SM = 4
MIN_KEYS_PER_SPLIT = 192
MAX_KV_SPLITS = 128
INTERPRETER_NUM_SMS = 4  # SMs that CPU (interpreter) runs plan for: few splits, so the runs stay short
INT32_MAX = 2**31 - 1
_LONG_CHUNK = 1 << 16  # query rows of a chunk that gets the largest prefill tile


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Tile shape and launch knobs of ``_unified_attention_kernel``.

    ``block_m`` rows per program = ``block_q`` query rows x ``G`` query heads of one KV head (rows
    past ``block_q * G`` are masked); ``tile_n`` keys per KV tile (any size: keys are gathered one
    by one through the block table, so a tile may span several blocks or part of one).
    ``prefetch_block_ids`` loads the next KV tile's block ids one iteration ahead, which lets Triton's
    pipeliner keep ``num_stages`` K/V buffers in flight (without it: 2 buffers and a wait for every copy
    at each tile; see ``triton_kernels._attend_tiles``). ``fma_scores`` applies the softmax scale
    inside the exponent (one FFMA per score). The prefill sweep (``bench_kernels.py --prefill-sweep``) chose
    both for the prefill tiles of ``pick_config``.
    """

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    prefetch_block_ids: bool = False
    fma_scores: bool = False


def pick_config(max_query_len: int, num_queries_per_kv: int, head_dim: int, dtype: torch.dtype) -> KernelConfig:
    """Tile shape for a batch whose longest query chunk is ``max_query_len`` rows.

    Decode (``max_query_len * G <= 16``) gets 16 rows, the smallest ``tl.dot`` tile; prefill gets
    128 rows (64 for head_dim > 128 or fp32, to stay within registers and shared memory; 32 for fp32 with
    head_dim > 128, whose ieee-precision dots unroll into FMAs: the 64-row kernel takes about 3x as long to compile
    for sm_90 as the 32-row one, long enough to stall the GPU test runs).

    NOTE: fp16/bf16 with head_dim <= 128 use the best configs of the config sweep of ``bench_kernels.py``
    (docs/benchmark-history.md, "Attention kernels"): 128-row prefill tiles with 32-key tiles, 4 warps, 3 stages,
    block ids prefetched a tile ahead and the scale inside the exponent (about 9% less time on 8 x 2048 causal than
    4 stages without the two options); smaller tiles with 64-key tiles, 4 warps, 2 stages (nearer the copy
    bandwidth than 3 stages, at decode batch 64 x 4096 and at batch 1 x 32k). Rows of 32 and 64 were not swept.
    """
    d_pad = next_power_of_2(head_dim)
    wide = d_pad > 128 or dtype == torch.float32
    max_m = 32 if d_pad > 128 and dtype == torch.float32 else 64 if wide else 128
    block_m = min(max(16, next_power_of_2(max_query_len * num_queries_per_kv)), max_m)
    block_m = max(block_m, next_power_of_2(num_queries_per_kv))  # at least one query row
    if wide:
        return KernelConfig(block_m=block_m, tile_n=32, num_warps=4, num_stages=2)
    if block_m >= 128:
        return KernelConfig(block_m=block_m, tile_n=32, num_warps=4, num_stages=3, prefetch_block_ids=True,
                            fma_scores=True)
    return KernelConfig(block_m=block_m, tile_n=64, num_warps=4, num_stages=2)


def pick_num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits of each sequence's KV range for a decode batch, from host ints only (graph-safe).

    Enough programs to give every multiprocessor ``SPLIT_PROGRAMS_PER_SM`` of them, with at least
    ``MIN_KEYS_PER_SPLIT`` keys per split: batch 1 x 8 KV heads x 32k context on 132 SMs -> 66
    splits of ~500 keys; batch 64 x 8 KV heads -> 1 (512 programs already).
    """
    programs = max(num_seqs * num_kv_heads, 1)
    want = cdiv(SPLIT_PROGRAMS_PER_SM * num_sms(device, INTERPRETER_NUM_SMS), programs)
    return max(1, min(want, cdiv(max_seq_len, MIN_KEYS_PER_SPLIT), MAX_KV_SPLITS))


def paged_attention(
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
    *,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Paged attention for a ragged batch of prefill chunks and decode tokens (Triton kernels).

    Same contract as ``paged_attention_ref``. With ``max_query_len`` and ``max_seq_len`` given the
    call reads nothing back from the device (no host sync), so a decode step can be captured in a
    CUDA graph; the grid depends only on host ints (tensor shapes and those two bounds). For
    fixed-capacity buffers, sequences with ``q_len == 0`` are skipped and rows past
    ``query_start_loc[num_seqs]`` are left unwritten.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` fp16/bf16/fp32, stride 1 on ``head_dim``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, query's dtype,
            contiguous; ``num_heads % num_kv_heads == 0``; ``head_dim <= 256`` (any value: padded to a
            power of two by masking).
        block_tables: ``[num_seqs, max_num_blocks_per_seq]`` int32, stride 1 on the last dim.
        seq_lens: ``[num_seqs]`` int32, context in tokens including this step's queries.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query rows.
        scale: multiplier of ``q.k``.
        sliding_window: window in tokens (transformers' convention: position ``p`` sees ``p - W + 1 .. p``).
        softcap: logit soft-capping; None or 0 disables it.
        max_query_len, max_seq_len: host upper bounds (tokens) of any sequence's query rows and
            context; computed from the tensors (a host sync) when None. ``max_query_len`` picks the
            tile shape and ``max_seq_len`` the number of KV splits, so upper bounds are fine.
        out: optional output ``[num_tokens, num_heads, head_dim]``, query's dtype, stride 1 on ``head_dim``.
        num_kv_splits: split each sequence's KV range over this many programs (flash-decoding), 1 to
            ``MAX_KV_SPLITS``; default ``pick_num_kv_splits`` when every sequence's queries fit one tile
            (decode), else 1.

    Returns:
        ``out`` (or a new tensor) ``[num_tokens, num_heads, head_dim]`` in the query's dtype.

    Raises:
        ValueError: a malformed argument (the message names it and what is allowed).
        RuntimeError: CPU tensors without the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out)
    for name, value in (("scale", scale), ("softcap", softcap)):
        if value is not None and not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a Python number, got {type(value).__name__}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap must be >= 0 or None, got {softcap}")
    if num_kv_splits is not None and (type(num_kv_splits) is not int or not 0 < num_kv_splits <= MAX_KV_SPLITS):
        raise ValueError(f"num_kv_splits must be an int in [1, {MAX_KV_SPLITS}] or None, got {num_kv_splits!r}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:  # host syncs, only when the caller did not give the bounds
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    for name, value in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if max_query_len == 0:
        return out
    bands = plan_launches(max_query_len, num_heads // num_kv_heads, head_dim, query.dtype)
    if num_kv_splits is None:  # split-KV only for decode-only batches (one launch of decode tiles)
        num_kv_splits = pick_num_kv_splits(num_seqs, num_kv_heads, max_seq_len, query.device) if len(bands) == 1 else 1
    launch_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, float(scale),
                     sliding_window, softcap if softcap else None, num_kv_splits, bands)
    return out


@dataclass(frozen=True, slots=True)
class QueryBand:
    """One launch: the sequences with ``min_q_len <= q_len <= max_q_len``, computed with tiles ``cfg``."""

    cfg: KernelConfig
    min_q_len: int
    max_q_len: int


def plan_launches(max_query_len: int, num_queries_per_kv: int, head_dim: int, dtype: torch.dtype) -> list[QueryBand]:
    """Launches for a batch whose longest query chunk is ``max_query_len`` rows (host ints only).

    Decode-sized sequences (``q_len <= `` the decode tile's ``block_q``) get 16-row tiles; longer ones
    get prefill tiles in a second launch over the same batch, where decode sequences exit at once. The prefill tile
    is the largest (``pick_config`` of a long chunk) whatever ``max_query_len`` is: a tile shape is a kernel variant
    compiled when first seen, so shapes picked per batch would compile in the middle of serving (0.5-1 s each), while
    a batch whose longest chunk is 5-16 rows is rare and its attention a small part of its step.
    NOTE: one launch with prefill tiles for a mixed batch made each decode token fill a 128-row tile
    (1 valid row of 32 query rows): 1 prefill of 2048 + 63 decodes at 4096 took about 1.5x the time of the two
    launches (docs/benchmark-history.md).
    """
    decode = pick_config(1, num_queries_per_kv, head_dim, dtype)
    decode_q = decode.block_m // num_queries_per_kv
    if max_query_len <= decode_q:
        return [QueryBand(decode, 1, decode_q)]
    prefill = pick_config(_LONG_CHUNK, num_queries_per_kv, head_dim, dtype)
    return [QueryBand(decode, 1, decode_q), QueryBand(prefill, decode_q + 1, INT32_MAX)]


def launch_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, scale,
                     sliding_window, softcap, num_kv_splits: int, bands: list[QueryBand]) -> None:
    """Launch the kernels on validated inputs with explicit launches (``paged_attention`` and benchmarks)."""
    kernels = load_triton_kernels("paged_attention.triton_kernels", query.device)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    num_queries_per_kv = num_heads // num_kv_heads
    d_pad = max(16, next_power_of_2(head_dim))  # tl.dot needs K >= 16
    split = num_kv_splits > 1
    if split:
        part_out = torch.empty((num_tokens, num_heads, num_kv_splits, d_pad), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((num_tokens, num_heads, num_kv_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_out = part_ml = out  # unused
    for band in bands:
        cfg = band.cfg
        block_q = cfg.block_m // num_queries_per_kv
        one_tile_per_seq = band.max_q_len <= block_q
        # Sequence s owns tiles query_start_loc[s] // block_q + s ...: at most num_tokens // block_q + num_seqs.
        num_q_tiles = num_seqs if one_tile_per_seq else num_tokens // block_q + num_seqs
        kernels._unified_attention_kernel[(num_q_tiles, num_kv_heads, num_kv_splits)](
            out, part_out, part_ml, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            num_seqs, num_kv_splits, band.min_q_len, band.max_q_len, scale, softcap or 1.0, sliding_window or 0,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
            NUM_QUERIES_PER_KV=num_queries_per_kv, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=key_cache.shape[1],
            BLOCK_Q=block_q, BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n, ONE_TILE_PER_SEQ=one_tile_per_seq,
            USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
            SPLIT=split, DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
            # NOTE: Triton 3.9's interpreter keeps bf16 as raw uint16 bits and its tl.dot multiplies those
            # bits; on CPU (interpreter only) bf16 operands are widened to fp32 before each dot.
            UPCAST_DOT=query.device.type != "cuda" and query.dtype == torch.bfloat16,
            PREFETCH_BLOCK_IDS=cfg.prefetch_block_ids, FMA_SCORES=cfg.fma_scores,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if split:
        kernels._merge_splits_kernel[(num_seqs, num_heads)](
            out, part_out, part_ml, query_start_loc, num_kv_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS_PAD=next_power_of_2(num_kv_splits), num_warps=4,
        )


def _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out) -> None:
    """Raise ``ValueError`` naming the first malformed tensor argument of ``paged_attention``."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    if query.dtype not in _DTYPES:
        raise ValueError(f"query dtype must be float16, bfloat16 or float32, got {query.dtype}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype != query.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, but query has {query.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if query.stride(2) != 1:
        raise ValueError(f"query needs stride 1 on head_dim, got strides {query.stride()}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables must be int32 [num_seqs, max_num_blocks_per_seq] with stride 1 on the last dim, got "
            f"{block_tables.dtype} {tuple(block_tables.shape)} strides {block_tables.stride()}"
        )
    num_seqs = block_tables.shape[0]
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (num_seqs,) or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be contiguous int32 [num_seqs={num_seqs}], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if (query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (num_seqs + 1,)
            or not query_start_loc.is_contiguous()):
        raise ValueError(f"query_start_loc must be contiguous int32 [num_seqs + 1 = {num_seqs + 1}], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1):
        raise ValueError(f"out must be {query.dtype} {tuple(query.shape)} with stride 1 on head_dim, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    tensors = dict(query=query, value_cache=value_cache, block_tables=block_tables, seq_lens=seq_lens,
                   query_start_loc=query_start_loc)
    if out is not None:
        tensors["out"] = out
    check_device(key_cache.device, **tensors)


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
    """Paged attention for a ragged batch (PyTorch reference: one sequence at a time, the obvious way; the
    Triton kernels and the batched ``"torch"`` backend, ``torch_attention.paged_attention_torch``, are tested
    against it).

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
