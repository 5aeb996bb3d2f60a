"""The ``paged-transformers generate`` command: the embedded default model end to end, and user mistakes
ending as one ``error:`` line with exit status 2 (no traceback)."""

import argparse
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paged_transformers.cli import build_parser, main

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "models"
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"fixtures folder {FIXTURES} is missing")


def test_generate_default_model_mentions_paris(smollm2, capsys):
    start = time.perf_counter()
    status = main(["generate", "--max-tokens", "8", "The capital of France is"])
    wall_s = time.perf_counter() - start
    out = capsys.readouterr().out
    assert status == 0
    assert "Paris" in out
    timing, summary = out.strip().splitlines()[-2:]
    assert summary.startswith("requests: 1 | prompt tokens: 5 |") and "peak KV blocks used:" in summary
    # model load, engine start and generation reported apart; tokens/s count the generation alone
    match = re.fullmatch(r"model load: ([\d.]+) s \| engine start: ([\d.]+) s \| generation: ([\d.]+) s "
                         r"\(first token after ([\d.]+) s\)", timing)
    assert match, timing
    load_s, engine_s, generation_s, first_s = map(float, match.groups())
    assert load_s + engine_s + generation_s <= wall_s + 0.2 and first_s <= generation_s + 0.01
    num_output = int(re.search(r"output tokens: (\d+)", summary).group(1))
    output_rate = float(re.search(r"\(([\d.]+) output tokens/s\)", summary).group(1))
    assert output_rate == pytest.approx(num_output / generation_s, rel=0.05, abs=0.1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--model", "/nonexistent/model", "hi"], "no such model folder"),
        (["generate", "--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file /nonexistent/prompts.txt: No such file"),
        (["generate", "--device", "nodevice", "hi"], "--device nodevice"),
        # the sampling flags are checked before the model loads ('.' would fail as a model folder)
        (["generate", "--max-tokens", "0", "--model", ".", "hi"], "max_tokens"),
        (["bench", "--model", "tiny-llama", "--device", "cpu", "--num-requests", "0"],
         "num_requests must be a positive integer, got 0"),
        (["bench", "--model", "tiny-llama", "--device", "cpu", "--compare", "hf-generate", "--compare-num-requests", "0"],
         "--compare-num-requests must be positive"),
    ],
    ids=["model-path", "prompts-file", "device", "sampling-checked-before-load", "bench-no-requests",
         "bench-no-compared-requests"],
)
def test_user_mistakes_end_as_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    if message:
        assert message in err[0]


def test_empty_prompts_file(tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("\n   \n")
    assert main(["generate", "--prompts-file", str(path)]) == 2
    assert "no prompts" in capsys.readouterr().err


@needs_fixtures
def test_generate_loads_a_gptq_checkpoint_natively(capsys):
    """The CLI reads GPTQ checkpoints itself (no optimum / gptqmodel): the fixture's SmolLM2 GPTQ model
    completes the fixtures' France prompt with Paris, as its golden output does."""
    status = main(["generate", "--model", str(FIXTURES / "smollm2-135m-instruct-gptq-4bit-g64"), "--device", "cpu",
                   "--max-tokens", "6", "The capital of France is"])
    assert status == 0
    assert "Paris" in capsys.readouterr().out


@needs_fixtures
def test_bench_loads_an_awq_checkpoint_natively(tmp_path):
    out = tmp_path / "bench.json"
    status = main(["bench", "--model", str(FIXTURES / "tiny-llama-awq-4bit-g64-gemm"), "--device", "cpu",
                   "--dtype", "float32", "--num-requests", "2", "--input-len-range", "4", "8",
                   "--output-len-range", "2", "3", "--attention-backend", "torch", "--output-json", str(out)])
    assert status == 0
    report = json.loads(out.read_text())
    assert report["engines"]["paged"]["num_requests"] == 2 and "error" not in report["engines"]["paged"]


@needs_fixtures
def test_checkpoint_without_tokenizer_is_one_whole_line(capsys):
    assert main(["generate", "--model", str(FIXTURES / "tiny-llama-fp16"), "--device", "cpu", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no usable tokenizer" in err[0], err


def test_version(capsys, tmp_path):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"paged-transformers {importlib.metadata.version('paged-transformers')}\n"
    # answered without importing torch or transformers (seconds each); the working directory is not the checkout
    code = ("import sys; from paged_transformers.cli import main; status = main(['--version']); "
            "print(status, 'torch' in sys.modules, 'transformers' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.stdout.splitlines()[-1] == "0 False False", (run.stdout, run.stderr[-2000:])


def test_bench_refuses_a_large_random_model_on_cpu(monkeypatch, capsys):
    """`bench` with no --model on a CPU machine used to start building a random Llama-3-8B (16 GB) without a word."""
    from paged_transformers.bench import command

    monkeypatch.setattr(command, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    monkeypatch.setattr(command, "measure_device_peaks", lambda *a, **k: pytest.fail("the run started"))
    assert main(["bench", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model llama-3-8b on cpu" in err[0] and "8.0B-parameter" in err[0], err
    assert "16 GB in bfloat16" in err[0] and "--model tiny-llama" in err[0], err


def test_serve_on_a_busy_port_fails_before_loading_the_model(monkeypatch, capsys):
    """`serve` on a port in use used to load the model first and fail only when uvicorn started."""
    from paged_transformers.entrypoints.openai import api_server

    monkeypatch.setattr(api_server, "app_from_args", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0] and "in use" in err[0], err


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help_shows_every_default(command):
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser = subparsers.choices[command]
    # one block per option: from its "  --name" line to the next option's, whitespace-normalized
    blocks = [" ".join(b.split()) for b in re.split(r"\n(?=  -)", parser.format_help()) if b.startswith("  -")]
    by_option = {b.split()[0].rstrip(","): b for b in blocks}
    options = [a for a in parser._actions if a.option_strings and a.default is not argparse.SUPPRESS]
    assert len(options) > 10
    for action in options:
        block = by_option[action.option_strings[0]]
        assert block.endswith(f"(default: {action.default})"), block


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("hub_env", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "closed port"}],
                         ids=["offline", "hub-unreachable"])
@pytest.mark.slow
def test_uncached_hub_id_fails_at_once_naming_it(hub_env, tmp_path):
    """A made-up hub id with no network: one error line naming the id and saying it is not available
    offline, instead of ~50 s of download retries ending in a tokenizer error (the timeout stops those)."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), **hub_env}
    if env.get("HF_ENDPOINT") == "closed port":
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{_closed_port()}"
    model_id = "made-up-org/no-such-model-17"
    # the working directory is not the checkout, whose sources -m would import before the installed package
    run = subprocess.run([sys.executable, "-m", "paged_transformers.cli", "generate", "--model", model_id, "hi"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=40)
    err = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(err) == 1, run.stderr
    assert err[0].startswith(f"error: model '{model_id}' is not available offline"), err[0]
