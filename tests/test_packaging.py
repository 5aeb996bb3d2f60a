"""The built wheel holds every package of the source tree, under ``paged_transformers``, and nothing at the
top level but it: ``kernels/`` and ``patches/`` install as ``paged_transformers.kernels`` /
``paged_transformers.patches``, and tests, benchmarks and examples are not installed."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAPPED = {"paged_transformers": "paged_transformers", "kernels": "paged_transformers/kernels",
          "patches": "paged_transformers/patches"}  # source folder -> folder in the wheel
BUILD_INPUTS = ["pyproject.toml", "setup.py", "README.md", *MAPPED]


def _source_packages() -> set[str]:
    """``paged_transformers/.../__init__.py`` paths the wheel must hold, read from the source tree."""
    found = set()
    for folder, installed in MAPPED.items():
        for init in (REPO / folder).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                found.add(f"{installed}/{init.relative_to(REPO / folder).as_posix()}")
    return found


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

    expected = _source_packages()
    assert {"paged_transformers/__init__.py", "paged_transformers/quantization/__init__.py",
            "paged_transformers/kernels/__init__.py", "paged_transformers/patches/__init__.py"} <= expected
    assert expected - names == set(), f"packages missing from the wheel: {sorted(expected - names)}"
    top_level = {n.split("/", 1)[0] for n in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"paged_transformers"}, sorted(top_level)
