"""The batched torch backend (``paged_attention_torch``, ``reshape_and_cache_torch``) against the per-sequence
PyTorch references ``paged_attention_ref`` / ``reshape_and_cache_ref``.

Random ragged batches mix decode rows with prefill chunks (with and without cached context), over MHA, GQA
(groups 2, 3, 4) and MQA, sliding windows, softcaps, block sizes 16 and 8, fp32 and bf16. Every slot outside
the sequences' contexts is NaN and block-table entries past a sequence's blocks are out of range, so a read
of either shows up; outputs start as NaN so an unwritten row shows up.
"""

import random

import pytest
import torch

from paged_transformers.core.attention import resolve_backend
from paged_transformers.config import AttentionBackend
from paged_transformers.kernels.api import paged_attention_ref, reshape_and_cache_ref
from paged_transformers.kernels.torch_attention import paged_attention_torch, reshape_and_cache_torch

# ||out - ref|| / ||ref||: both compute in float32 from the same inputs; bf16 adds the output's rounding
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
BAD_BLOCK = 1 << 30  # block-table filler past a sequence's blocks


def ragged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """``(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)`` with each sequence's blocks
    at random pool positions, NaN in every slot outside a context, ``BAD_BLOCK`` past each sequence's blocks;
    and the block tables with 0 there (``paged_attention_ref`` indexes the whole row it is given)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    pool = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), BAD_BLOCK, dtype=torch.int32)
    for s, (n, seq_len) in enumerate(zip(blocks_per_seq, seq_lens)):
        blocks, pool = pool[:n], pool[n:]
        block_tables[s, :n] = torch.tensor(blocks, dtype=torch.int32)
        positions = torch.arange(seq_len)
        slots = torch.tensor(blocks)[positions // block_size] * block_size + positions % block_size
        for cache in (key_cache, value_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    ref_tables = torch.where(block_tables == BAD_BLOCK, 0, block_tables)
    return (query, key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), query_start_loc), ref_tables


def random_lengths(rng: random.Random, num_seqs: int, window: int | None):
    """Per sequence a decode row, a prompt, or a chunk after cached context (longer than a window, if any)."""
    q_lens, seq_lens = [], []
    for _ in range(num_seqs):
        kind = rng.choice(["decode", "prompt", "chunk"])
        q_len = 1 if kind == "decode" else rng.randint(2, 40)
        cached = 0 if kind == "prompt" else rng.randint(1 if kind == "decode" else 0, (window or 30) * 2)
        q_lens.append(q_len)
        seq_lens.append(cached + q_len)
    return q_lens, seq_lens


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check(args, ref_tables, dtype, bounds=True, **options):
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = args
    scale = query.shape[-1] ** -0.5
    ref = paged_attention_ref(query, key_cache, value_cache, ref_tables, seq_lens, query_start_loc, scale, **options)
    out = torch.full_like(query, float("nan"))
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    kwargs = dict(max_query_len=max(q_lens), max_seq_len=int(seq_lens.max())) if bounds else {}
    got = paged_attention_torch(*args, scale, out=out, **options, **kwargs)
    assert got is out and not out.isnan().any(), f"NaN or unwritten rows {out.isnan().any(-1).any(-1).nonzero().flatten()}"
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"relative error {err:.2e}"


# (num_heads, num_kv_heads, head_dim): MHA, GQA 2 / 3 / 4, MQA
HEADS = [(2, 2, 32), (4, 2, 64), (6, 2, 16), (8, 2, 80), (4, 1, 64)]
OPTIONS = [dict(), dict(sliding_window=7), dict(softcap=5.0), dict(sliding_window=20, softcap=30.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "window", "softcap", "window+softcap"])
def test_random_ragged_batches_match_the_reference(dtype, block_size, options):
    rng = random.Random(f"{dtype}-{block_size}-{options}")
    for trial in range(6):
        num_heads, num_kv_heads, head_dim = HEADS[trial % len(HEADS)]
        q_lens, seq_lens = random_lengths(rng, rng.randint(1, 7), options.get("sliding_window"))
        args, ref_tables = ragged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                        seed=rng.randrange(1 << 31))
        try:
            check(args, ref_tables, dtype, bounds=trial % 2 == 0, **options)
        except AssertionError as e:
            raise AssertionError(f"q_lens {q_lens}, seq_lens {seq_lens}, heads {num_heads}/{num_kv_heads}: {e}") from e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_step_matches_the_reference(dtype):
    """Every sequence one row (the decode path: no row gathering), contexts of 1 token, exact blocks and
    ragged; and with a loose ``max_seq_len`` bound, as a caller may give."""
    seq_lens = [1, 16, 37, 64, 5, 129]
    args, ref_tables = ragged_batch([1] * len(seq_lens), seq_lens, 6, 2, 64, 16, dtype, seed=3)
    check(args, ref_tables, dtype, sliding_window=30, softcap=10.0)
    query, *_ = args
    loose = paged_attention_torch(*args, 0.125, max_query_len=1, max_seq_len=300)
    ref = paged_attention_ref(*args[:3], ref_tables, *args[4:], 0.125)
    assert rel_err(loose, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "window", "softcap", "window+softcap"])
def test_sequences_of_equal_rows_match_the_reference(options):
    """Every sequence with the same number of rows > 1 (one band, no row gathering: prefill steps of equal
    prompts), into a given ``out`` and into a new tensor."""
    q_lens, seq_lens = [4, 4, 4], [4, 11, 23]
    args, ref_tables = ragged_batch(q_lens, seq_lens, 6, 2, 32, 8, torch.float32, seed=5)
    check(args, ref_tables, torch.float32, **options)
    ref = paged_attention_ref(*args[:3], ref_tables, *args[4:], 0.125, **options)
    assert rel_err(paged_attention_torch(*args, 0.125, **options), ref) < REL_TOL[torch.float32]


def test_sequences_without_rows_and_rows_past_the_batch_are_left_alone():
    """Fixed-capacity buffers: sequences with ``q_len`` 0 (``seq_len`` 0, zero block tables) are skipped and rows
    past ``query_start_loc[num_seqs]`` stay unwritten."""
    args, ref_tables = ragged_batch([3, 1, 6], [10, 20, 6], 4, 2, 32, 8, torch.float32, seed=5)
    query, key_cache, value_cache, block_tables, seq_lens, qsl = args
    pad = 2
    block_tables_p = torch.cat([block_tables, torch.full((pad, block_tables.shape[1]), BAD_BLOCK, dtype=torch.int32)])
    seq_lens_p = torch.cat([seq_lens, torch.zeros(pad, dtype=torch.int32)])
    qsl_p = torch.cat([qsl, qsl[-1:].repeat(pad)])
    query_p = torch.cat([query, torch.randn(4, *query.shape[1:])])
    out = torch.full_like(query_p, float("nan"))
    paged_attention_torch(query_p, key_cache, value_cache, block_tables_p, seq_lens_p, qsl_p, 0.125, out=out)
    ref = paged_attention_ref(query, key_cache, value_cache, ref_tables, seq_lens, qsl, 0.125)
    assert rel_err(out[: len(query)], ref) < REL_TOL[torch.float32]
    assert out[len(query) :].isnan().all(), "padding rows were written"


@pytest.mark.parametrize("skip", [False, True], ids=["all-slots", "with-skipped"])
def test_reshape_and_cache_matches_the_reference(skip):
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(2, 7, 2, 16, generator=g)
    slot_mapping = torch.randperm(5 * 8, generator=g)[:7]
    if skip:
        slot_mapping[[1, 4]] = -1
    caches = [torch.randn(5, 8, 2, 16, generator=g) for _ in range(2)]
    ours, ref = [c.clone() for c in caches], [c.clone() for c in caches]
    reshape_and_cache_torch(key, value, *ours, slot_mapping)
    reshape_and_cache_ref(key, value, *ref, slot_mapping)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert not any(torch.equal(a, c) for a, c in zip(ours, caches))  # not vacuous: something was written


def test_backends_declare_whether_they_read_the_host():
    """The torch path is the product's CPU backend (and ``"torch"`` everywhere), and says a CUDA graph cannot capture
    it (it reads metadata on the host), which keeps CUDA graphs off (``ModelRunner``)."""
    for backend in (AttentionBackend.TORCH, AttentionBackend.AUTO):
        ops = resolve_backend(backend, torch.device("cpu"))
        assert (ops.write_kv, ops.attend) == (reshape_and_cache_torch, paged_attention_torch)
        assert ops.graph_capturable is False
