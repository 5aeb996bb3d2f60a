"""The built wheel holds every package of the source tree, under ``paged_transformers``, and nothing at the
top level but it: ``kernels/`` and ``patches/`` install as ``paged_transformers.kernels`` /
``paged_transformers.patches``, and tests, benchmarks and examples are not installed. The package imports from the
wheel, and from the checkout root (where the checkout's ``kernels/`` must not shadow Hugging Face's ``kernels``)."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAPPED = {"paged_transformers": "paged_transformers", "kernels": "paged_transformers/kernels",
          "patches": "paged_transformers/patches"}  # source folder -> folder in the wheel
BUILD_INPUTS = ["pyproject.toml", "setup.py", "README.md", *MAPPED]


def _source_modules() -> set[str]:
    """``paged_transformers/.../*.py`` paths the wheel must hold, read from the source tree."""
    found = set()
    for folder, installed in MAPPED.items():
        for module in (REPO / folder).rglob("*.py"):
            if "__pycache__" not in module.parts:
                found.add(f"{installed}/{module.relative_to(REPO / folder).as_posix()}")
    return found


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -c code`` in ``cwd`` (first on its sys.path, as for any ``python -c``), offline."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


IMPORTS = ("import paged_transformers; from paged_transformers import LLM, patch; "
           "from paged_transformers.kernels.api import paged_attention_ref; import paged_transformers.patches.generate; "
           "print(paged_transformers.__file__)")


@pytest.mark.slow
def test_wheel_holds_every_package_and_no_top_level_extras(tmp_path):
    # NOTE: built from a copy holding only what the build reads, so no stale build/ folder of the
    # checkout can add files, and the checkout gets no build/ or egg-info written into it.
    src = tmp_path / "src"
    src.mkdir()
    # tests, benchmarks and examples lie beside the package, as in the checkout; none may be installed
    for name in [*BUILD_INPUTS, "tests", "benchmarks", "examples"]:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(tmp_path / "dist")], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("paged_transformers-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # the data files the code reads: the W4A16 tuning tables
    tables = {f"paged_transformers/kernels/{p.relative_to(REPO / 'kernels').as_posix()}"
              for p in (REPO / "kernels").rglob("configs/*.json")}
    assert tables and tables - names == set(), f"tuning tables missing from the wheel: {sorted(tables - names)}"

    expected = _source_modules()
    assert {"paged_transformers/__init__.py", "paged_transformers/quantization/__init__.py",
            "paged_transformers/kernels/api.py", "paged_transformers/kernels/cache_ops/__init__.py",
            "paged_transformers/patches/generate.py"} <= expected
    assert expected - names == set(), f"modules missing from the wheel: {sorted(expected - names)}"
    top_level = {n.split("/", 1)[0] for n in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"paged_transformers"}, sorted(top_level)

    # the wheel's files, as pip installs a pure wheel, ahead of any other copy on the path; imported elsewhere
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    run = _python(IMPORTS, tmp_path, PYTHONPATH=str(site))
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.split()[-1]).resolve().is_relative_to(site.resolve()), run.stdout


def test_mapped_folders_have_no_package_init():
    # NOTE: an __init__.py in a top-level folder makes it a regular package named after the folder, which wins
    # over an installed package of that name whenever the checkout root is on sys.path.
    for folder in MAPPED:
        if folder != "paged_transformers":
            assert not (REPO / folder / "__init__.py").exists(), f"{folder}/__init__.py would shadow a `{folder}` package"


@pytest.mark.slow
def test_imports_from_the_checkout_root(tmp_path):
    # the README's Quick start leaves the user in the checkout: `python -c`, scripts saved there and `python -m`
    # put it first on sys.path, so paged_transformers comes from the checkout whatever is installed
    run = _python(IMPORTS, REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.split()[-1]).resolve().is_relative_to(REPO / "paged_transformers"), run.stdout
    # Hugging Face's `kernels` (which transformers imports), when installed, is the one `import kernels` finds there
    where = _python("import importlib.util; spec = importlib.util.find_spec('kernels'); print(spec and spec.origin)",
                    tmp_path).stdout.split()[-1]
    if where == "None":
        pytest.skip("Hugging Face's kernels package is not installed")
    run = _python("import kernels; print(kernels.__file__)", REPO)
    assert run.returncode == 0 and run.stdout.split()[-1] == where, (run.stdout, run.stderr[-2000:])
