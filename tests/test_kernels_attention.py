"""``paged_attention`` (Triton) equals ``paged_attention_ref`` (PyTorch) on a grid of small shapes.

On a machine without CUDA the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` is set here,
before the kernel modules are first imported (they are imported on the first launch). Every case
draws fresh random inputs (the seed is in the failure message), scatters each sequence's blocks
randomly over the pool, fills unused block-table entries with out-of-range ids, and poisons the output
with NaN so an unwritten element fails. Cases cover head_dim 64/80/96/128/256, MHA/GQA (G = 2, 3, 4)/MQA,
block_size 16/32/64/128, ragged query and context lengths (1, exact block multiples, chunks with
cached context), sliding window, soft-capping, fp32/fp16/bf16, the one-kernel path and split-KV decode.
"""

import importlib
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from paged_transformers.kernels.api import paged_attention, paged_attention_ref  # noqa: E402
from paged_transformers.kernels.paged_attention import (  # noqa: E402
    KernelConfig, pick_config, pick_num_kv_splits, plan_launches)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# ||out - ref|| / ||ref|| against the fp32 reference on the same (rounded) inputs
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
BAD_BLOCK = 1 << 30  # block-table filler past a sequence's blocks: reading it would fault or give garbage


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, spare_blocks=3):
    """Random ragged batch: query ``[T, H, D]``, caches with each sequence's blocks at random pool
    positions, and the metadata tensors. Returns ``(args, block_tables_for_ref)``."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    pool = torch.randperm(num_blocks, generator=g).to(torch.int32)
    width = max(blocks_per_seq + [1]) + 1
    block_tables = torch.full((len(seq_lens), width), BAD_BLOCK, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = pool[used : used + n]
        used += n
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    args = [t.to(DEVICE) for t in (query, key_cache, value_cache, block_tables,
                                     torch.tensor(seq_lens, dtype=torch.int32), query_start_loc)]
    ref_tables = args[3].clone()
    ref_tables[ref_tables == BAD_BLOCK] = 0
    return args, ref_tables


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# (q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, sliding_window, softcap, num_kv_splits)
CASES = [
    # decode, GQA 2, lengths 1 / one block / exact multiple / ragged / around the 64-key tile edge
    ([1, 1, 1, 1, 1, 1], [1, 16, 64, 37, 63, 129], 4, 2, 64, 16, torch.float32, None, None, None),
    # window edges on tile edges: first visible key 63, first fully visible key 64 and 65 (tile_n 64)
    ([1, 1, 1, 1], [99, 100, 101, 64], 4, 2, 64, 16, torch.float32, 36, None, None),
    # prefill whose 64-row query tiles start at positions 63 and 127 (tile edges - 1)
    ([70, 1], [133, 1], 4, 2, 64, 32, torch.float32, None, None, None),
    # mixed prefill chunks (with cached context) and decode, MQA, head_dim 80 (padded to 128); q_len 4 / 5:
    # last of the decode launch's sequences (16-row tiles / 4 heads) / first of the prefill launch's
    ([7, 1, 33, 1, 4, 5], [7, 50, 97, 1, 4, 60], 4, 1, 80, 16, torch.float32, None, None, None),
    # GQA 3 (non-power-of-two group), head_dim 96, block 32, window + softcap
    ([5, 1, 40], [5, 30, 100], 6, 2, 96, 32, torch.float32, 7, 5.0, None),
    # MHA, head_dim 128, block 64: a prompt longer than one 128-row query tile
    ([130, 3, 64], [200, 3, 64], 2, 2, 128, 64, torch.float32, None, None, None),
    # head_dim 256 (64-row tiles), block 128, window shorter than a tile
    ([20, 1], [150, 256], 4, 2, 256, 128, torch.float32, 16, None, None),
    # split-KV decode: splits with keys, empty splits (sequence shorter than the split count's tiles)
    ([1, 1, 1], [300, 129, 5], 8, 2, 64, 16, torch.float32, None, None, 3),
    ([1, 1], [700, 64], 4, 1, 128, 32, torch.float32, 50, 30.0, 8),
    # 40 splits of one 64-key tile each
    ([1, 1], [2560, 40], 8, 2, 64, 16, torch.float32, None, None, 40),
    # split-KV over a prefill chunk (general q_len), GQA 4
    ([12, 1], [140, 90], 8, 2, 64, 16, torch.float32, None, None, 2),
    # half precision
    ([9, 1, 1], [40, 16, 120], 4, 2, 64, 16, torch.float16, None, None, None),
    ([1, 1], [333, 32], 8, 2, 128, 16, torch.float16, None, None, 4),
    ([9, 1, 1], [40, 16, 120], 4, 2, 128, 32, torch.bfloat16, 20, None, None),
    ([1, 1, 1], [33, 300, 64], 4, 1, 64, 64, torch.bfloat16, None, 20.0, 3),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_matches_reference(case):
    q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, window, softcap, splits = case
    seed = random.randrange(1 << 31)
    args, ref_tables = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    query, key_cache, value_cache, _, seq_lens_t, query_start_loc = args
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    got = paged_attention(*args, scale, sliding_window=window, softcap=softcap, max_query_len=max(q_lens),
                          max_seq_len=max(seq_lens), out=out, num_kv_splits=splits)
    assert got is out
    ref = paged_attention_ref(query, key_cache, value_cache, ref_tables, seq_lens_t, query_start_loc, scale,
                              sliding_window=window, softcap=softcap)
    assert not out.isnan().any(), f"seed {seed}: unwritten or NaN output rows {out.isnan().any(-1).any(-1).nonzero()}"
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"seed {seed}: relative error {err:.2e}"


# Kernel options the GPU sweep chooses between (bench_kernels.py --prefill-sweep): block ids prefetched
# one KV tile ahead, softmax scale inside the exponent. (block_size, tile_n) covers a tile spanning two
# blocks, one block, and part of one; the prefetch of the tile past the last one must not read
# block-table entries past the sequence's blocks (BAD_BLOCK there).
TILE_OPTIONS = [
    (KernelConfig(64, 32, 4, 2, prefetch_block_ids=True), 16, torch.float32, None, None),
    (KernelConfig(32, 16, 4, 3, prefetch_block_ids=True, fma_scores=True), 32, torch.bfloat16, None, None),
    (KernelConfig(64, 16, 4, 2, fma_scores=True), 16, torch.float16, None, None),
    (KernelConfig(32, 16, 4, 2, prefetch_block_ids=True, fma_scores=True), 16, torch.float32, 24, 10.0),
]


@pytest.mark.parametrize("cfg, block_size, dtype, window, softcap", TILE_OPTIONS,
                         ids=[f"opt{i}" for i in range(len(TILE_OPTIONS))])
def test_prefill_tile_options(cfg, block_size, dtype, window, softcap):
    seed = random.randrange(1 << 31)
    q_lens, seq_lens = [70, 1, 20], [70, 33, 90]
    args, ref_tables = make_batch(q_lens, seq_lens, 4, 2, 64, block_size, dtype, seed)
    query, key_cache, value_cache, block_tables, seq_lens_t, qsl = args
    pa = importlib.import_module("paged_transformers.kernels.paged_attention")
    out = torch.full_like(query, float("nan"))
    pa.launch_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, out, 0.125, window, softcap, 1,
                        [pa.QueryBand(cfg, 1, pa.INT32_MAX)])
    ref = paged_attention_ref(query, key_cache, value_cache, ref_tables, seq_lens_t, qsl, 0.125,
                              sliding_window=window, softcap=softcap)
    assert not out.isnan().any(), f"seed {seed}: NaN or unwritten rows"
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"seed {seed}: relative error {err:.2e}"


def test_default_bounds_and_auto_split():
    """Without the host bounds the wrapper computes them; a long single decode gets split by default."""
    seed = random.randrange(1 << 31)
    assert pick_num_kv_splits(1, 1, 600, torch.device("cpu")) == 4  # 4 programs/SM x 4 "SMs", >= 192 keys each
    args, ref_tables = make_batch([1], [600], 2, 1, 64, 16, torch.float32, seed)
    out = paged_attention(*args, 0.125)
    ref = paged_attention_ref(*args[:3], ref_tables, *args[4:], 0.125)
    assert rel_err(out, ref) < REL_TOL[torch.float32], f"seed {seed}"


def test_fixed_capacity_buffers():
    """Padding sequences (q_len 0, seq_len 0) are skipped and rows past query_start_loc[-1] stay untouched,
    as a CUDA-graph step with buffers sized for max_num_seqs / max_num_batched_tokens needs."""
    seed = random.randrange(1 << 31)
    args, ref_tables = make_batch([1, 1, 1], [20, 70, 5], 4, 2, 64, 16, torch.float32, seed)
    query, key_cache, value_cache, block_tables, seq_lens, qsl = args
    pad = 2  # padding sequences
    block_tables_p = torch.cat([block_tables, torch.zeros(pad, block_tables.shape[1], dtype=torch.int32, device=DEVICE)])
    seq_lens_p = torch.cat([seq_lens, torch.zeros(pad, dtype=torch.int32, device=DEVICE)])
    qsl_p = torch.cat([qsl, qsl[-1:].repeat(pad)])
    query_p = torch.cat([query, torch.randn(4, *query.shape[1:], device=DEVICE)])  # 4 padding rows
    for splits in (1, 3):
        out = torch.full_like(query_p, float("nan"))
        paged_attention(query_p, key_cache, value_cache, block_tables_p, seq_lens_p, qsl_p, 0.125,
                        max_query_len=1, max_seq_len=128, out=out, num_kv_splits=splits)
        ref = paged_attention_ref(query, key_cache, value_cache, ref_tables, seq_lens, qsl, 0.125)
        assert rel_err(out[:3], ref) < REL_TOL[torch.float32], f"seed {seed}, splits {splits}"
        assert out[3:].isnan().all(), "padding rows were written"


def test_no_host_sync_with_bounds(monkeypatch):
    """With max_query_len / max_seq_len given, the wrapper reads no tensor back to the host."""
    args, _ = make_batch([1, 1], [40, 9], 4, 2, 64, 16, torch.float32, seed=0)

    def forbidden(*a, **k):
        raise AssertionError("host sync inside paged_attention")

    # the module (the package attribute of the same name is the function)
    pa = importlib.import_module("paged_transformers.kernels.paged_attention")

    launched = []
    monkeypatch.setattr(pa, "launch_attention", lambda *a, **k: launched.append(a))
    for name in ("item", "tolist", "__int__", "__bool__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    pa.paged_attention(*args, 0.125, max_query_len=1, max_seq_len=40)
    assert launched


def test_plan_launches():
    (decode,) = plan_launches(1, 4, 128, torch.bfloat16)
    assert (decode.cfg.block_m, decode.min_q_len, decode.max_q_len) == (16, 1, 4)
    decode, prefill = plan_launches(2048, 4, 128, torch.bfloat16)  # mixed batch: decode rows keep 16-row tiles
    assert decode.max_q_len == 4 and prefill.min_q_len == 5 and prefill.cfg.block_m == 128
    # a short longest chunk gets the same prefill tile: no kernel variant per batch shape
    assert plan_launches(8, 4, 128, torch.bfloat16)[1] == prefill


def test_pick_config():
    assert pick_config(1, 4, 128, torch.bfloat16).block_m == 16  # decode: 1 row x 4 heads -> 16
    assert pick_config(2048, 4, 128, torch.bfloat16).block_m == 128
    assert pick_config(2048, 4, 256, torch.bfloat16).block_m == 64
    assert pick_config(1, 32, 128, torch.bfloat16).block_m == 32  # MQA with 32 heads: one query row


def _valid_args():
    args, _ = make_batch([2, 1], [10, 20], 4, 2, 64, 16, torch.float32, seed=0)
    return args


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.__setitem__(0, a[0].half()), "dtype"),
        (lambda a: a.__setitem__(0, a[0][..., :32]), "head_dim"),
        (lambda a: a.__setitem__(0, a[0][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.__setitem__(0, a[0].transpose(1, 2).contiguous().transpose(1, 2)), "stride 1 on head_dim"),
        (lambda a: a.__setitem__(1, a[1].transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
        (lambda a: a.__setitem__(3, a[3].long()), "block_tables must be int32"),
        (lambda a: a.__setitem__(4, a[4][:1]), "seq_lens"),
        (lambda a: a.__setitem__(5, a[5].long()), "query_start_loc"),
        (lambda a: a.__setitem__(4, torch.empty(2, dtype=torch.int32, device="meta")), "is on meta"),
    ],
)
def test_rejects_bad_inputs(mutate, match):
    args = _valid_args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        paged_attention(*args, 0.125, max_query_len=2, max_seq_len=20)


def test_rejects_bad_options():
    args = _valid_args()
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(*args, 0.125, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(*args, 0.125, softcap=-1.0)
    for bad in (True, 0, 129, 2.0):
        with pytest.raises(ValueError, match="num_kv_splits must be an int in"):
            paged_attention(*args, 0.125, num_kv_splits=bad)
    with pytest.raises(ValueError, match="out must be"):
        paged_attention(*args, 0.125, out=torch.empty(3, 4, 32, device=DEVICE))
    with pytest.raises(ValueError, match="head_dim must be"):
        big = [torch.randn(3, 1, 512, device=DEVICE), torch.randn(4, 16, 1, 512, device=DEVICE),
               torch.randn(4, 16, 1, 512, device=DEVICE)] + args[3:]
        paged_attention(*big, 0.125)
