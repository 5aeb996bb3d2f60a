"""``paged-transformers bench serve`` against a server it starts on the embedded model: every request completes
with its output length, the JSON record and the plot are written, the table prints; and the record's numbers
come from the requests (a hand-made ``summarize`` case)."""

import json

import pytest

from serving import skip_without_server_deps


@pytest.mark.slow
def test_bench_serve_runs_rates_and_writes_the_record(smollm2, tmp_path, capsys):
    skip_without_server_deps()
    pytest.importorskip("matplotlib")
    from paged_transformers.cli import main

    out_json, out_png = tmp_path / "serve.json", tmp_path / "serve.png"
    status = main(["bench", "serve", "--num-requests", "6", "--input-len-range", "4", "12", "--output-len-range", "2",
                   "4", "--request-rate", "8", "inf", "--max-model-len", "128", "--device", "cpu", "--compare-offline",
                   "--output-json", str(out_json), "--output-png", str(out_png)])
    assert status == 0
    report = json.loads(out_json.read_text())
    assert [r["request_rate"] for r in report["records"]] == [8.0, "inf"]
    for record in report["records"]:
        assert record["completed"] == 6 and record["errors"] == 0
        assert record["ttft_s"]["p50"] > 0 and record["tpot_s"]["p99"] >= record["tpot_s"]["p50"]
    assert report["offline"]["num_requests"] == 6
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "offline LLM.generate" in capsys.readouterr().out


def test_summarize_counts_from_the_requests():
    from paged_transformers.bench.serve import RequestResult, summarize

    results = [RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.5, e2e=1.5, itl=[0.25] * 4),
               RequestResult(ok=True, prompt_tokens=10, output_tokens=3, ttft=1.0, e2e=2.0, itl=[0.5] * 2),
               RequestResult(ok=False, error="HTTP 503")]
    record = summarize(2.0, results, duration_s=4.0)
    assert (record["completed"], record["errors"], record["error_examples"]) == (2, 1, ["HTTP 503"])
    assert record["output_throughput"] == 2.0 and record["total_token_throughput"] == 7.0
    assert record["tpot_s"]["p50"] == 0.25 and record["tpot_s"]["p99"] == 0.5  # (1.5-0.5)/4, (2-1)/2
    assert record["ttft_s"]["mean"] == 0.75


@pytest.mark.slow
def test_client_processes_share_the_requests_and_keep_their_order():
    """Three client processes against one server: every request completes with its own output length (ignore_eos),
    in the order of the requests, and the run's duration spans them all."""
    skip_without_server_deps()
    from paged_transformers.bench.serve import run_clients
    from paged_transformers.bench.workload import synthetic_workload

    from serving import MODEL, running_server

    requests = synthetic_workload(7, (4, 12), (2, 9), 1000, 5)
    assert len({r.output_len for r in requests}) > 2  # the order is visible in the output lengths
    with running_server() as server:
        results, duration_s, cpu_s = run_clients(server.url, MODEL, requests, float("inf"), None, 0, num_processes=3)
    assert [r.ok for r in results] == [True] * 7, [r.error for r in results]
    assert [r.output_tokens for r in results] == [r.output_len for r in requests]
    assert duration_s >= max(r.e2e for r in results) and cpu_s > 0
    assert all(0 < r.accepted <= duration_s for r in results)


def test_client_processes_are_checked_before_any_starts():
    from paged_transformers.bench.serve import run_clients
    from paged_transformers.bench.workload import synthetic_workload

    requests = synthetic_workload(2, (4, 8), (2, 4), 1000, 0)
    for bad, concurrency in ((0, None), (True, None), (3, None), (2, 1)):
        with pytest.raises(ValueError, match="num_processes"):
            run_clients("http://127.0.0.1:9", "m", requests, 1.0, concurrency, 0, num_processes=bad)


def test_the_cli_refuses_client_processes_over_the_requests_before_starting_a_server(tmp_path, capsys):
    from paged_transformers.bench.serve import main

    missing = str(tmp_path / "no-such-model")  # reached only if the counts were not checked first (an OSError)
    for extra, named in ((["--num-requests", "4"], "--num-requests 4"), (["--max-concurrency", "2"], "--max-concurrency 2")):
        with pytest.raises(SystemExit):
            main(["--model", missing, "--device", "cpu", "--num-client-processes", "5", *extra])
        assert named in capsys.readouterr().err
