"""The bench command on CPU: workload generation, the analytic roofline, ratios, and the JSON report of a
tiny end-to-end run of all three engines (torch attention backend). Speed is measured on the GPU, never here."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from paged_transformers import bench
from paged_transformers.cli import main as cli_main


def test_synthetic_workload_is_seeded_and_in_range():
    a = bench.synthetic_workload(50, (3, 9), (1, 4), vocab_size=100, seed=0)
    b = bench.synthetic_workload(50, (3, 9), (1, 4), vocab_size=100, seed=0)
    c = bench.synthetic_workload(50, (3, 9), (1, 4), vocab_size=100, seed=1)
    assert a == b and a != c
    assert {len(r.prompt_token_ids) for r in a} == set(range(3, 10))  # both ends reached
    assert {r.output_len for r in a} == {1, 2, 3, 4}
    assert all(0 <= t < 100 for r in a for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match="input_len_range"):
        bench.synthetic_workload(1, (5, 4), (1, 1), 10, 0)


def test_load_jsonl(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": [1, 2, 3], "output_len": 4}\n\n{"prompt": [5], "output_len": 1}\n')
    assert bench.load_jsonl(str(path)) == [bench.BenchRequest([1, 2, 3], 4), bench.BenchRequest([5], 1)]
    path.write_text('{"prompt": "hello", "output_len": 4}\n')
    with pytest.raises(ValueError, match="tokenizer"):
        bench.load_jsonl(str(path))
    path.write_text('{"text": [1], "output_len": 4}\n')
    with pytest.raises(ValueError, match="'prompt' and 'output_len'"):
        bench.load_jsonl(str(path))


def test_workload_roofline_by_hand():
    """Two requests (p=2, o=3) and (p=4, o=1): prefill compute-bound, two decode steps of one request."""
    reqs = [bench.BenchRequest([0, 0], 3), bench.BenchRequest([0] * 4, 1)]
    costs = {"weight_bytes_per_step": 1000, "kv_bytes_per_token": 10, "linear_flops_per_token": 100,
             "attention_flops_per_token_key": 2}
    bw, rate = 100.0, 1000.0
    roof = bench.workload_roofline(reqs, costs, bw, rate)
    prefill = (100 * 2 + 2 * 4 / 2 + 100 * 4 + 2 * 16 / 2) / rate
    # decode k=1: only request 0 (o=3 > 1), context 2+1; k=2: context 2+2; bytes dominate
    decode = (1000 + 10 * 3) / bw + (1000 + 10 * 4) / bw
    assert roof["prefill_s"] == pytest.approx(prefill)
    assert roof["decode_s"] == pytest.approx(decode)
    assert roof["output_tokens_per_s"] == pytest.approx(4 / (prefill + decode))
    assert roof["total_tokens_per_s"] == pytest.approx(10 / (prefill + decode))


def test_ratios_side_by_side():
    engines = {"paged": {"output_tokens_per_s": 300.0, "num_requests": 8},
               "hf_generate": {"output_tokens_per_s": 20.0, "num_requests": 4},
               "hf_cb": {"output_tokens_per_s": 30.0, "num_requests": 4}}
    r = bench.ratios(engines)
    assert r["paged_vs_hf_generate"]["output_tokens_per_s"] == pytest.approx(15.0)
    assert r["paged_vs_hf_cb"]["output_tokens_per_s"] == pytest.approx(10.0)
    assert r["paged_vs_hf_cb"]["other_num_requests"] == 4


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """The CLI in this process; on a CUDA machine in a subprocess that sees no GPU. This test is the CPU bench,
    and there transformers' continuous batching of the CPU model failed with a CUDA out-of-memory error inside
    the GPU test session (issue 4; cause not established), which is not what this test is about."""
    if not torch.cuda.is_available():
        status = cli_main(argv)
        return status, capsys.readouterr().out
    code = f"import sys; from paged_transformers.cli import main; sys.exit(main({argv!r}))"
    # cwd: not the checkout, whose sources `-c` would import before the installed package
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                          cwd=os.path.dirname(__file__), capture_output=True, text=True, check=False)
    return proc.returncode, proc.stdout


@pytest.mark.slow
def test_bench_command_writes_the_report(tmp_path, capsys):
    out = tmp_path / "bench.json"
    status, printed = _run_cli(["bench", "--model", "tiny-llama", "--dtype", "float32", "--device", "cpu",
                                "--num-requests", "6", "--input-len-range", "4", "24", "--output-len-range", "1", "6",
                                "--compare", "hf-generate,hf-cb", "--compare-num-requests", "4", "--hf-batch-size", "2",
                                "--attention-backend", "torch", "--output-json", str(out)], capsys)
    assert status == 0
    report = json.loads(out.read_text())
    for key in ("versions", "device", "workload", "engine_config", "engines", "roofline", "ratios"):
        assert key in report, key
    assert "output_tokens_per_s" in report["roofline"]  # None on CPU: no ceilings measured
    assert report["workload"]["num_requests"] == 6 and report["workload"]["ignore_eos"] is True
    for name in ("paged", "hf_generate", "hf_cb"):
        e = report["engines"][name]
        assert "error" not in e, e
        for key in ("output_tokens_per_s", "total_tokens_per_s", "ttft_s", "tpot_s", "peak_memory_gib"):
            assert key in e, (name, key)
        assert set(e["ttft_s"]) == {"mean", "p50", "p99"}
    paged = report["engines"]["paged"]
    assert paged["num_requests"] == 6 and report["engines"]["hf_cb"]["num_requests"] == 4
    assert paged["output_tokens"] == report["workload"]["output_tokens"]
    assert paged["kv_capacity_tokens"] == paged["kv_blocks_total"] * report["engine_config"]["block_size"]
    assert 0 < paged["kv_blocks_used"] <= paged["kv_blocks_total"]
    # every engine made exactly the requested tokens, and the fp32 greedy first tokens agree with paged
    assert report["engines"]["hf_cb"]["output_tokens"] == report["engines"]["hf_generate"]["output_tokens"]
    assert report["engines"]["hf_generate"]["first_token_agreement_with_paged"] == 1.0
    ratio = report["ratios"]["paged_vs_hf_generate"]["output_tokens_per_s"]
    assert ratio == pytest.approx(paged["output_tokens_per_s"] / report["engines"]["hf_generate"]["output_tokens_per_s"])
    assert np.isfinite(paged["tpot_s"]["p99"])
    assert "paged_vs_hf_cb" in printed  # the table is printed


def test_compile_flags_set_compile_layers_and_exclude_each_other(capsys):
    """``--compile`` / ``--no-compile`` / neither give ``compile_layers`` True / False / None (the fused eager layers
    where they apply); both at once is an argparse error naming them."""
    import argparse

    from paged_transformers.bench.command import _engine_config, add_arguments
    from paged_transformers.bench.workload import BenchRequest

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    requests = [BenchRequest([1, 2, 3], 4)]
    for flags, want in (([], None), (["--compile"], True), (["--no-compile"], False)):
        assert _engine_config(parser.parse_args(flags), requests).compile_layers is want, flags
    with pytest.raises(SystemExit):
        parser.parse_args(["--compile", "--no-compile"])
    assert "not allowed with argument --compile" in capsys.readouterr().err


def test_bench_reports_the_limits_picked_and_a_sweep_point_of_explicit_limits(tmp_path, capsys):
    """The main run leaves the step limits to the device (CPU: 256 sequences, 8192 tokens, graphs up to 256); single
    sweep values make one point, run with exactly those limits."""
    out = tmp_path / "bench.json"
    status, _ = _run_cli(["bench", "--model", "tiny-llama", "--dtype", "float32", "--device", "cpu",
                          "--num-requests", "3", "--input-len-range", "4", "8", "--output-len-range", "2", "3",
                          "--attention-backend", "torch", "--sweep", "max_num_seqs=2", "--sweep", "max_num_batched_tokens=64",
                          "--sweep", "max_cudagraph_capture_size=2", "--output-json", str(out)], capsys)
    assert status == 0
    report = json.loads(out.read_text())
    assert report["engine_config"]["max_num_seqs"] is None
    want = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_cudagraph_capture_size": 256}
    assert report["engines"]["paged"]["engine_limits"] == want
    (point,) = report["sweep"]
    assert point["engine_limits"] == {"max_num_seqs": 2, "max_num_batched_tokens": 64, "max_cudagraph_capture_size": 2}
    assert point["decode_batch1_s_p50"] is None  # CPU: no batch-1 measurement
