"""Triton kernels of paged attention: one kernel for ragged prefill + decode batches, with an
optional split of the KV range (flash-decoding), and the log-sum-exp merge of the splits.

Only ``paged_attention.paged_attention`` launches these; it validates the inputs and derives the
grids. Algorithm: FlashAttention-2's online softmax (Dao, 2023; the Triton tutorial
``06-fused-attention.py``) over KV tiles gathered through the block table, as in vLLM's
``triton_unified_attention`` (query tiles of one sequence, all query heads of one KV head
together); the split-KV path is flash-decoding (Dao et al., 2023): each split keeps its own
running max and sum, and ``_merge_splits_kernel`` rescales and adds them.

Tile of one program (GQA: ``G = num_heads // num_kv_heads`` query heads share a KV head)::

    rows r = 0 .. BLOCK_M-1  ->  query row  q_block * BLOCK_Q + r // G  of the sequence,
                                  query head kv_head * G + r % G
                                  (rows r >= BLOCK_Q * G, or past the sequence's q_len: masked)
    keys j = tile * TILE_N + 0 .. TILE_N-1  ->  cache row
         block_tables[seq, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE

Key tiles of one query tile, for the positions p_first .. p_last of its rows::

    0     kv_lo          full_lo              full_hi            kv_hi = p_last + 1
    |.....|--- masked ---|----- no mask ------|---- masked ------|
           (window edge)   every row sees all    (causal diagonal, end of sequence)

with ``kv_lo = max(p_first - sliding_window + 1, 0)`` (0 without a window), ``full_lo = max(p_last -
sliding_window + 1, 0)`` and ``full_hi = p_first + 1``. Tiles wholly inside ``[full_lo, full_hi)``
skip the mask arithmetic.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``; scores are kept in log2 units
(multiplied by ``LOG2E``) so the kernel can use ``exp2``.
"""

import triton
import triton.language as tl

# 1 / ln(2): exp(x) == exp2(x * LOG2E). A tl.constexpr object, not an annotation: triton 3.6 rejects
# non-constexpr module globals inside @triton.jit (3.9 accepts them).
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence that owns global query tile ``q_block_id``.

    Sequence ``s`` owns tiles from ``query_start_loc[s] // BLOCK_Q + s`` on (that start is monotone
    in ``s`` and leaves each sequence at least ``cdiv(q_len, BLOCK_Q)`` tiles); a binary search finds
    the last ``s`` whose start is ``<= q_block_id``.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if start // BLOCK_Q + mid <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_block_ids(block_table_ptr, tile, seq_len, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """``[TILE_N]`` int32 block id of each key of KV tile ``tile`` (0 for keys at or past ``seq_len``,
    so a tile past the sequence's end reads no block-table entry beyond its ``cdiv(seq_len, BLOCK_SIZE)``)."""
    offs_n = tile * TILE_N + tl.arange(0, TILE_N)
    return tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=offs_n < seq_len, other=0)


@triton.jit
def _attend_tiles(
    acc, m_i, l_i,  # [BLOCK_M, D_PAD] fp32, [BLOCK_M] fp32 (log2 units), [BLOCK_M] fp32
    q,  # [BLOCK_M, D_PAD], the cache's dtype
    q_pos,  # [BLOCK_M] int32: position of each row in its sequence
    k_head_ptr, v_head_ptr,  # cache base pointers offset to this KV head
    block_table_ptr,  # this sequence's row of block_tables
    tile_lo, tile_hi,  # KV tiles [tile_lo, tile_hi) to visit
    seq_len, scale, softcap, sliding_window,
    stride_cb, stride_cs,  # cache strides of block and slot (elements)
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PREFETCH_BLOCK_IDS: tl.constexpr,  # load tile t+1's block ids in iteration t (see below)
    FMA_SCORES: tl.constexpr,  # scale scores inside the exponent (one FFMA per score; see below)
):
    """Online-softmax update of ``(acc, m_i, l_i)`` over KV tiles ``[tile_lo, tile_hi)``.

    ``MASKED=False`` is only for tiles every row may see in full (keys below all rows' positions and
    inside all rows' windows): it skips the mask and the guard for rows with no visible key.

    ``PREFETCH_BLOCK_IDS``: the block ids of the next tile are loaded one iteration ahead and carried
    in registers. NOTE: when the K/V addresses depend on a block-table load of the same iteration,
    Triton's software pipeliner (3.6-3.9) turns that load into an async copy too and then waits for
    *all* copies (``async_wait num=0``) at the top of every iteration with 2 K/V buffers, so the next
    tile's K/V loads are only in flight during the PV product. With the ids loop-carried it keeps
    ``num_stages`` buffers and waits for the oldest copy only (``num = num_stages - 1``), as for a
    contiguous KV range (read from the sm_90 TTGIR compiled on CPU).

    ``FMA_SCORES`` (no softcap): ``scale * LOG2E`` is applied to the row max and inside the exponent,
    ``p = 2^(s * c - m)`` as the Triton tutorial does, instead of to every score before the max.
    """
    offs_n0 = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d[None, :] < HEAD_DIM  # [1, D_PAD]
    if PREFETCH_BLOCK_IDS:
        blk_next = _load_block_ids(block_table_ptr, tile_lo, seq_len, BLOCK_SIZE, TILE_N)
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + offs_n0  # [TILE_N] key positions
        if MASKED:
            in_seq = offs_n < seq_len
            kv_mask = in_seq[:, None] & d_mask
        else:
            kv_mask = d_mask
        if PREFETCH_BLOCK_IDS:
            blk = blk_next
            blk_next = _load_block_ids(block_table_ptr, tile + 1, seq_len, BLOCK_SIZE, TILE_N)
        elif MASKED:
            blk = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=in_seq, other=0)
        else:
            blk = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
        # [TILE_N, 1] element offset of each key's row for this head
        row = (blk.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs)[:, None]
        if MASKED or HEAD_DIM != D_PAD:
            k = tl.load(k_head_ptr + row + offs_d[None, :], mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_head_ptr + row + offs_d[None, :])
        if UPCAST_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] fp32
        if USE_SOFTCAP:
            # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1): finite at both ends
            s = s * scale / softcap
            s = softcap * (1.0 - 2.0 / (tl.math.exp2(s * (2.0 * LOG2E)) + 1.0)) * LOG2E
        elif not FMA_SCORES:
            s = s * (scale * LOG2E)
        if MASKED:
            visible = (offs_n[None, :] <= q_pos[:, None]) & in_seq[None, :]
            if USE_WINDOW:
                visible = visible & ((q_pos[:, None] - offs_n[None, :]) < sliding_window)
            s = tl.where(visible, s, float("-inf"))
        if FMA_SCORES and not USE_SOFTCAP:
            # raw scores: max(s) * c == max(s * c) for c = scale * LOG2E > 0, so the row max is scaled
            # ([BLOCK_M] multiplies) and p = 2^(s * c - m) is one FFMA per score instead of FMUL + FADD
            m_new = tl.maximum(m_i, tl.max(s, 1) * (scale * LOG2E))
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # a row with no visible key so far keeps m = -inf (the merge of splits relies on it);
            # subtract 0 there instead of computing -inf - -inf = nan
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        if FMA_SCORES and not USE_SOFTCAP:
            p = tl.math.exp2(s * (scale * LOG2E) - m_sub[:, None])
        else:
            p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
        if MASKED or HEAD_DIM != D_PAD:
            v = tl.load(v_head_ptr + row + offs_d[None, :], mask=kv_mask, other=0.0)
        else:
            v = tl.load(v_head_ptr + row + offs_d[None, :])
        if UPCAST_DOT:
            v = v.to(tl.float32)
        acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


# NOTE: Triton specializes an int argument on == 1 and on divisibility by 16, compiling a variant per combination
# the first time it is seen. The batch's counts change every step, so left specialized they compile variants in the
# middle of serving (0.5-1 s each); they only bound loops and masks, which need no such hints.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "min_q_len", "max_q_len"])
def _unified_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] (SPLIT == False)
    part_out_ptr,  # [num_tokens, num_heads, num_splits, D_PAD] fp32, unnormalized (SPLIT == True)
    part_ml_ptr,  # [num_tokens, num_heads, num_splits, 2] fp32: running max (log2 units), sum
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32, context incl. this step's queries
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs, num_splits, min_q_len, max_q_len, scale, softcap, sliding_window,
    stride_qt, stride_qh, stride_ot, stride_oh,  # query / out strides of token and head (elements)
    stride_cb, stride_cs, stride_ch,  # cache strides of block, slot and head (elements)
    stride_bt,  # block_tables row stride (elements)
    NUM_QUERIES_PER_KV: tl.constexpr,  # G
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    ONE_TILE_PER_SEQ: tl.constexpr,  # every sequence has <= BLOCK_Q query rows: tile id == seq
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # dot in fp32: the interpreter's bf16 tl.dot is wrong (see paged_attention)
    PREFETCH_BLOCK_IDS: tl.constexpr,  # block ids one KV tile ahead (see _attend_tiles)
    FMA_SCORES: tl.constexpr,  # scores scaled inside the exponent (see _attend_tiles)
):
    """One (query tile, KV head, KV split) per program; grid ``(num_q_tiles, num_kv_heads, num_splits)``.

    ``num_splits`` is a runtime int (a new split count must not recompile); ``SPLIT`` = num_splits > 1.
    Only sequences with ``min_q_len <= q_len <= max_q_len`` are computed (the wrapper gives decode-sized
    and prefill-sized sequences of one batch to two launches with different tile shapes).
    """
    tl.static_assert(BLOCK_Q * NUM_QUERIES_PER_KV <= BLOCK_M)
    G: tl.constexpr = NUM_QUERIES_PER_KV
    q_tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if ONE_TILE_PER_SEQ:
        seq = q_tile_id
    else:
        seq = _find_seq(query_start_loc_ptr, q_tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if ONE_TILE_PER_SEQ:
        q_block = 0
    else:
        q_block = q_tile_id - (q_start // BLOCK_Q + seq)
    if (q_block * BLOCK_Q >= q_len) | (q_len < min_q_len) | (q_len > max_q_len):
        return  # spare tile of the grid's upper bound, an empty sequence, or one for the other launch
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens cached before this step

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q_idx = q_block * BLOCK_Q + offs_m // G  # [BLOCK_M] query row within the sequence
    head = kv_head * G + offs_m % G  # [BLOCK_M] query head
    row_valid = (offs_m < BLOCK_Q * G) & (q_idx < q_len)
    io_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_pos = ctx_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # Key range of the tile's rows (positions p_first .. p_last) and the part all rows see in full.
    p_first = ctx_len + q_block * BLOCK_Q
    p_last = ctx_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_hi = p_last + 1
    full_hi = p_first + 1  # keys <= p_first: causal for every row
    if USE_WINDOW:
        kv_lo = tl.maximum(p_first - sliding_window + 1, 0)
        full_lo = tl.maximum(p_last - sliding_window + 1, 0)  # keys inside every row's window
    else:
        kv_lo = 0
        full_lo = 0
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.cdiv(kv_hi, TILE_N)
    if SPLIT:  # this program's share of the sequence's tiles
        per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
        tile_lo = tl.minimum(tile_lo + split * per_split, tile_hi)
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)
    # [tile_lo, free_lo) masked | [free_lo, free_hi) no mask | [free_hi, tile_hi) masked
    free_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, TILE_N), tile_lo), tile_hi)
    free_hi = tl.minimum(tl.maximum(full_hi // TILE_N, free_lo), tile_hi)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_head_ptr = key_cache_ptr + kv_head * stride_ch
    v_head_ptr = value_cache_ptr + kv_head * stride_ch
    bt_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, bt_ptr, tile_lo, free_lo, seq_len, scale, softcap,
        sliding_window, stride_cb, stride_cs, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, True, USE_WINDOW, USE_SOFTCAP,
        DOT_PRECISION, UPCAST_DOT, PREFETCH_BLOCK_IDS, FMA_SCORES)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, bt_ptr, free_lo, free_hi, seq_len, scale, softcap,
        sliding_window, stride_cb, stride_cs, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, False, USE_WINDOW, USE_SOFTCAP,
        DOT_PRECISION, UPCAST_DOT, PREFETCH_BLOCK_IDS, FMA_SCORES)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, bt_ptr, free_hi, tile_hi, seq_len, scale, softcap,
        sliding_window, stride_cb, stride_cs, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, True, USE_WINDOW, USE_SOFTCAP,
        DOT_PRECISION, UPCAST_DOT, PREFETCH_BLOCK_IDS, FMA_SCORES)

    if SPLIT:
        # [BLOCK_M] index of (token, head) in the partial buffers
        part_row = (token * (G * tl.num_programs(1)) + head) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * D_PAD + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_valid)
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only masked rows have no visible key
        out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_tokens, num_heads, num_splits, D_PAD] fp32
    part_ml_ptr,  # [num_tokens, num_heads, num_splits, 2] fp32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,  # SPLITS_PAD >= num_splits
):
    """Log-sum-exp merge of the splits of one (sequence, head)'s query rows; grid ``(num_seqs, num_heads)``.

    ``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`` with ``M = max_s m_s``; a split that saw
    no key has ``m_s = -inf, l_s = 0, acc_s = 0`` and weight 0. Rows outside every sequence (padding of
    a fixed-capacity buffer) are not touched.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    for r in range(q_len):
        token = (q_start + r).to(tl.int64)
        base = (token * tl.num_programs(1) + head) * num_splits
        m = tl.load(part_ml_ptr + (base + offs_s) * 2, mask=s_mask, other=float("-inf"))
        l = tl.load(part_ml_ptr + (base + offs_s) * 2 + 1, mask=s_mask, other=0.0)
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.math.exp2(m - m_max)  # [SPLITS_PAD]
        denom = tl.sum(w * l, 0)
        denom = tl.where(denom == 0.0, 1.0, denom)
        acc = tl.load(part_out_ptr + (base + offs_s)[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None],
                      other=0.0)
        out = tl.sum(acc * w[:, None], 0) / denom
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
                 mask=offs_d < HEAD_DIM)
