"""The W4A16 tuning tables (``kernels/w4a16/tables.py``): the shipped files are well formed and say where they were
measured, ``default_config`` reads a table as its format says (preference order, the two split-K rules, one-wave
candidates, the fallback past the table and on devices without one), and bad files are refused naming the entry.
Which config a table picks is data; that every config it can pick computes the right product is test_w4a16.py's and
test_w4a16_wgmma.py's."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from paged_transformers.kernels.w4a16 import W4A16Algo as A
from paged_transformers.kernels.w4a16 import default_config, dispatch, split_k_for, tables
from paged_transformers.kernels.w4a16.tables import Bucket, Candidate, Table

CONFIGS = sorted((Path(dispatch.__file__).parent / "configs").glob("*.json"))
CPU = torch.device("cpu")


def test_tables_are_shipped_for_the_tuned_devices():
    assert {p.name for p in CONFIGS} >= {"NVIDIA_H100_80GB_HBM3.json", "NVIDIA_H200.json"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_shipped_table_is_well_formed(path):
    data = json.loads(path.read_text())
    table = Table.from_json(data)
    assert tables.file_name(table.device_name) == path.name
    assert tables.table_named(table.device_name) == table
    for field in ("num_sms", "compute_capability", "measured_on", "versions", "generated_by"):
        assert data[field], field  # where and with what it was measured, in one place
    for shape in tables.SHAPES:  # every decode row count of every shape, once
        rows = sorted(m for b in table.buckets if b.shape == shape for m in range(b.min_m, b.max_m + 1))
        assert rows == list(range(1, 257)), shape
    for b in table.buckets:
        # the last candidate runs any layer, so the table alone always has an answer
        assert b.candidates[-1].algo in ("dequant_matmul", "dot"), b
        for c in b.candidates:
            if c.split_k_rule == "programs_per_sm":
                # split_k_for counts one row of output tiles: the bucket's rows fit one tile
                assert b.max_m <= c.block_m, (b.shape, b.min_m, c)
            else:
                assert c.split_k & (c.split_k - 1) == 0, c  # a power of two (lowered to divide the K steps)


def test_the_fallback_ends_in_a_kernel_that_runs_any_layer():
    for M in range(1, 600):
        cands = tables.fallback_candidates(M)
        assert cands[-1].algo in ("dequant_matmul", "dot")
        assert all(M <= c.block_m for c in cands if c.split_k_rule == "programs_per_sm"), M


def _cand(algo, bm, bn, bk, warps=4, stages=3, **split) -> Candidate:
    split = split or {"split_k_rule": "fixed"}
    return Candidate(algo, bm, bn, bk, warps, stages, **split)


def _table(*buckets) -> Table:
    return Table("test device", tuple(Bucket(*b) for b in buckets))


def test_candidates_are_tried_in_order_and_past_the_table_the_fallback_answers():
    # on the CPU neither WGMMA nor TC runs: the third candidate; M past the table: the fallback's DOT at 5 rows
    table = _table(("square", 1, 8, (_cand("wgmma", 16, 64, 64, stages=4), _cand("tc", 16, 64, 128),
                                     _cand("dot", 16, 32, 128), _cand("dot", 16, 64, 128))))
    cfg = default_config(4, 256, 256, 128, CPU, table=table)
    assert (cfg.algo, cfg.block_n) == (A.DOT, 32)
    assert default_config(9, 256, 256, 128, CPU, table=table) == default_config(9, 256, 256, 128, CPU)
    wide = default_config(4, 1024, 256, 128, CPU, table=table)  # another shape: not in the table
    assert wide == default_config(4, 1024, 256, 128, CPU, table=None)


def test_the_two_split_k_rules():
    # fixed: 8 asked, K = 384 of 128-row steps (3 steps): the largest power of two dividing them, 1
    table = _table(("tall", 1, 16, (_cand("dot", 16, 64, 128, split_k_rule="fixed", split_k=8),)))
    assert default_config(4, 64, 384, 128, CPU, table=table).split_k == 1
    # 16 steps: 8 (2 steps a slice)
    assert default_config(4, 64, 2048, 128, CPU, table=table).split_k == 8
    # 8 steps: at most 4 slices of 2 steps
    assert default_config(4, 64, 1024, 128, CPU, table=table).split_k == 4
    # programs_per_sm: split_k_for on the device's SMs (132 stand in off CUDA) over one row of output tiles
    table = _table(("tall", 1, 16, (_cand("dot", 16, 64, 128, split_k_rule="programs_per_sm", programs_per_sm=4),)))
    cfg = default_config(4, 256, 2048, 128, CPU, table=table)
    assert cfg.split_k == split_k_for(num_tiles=4, k_iters=16, num_sms=132, programs_per_sm=4) == 16


def test_a_one_wave_candidate_applies_only_where_its_grid_fits_the_sms(monkeypatch):
    one_wave = Candidate("dot", 16, 64, 128, 4, 3, "fixed", split_k=2, one_wave=True)
    table = _table(("square", 1, 64, (one_wave, _cand("dot_swap", 16, 64, 128))))
    # 2048 columns at 32 rows: 2 x 32 tiles x split 2 = 128 programs <= 132
    assert default_config(32, 2048, 2048, 128, CPU, table=table).algo is A.DOT
    # 64 rows: 256 programs
    assert default_config(64, 2048, 2048, 128, CPU, table=table).algo is A.DOT_SWAP
    monkeypatch.setattr(dispatch, "num_sms", lambda device, stand_in: 264)
    assert default_config(64, 2048, 2048, 128, CPU, table=table).algo is A.DOT


def test_a_device_without_a_table_uses_the_fallback():
    assert tables.table_for(CPU) is None
    assert tables.table_named("A GPU nobody measured") is None
    for M in (1, 5, 40, 300):
        cfg = default_config(M, 4096, 4096, 128, CPU)
        first = next(c for c in tables.fallback_candidates(M) if c.algo != "tc")  # no TC off CUDA
        assert cfg.algo.value == first.algo, (M, cfg)


@pytest.mark.parametrize("bad,match", [
    ({"split_k_rule": "auto"}, "split_k_rule must be one of"),
    ({"split_k_rule": "programs_per_sm"}, "needs programs_per_sm >= 1"),
    ({"split_k_rule": "fixed", "split_k": 0}, "needs split_k >= 1"),
    ({"split_k_rule": "fixed", "programs_per_sm_typo": 4}, "bad W4A16 table candidate"),
    ({"split_k_rule": "fixed", "programs_per_sm": 4}, "takes only its own count"),
    ({"split_k_rule": None, "algo": None}, "bad W4A16 table candidate"),
])
def test_a_bad_candidate_is_refused(bad, match):
    entry = {"algo": "dot", "block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3, **bad}
    entry = {k: v for k, v in entry.items() if v is not None}
    data = {"device_name": "x", "buckets": [{"shape": "square", "min_m": 1, "max_m": 4, "candidates": [entry]}]}
    with pytest.raises(ValueError, match=match):
        Table.from_json(data)


def test_bad_buckets_are_refused():
    good = _cand("dot", 16, 64, 128).to_json()
    for buckets, match in (
            ([{"shape": "round", "min_m": 1, "max_m": 4, "candidates": [good]}], "bad W4A16 table bucket"),
            ([{"shape": "square", "min_m": 5, "max_m": 4, "candidates": [good]}], "bad W4A16 table bucket"),
            ([{"shape": "square", "min_m": 1, "max_m": 4, "candidates": []}], "bad W4A16 table bucket"),
            ([{"shape": "square", "min_m": 1, "max_m": 4, "candidates": [good]},
              {"shape": "square", "min_m": 4, "max_m": 8, "candidates": [good]}], "overlap")):
        with pytest.raises(ValueError, match=match):
            Table.from_json({"device_name": "x", "buckets": buckets})
    with pytest.raises(ValueError, match="device_name"):
        Table.from_json({"buckets": []})


def test_a_table_round_trips_through_json():
    table = tables.table_named("NVIDIA H100 80GB HBM3")
    assert Table.from_json(json.loads(json.dumps(table.to_json()))) == table


CUDA = torch.device("cuda")


@pytest.fixture
def described_gpu(monkeypatch):
    """``describe(name, capability, sms)``: make ``torch.device("cuda")`` that GPU for ``table_for`` and
    ``default_config`` on any machine (no launch: ``default_config`` only chooses)."""
    def describe(name, capability, sms):
        props = SimpleNamespace(name=name, major=capability[0], minor=capability[1], multi_processor_count=sms)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(dispatch, "cuda_capability", lambda device, stand_in: capability)
        monkeypatch.setattr(dispatch, "num_sms", lambda device, stand_in: sms)
        monkeypatch.setattr(dispatch, "has_gluon", lambda: True)
        _clear_table_caches()

    yield describe
    _clear_table_caches()


def _clear_table_caches():
    for cached in [f for f in vars(tables).values() if hasattr(f, "cache_clear")]:
        cached.cache_clear()


def test_a_gpu_with_its_own_table_gets_it(described_gpu):
    described_gpu("NVIDIA H200", (9, 0), 132)
    assert tables.table_for(CUDA).device_name == "NVIDIA H200"


def test_a_hopper_without_a_table_gets_the_hopper_table_with_its_own_sm_count(described_gpu, caplog):
    # an H100 PCIe: sm_90, 114 SMs, no table of its own
    described_gpu("NVIDIA H100 PCIe", (9, 0), 114)
    with caplog.at_level("INFO", logger="paged_transformers"):
        assert tables.table_for(CUDA).device_name == "NVIDIA H100 80GB HBM3"  # 132 SMs; the H200's too: file order
        assert tables.table_for(CUDA) is tables.table_for(CUDA)
    said = [r.getMessage() for r in caplog.records if "W4A16" in r.getMessage()]
    assert len(said) == 1 and all("NVIDIA H100 80GB HBM3" in m for m in said), said  # once per device, cached
    # decode at 32 rows of a 4096 x 4096 weight: WGMMA, as on any Hopper before the tables; the one-wave candidate
    # (32 x 64 tiles, split 2: 128 programs) does not fit 114 SMs, so the next, split 1
    cfg = default_config(32, 4096, 4096, 128, CUDA)
    assert (cfg.algo, cfg.block_m, cfg.block_n, cfg.split_k) == (A.WGMMA, 32, 64, 1)
    # 4 rows: the table's TC at 4 programs an SM, 64 tiles of 64 columns, 32 K steps of 128:
    # ceil(4 * 114 / 64) = 8 slices on 114 SMs (9 on the table's 132)
    cfg = default_config(4, 4096, 4096, 128, CUDA)
    assert (cfg.algo, cfg.block_n, cfg.split_k) == (A.TC, 64, 8)


def test_a_gpu_of_another_capability_gets_the_fallback(described_gpu):
    described_gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108)
    assert tables.table_for(CUDA) is None
    for M in (1, 4, 32, 300):
        cfg = default_config(M, 4096, 4096, 128, CUDA)
        first = tables.fallback_candidates(M)[0]
        assert (cfg.algo.value, cfg.block_m, cfg.block_n) == (first.algo, first.block_m, first.block_n), (M, cfg)


def test_the_table_lookup_reads_the_files_once(described_gpu, monkeypatch):
    described_gpu("NVIDIA GH200 480GB", (9, 0), 132)  # no table of its own: all files read for the nearest
    assert default_config(32, 4096, 4096, 128, CUDA).algo is A.WGMMA
    monkeypatch.setattr(tables.json, "loads", lambda *a: pytest.fail("a table file read again"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: pytest.fail("device asked again"))
    for _ in range(3):
        assert default_config(32, 4096, 4096, 128, CUDA).algo is A.WGMMA
