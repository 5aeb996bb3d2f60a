"""The PyTorch attention backend: a whole ragged batch per call, in batched tensor ops (CPU's path).

``paged_attention_ref`` loops over sequences in Python (a dozen ops per sequence per layer); this backend
attends every sequence of a step at once, with the same contract and results. Sequences are grouped by
query length into bands (``q_len`` 1, 2, 3-4, 5-8, ...: padding at most doubles a band's query rows), and
each band is one padded problem::

    rows   [n, Q]        query rows of the band's n sequences, padded to Q = the band's longest q_len
                         (a padding row repeats its sequence's last row; its result is dropped)
    slots  [n, L]        cache slot of context position j, L = the band's longest seq_len:
                         block_tables[s, j' // block_size] * block_size + j' % block_size,
                         j' = min(j, seq_lens[s] - 1)  (past the context: a copy of a real key, masked out)
    mask   [n, 1, Q, L]  0 where key j <= the row's position (and within sliding_window of it), else -inf

When every sequence has the same number of rows (a decode step, one prompt, equal prompts) there is one band
and the rows are the query itself, no gathering. The index tensors and masks depend only on the step's
metadata, so ``plan_attention`` builds them once per step (``ModelRunner`` does, through ``.plan``) and
every layer reuses them; a layer only gathers its K/V and attends.

Scores are those of the reference: ``scale * q.k``, ``softcap * tanh(score / softcap)`` when a softcap is
given (Gemma-2), masked softmax over keys, float32 softmax. Without a softcap each band is one
``scaled_dot_product_attention`` call (GQA through ``enable_gqa``); with one, explicit matmuls in float32.
Clamping key positions into the context means no slot past a sequence's context is read: never-written
slots may hold NaN (``KVPool`` allocates with ``torch.empty``) and block-table entries past a
sequence's blocks may be any value.

``reshape_and_cache_torch`` writes a step's K/V with one ``index_copy_`` per cache when no slot is -1.
Both read metadata on the host (``int(...)``, ``.tolist()``), so a CUDA graph cannot capture them: the backend
says ``graph_capturable=False`` (``attention.resolve_backend``), and ``ModelRunner`` keeps graphs off.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


@dataclass(slots=True)
class Band:
    """The sequences of one query-length band, as index tensors (see the module docstring)."""

    slots: torch.Tensor  # [n * L] int64: cache slot of each context position, clamped into the context (flattened)
    positions: torch.Tensor  # [L] int64: 0 .. L-1
    q_pos: torch.Tensor  # [n, Q] int64: position of each query row (a padding row: its sequence's last)
    rows: torch.Tensor | None  # [n * Q] int64 query rows (flattened); None: the band is the whole step, rows in order
    out_rows: torch.Tensor | None  # [num_real] int64: output row of each real row (None with rows None)
    real: torch.Tensor | None  # [num_real] int64: index of each real row in the flattened [n * Q] rows
    masks: dict = field(default_factory=dict)  # sliding_window (None: full) -> [n, 1, Q, L] float32

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """Additive mask ``[n, 1, Q, L]`` float32: 0 where a row sees a key, -inf elsewhere (made once per window)."""
        mask = self.masks.get(sliding_window)
        if mask is None:
            diff = self.q_pos[:, :, None] - self.positions  # [n, Q, L]: query position - key position
            allowed = diff >= 0
            if sliding_window is not None:
                allowed &= diff < sliding_window
            mask = self.masks[sliding_window] = torch.where(allowed, 0.0, NEG_INF)[:, None]
        return mask


@dataclass(slots=True)
class TorchAttentionPlan:
    """One step's metadata as index tensors, built by ``plan_attention`` and shared by every layer."""

    num_tokens: int  # query rows of the step
    block_size: int  # tokens per KV block (the cache's)
    bands: list[Band]


def plan_attention(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    num_tokens: int,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> TorchAttentionPlan:
    """Index tensors and bands of one step (arguments as ``paged_attention_torch``'s; ``num_tokens`` query
    rows, ``block_size`` tokens per block). Reads ``seq_lens`` / ``query_start_loc`` on the host."""
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return TorchAttentionPlan(num_tokens, block_size, [])
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if max_query_len * num_seqs == num_tokens:  # every sequence max_query_len rows: no gathering
        q_lens = torch.full_like(seq_lens, max_query_len)
        band = _band(block_tables, seq_lens, q_lens, max_query_len, max_seq_len, block_size)
        return TorchAttentionPlan(num_tokens, block_size, [band])
    starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [num_seqs] int32
    # band of a sequence: ceil(log2(q_len)); -1: no rows this step (skipped)
    band_ids = torch.where(q_lens > 0, torch.log2(q_lens.float()).ceil().int(), -1)
    bands = []
    for band_id in torch.unique(band_ids).tolist():
        if band_id < 0:
            continue
        seqs = (band_ids == band_id).nonzero().squeeze(1)
        band_q_lens, band_seq_lens = q_lens[seqs], seq_lens[seqs]
        width = min(1 << band_id, max_query_len)
        band = _band(block_tables[seqs], band_seq_lens, band_q_lens, width, int(band_seq_lens.max()), block_size)
        offsets = torch.arange(width, device=seq_lens.device)
        band.rows = (starts[seqs, None] + torch.minimum(offsets, band_q_lens[:, None] - 1)).flatten()
        real = (offsets < band_q_lens[:, None]).flatten()
        band.out_rows, band.real = band.rows[real], real.nonzero().squeeze(1)
        bands.append(band)
    return TorchAttentionPlan(num_tokens, block_size, bands)


def _band(block_tables, seq_lens, q_lens, width: int, max_seq_len: int, block_size: int) -> Band:
    """The slots and row positions of ``n`` sequences with at most ``width`` rows each (``seq_lens >= 1``)."""
    device = seq_lens.device
    positions = torch.arange(max_seq_len, device=device)
    last = (seq_lens - 1).long()[:, None]  # [n, 1]
    clamped = torch.minimum(positions, last)  # [n, L]
    slots = block_tables.gather(1, clamped // block_size).long() * block_size + clamped % block_size
    # NOTE: index_select of flat rows; indexing with the 2-D slots tensor was 7x slower on CPU (8 x 33 slots)
    offsets = torch.minimum(torch.arange(width, device=device), (q_lens - 1).long()[:, None])  # [n, Q]
    q_pos = last - (q_lens - 1).long()[:, None] + offsets
    return Band(slots.flatten(), positions, q_pos, None, None, None)


def paged_attention_torch(
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
    plan: TorchAttentionPlan | None = None,
) -> torch.Tensor:
    """Paged attention for a ragged batch of prefill chunks and decode tokens, batched over sequences.

    Same contract as ``paged_attention_ref`` (see it for the arguments' shapes, dtypes and units). Sequences
    with ``q_len == 0`` are skipped and rows past ``query_start_loc[num_seqs]`` are left unwritten.

    Args:
        max_query_len, max_seq_len: host upper bounds (tokens) of any sequence's query rows and context;
            computed from the tensors when None. ``max_seq_len`` sizes the key dimension of a step whose
            sequences all have ``max_query_len`` rows, so a loose bound costs work, never correctness.
        plan: this step's ``plan_attention`` of these metadata tensors (built here when None).

    Returns:
        ``out`` (or a new tensor) ``[num_tokens, num_heads, head_dim]`` in the query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, key_cache.shape[1], num_tokens,
                              max_query_len, max_seq_len)
    assert plan.num_tokens == num_tokens and plan.block_size == key_cache.shape[1], (plan.num_tokens, num_tokens)
    if out is None and not (len(plan.bands) == 1 and plan.bands[0].rows is None):
        out = torch.empty_like(query)
    for band in plan.bands:
        n, width = band.q_pos.shape
        q = query if band.rows is None else query.index_select(0, band.rows)
        q = q.view(n, width, num_heads, head_dim)
        res = _attend(q, band, key_cache, value_cache, scale, sliding_window, softcap)  # [n, Q, H, D]
        if band.rows is None:  # NOTE: reshape: the softcap path's result is a strided view, not contiguous
            if out is None:
                return res.reshape(num_tokens, num_heads, head_dim)
            out.copy_(res.reshape(num_tokens, num_heads, head_dim))
        else:
            out.index_copy_(0, band.out_rows, res.reshape(n * width, num_heads, head_dim).index_select(0, band.real))
    return out


paged_attention_torch.plan = plan_attention


def _attend(q, band: Band, key_cache, value_cache, scale: float, sliding_window, softcap) -> torch.Tensor:
    """One band: ``q [n, Q, H, D]`` against its sequences' contexts. Returns ``[n, Q, H, D]`` in the query's dtype
    (a new tensor; padding rows hold their sequence's last row's result)."""
    n, width, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    kv_shape = (n, band.positions.shape[0], num_kv_heads, head_dim)  # [n, L, Hkv, D]
    k = key_cache.view(-1, num_kv_heads * head_dim).index_select(0, band.slots).view(kv_shape)
    v = value_cache.view(-1, num_kv_heads * head_dim).index_select(0, band.slots).view(kv_shape)
    mask = band.mask(sliding_window)  # [n, 1, Q, L]
    if not softcap:
        # [n, Q, H, D] -> [n, H, Q, D] (views); the query heads of a KV head are adjacent (transformers' GQA order)
        res = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask.to(q.dtype), scale=scale, enable_gqa=num_heads != num_kv_heads)
        return res.transpose(1, 2).reshape(n, width, num_heads, head_dim)
    groups = num_heads // num_kv_heads
    # [n, Q, Hkv * G, D] -> [n, Hkv, G * Q, D]: a KV head's query heads stacked along the rows
    qf = q.float().view(n, width, num_kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4).reshape(
        n, num_kv_heads, groups * width, head_dim)
    scores = torch.matmul(qf, k.float().permute(0, 2, 3, 1)) * scale  # [n, Hkv, G * Q, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(n, num_kv_heads, groups, width, -1) + mask[:, :, None]
    probs = torch.softmax(scores, dim=-1).view(n, num_kv_heads, groups * width, -1)
    res = torch.matmul(probs, v.float().transpose(1, 2))  # [n, Hkv, G * Q, D]
    # -> [n, Q, Hkv, G, D] -> [n, Q, H, D]
    return res.view(n, num_kv_heads, groups, width, head_dim).permute(0, 3, 1, 2, 4).reshape(
        n, width, num_heads, head_dim).to(q.dtype)


def reshape_and_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into their cache slots, in place; the contract of
    ``reshape_and_cache_ref`` (slot -1 skips a row), with one ``index_copy_`` per cache when no slot is -1."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    key_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
