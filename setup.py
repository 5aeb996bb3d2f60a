"""Which packages the wheel holds: every package under ``paged_transformers/``, found by
``find_packages`` so a new subpackage cannot be left out, plus ``kernels/`` and ``patches/`` (and any
subpackage of theirs), which live at the top of the repo but install inside the package namespace as
``paged_transformers.kernels`` and ``paged_transformers.patches``: a top-level module named ``kernels``
would shadow Hugging Face's own ``kernels`` package. Nothing else (tests, benchmarks, examples) is
installed. Data files the code reads: the W4A16 tuning tables (``kernels/w4a16/configs/*.json``, read by
``kernels/w4a16/tables.py``). Everything else about the package is in pyproject.toml.

``kernels/`` and ``patches/`` have no ``__init__.py`` (their subfolders do): with one, Python run from the
checkout root would import ``kernels/`` as the top-level ``kernels`` in place of Hugging Face's. They install as
namespace subpackages; from a checkout, ``paged_transformers/_source_tree.py`` maps them into the package.
"""

from setuptools import find_packages, setup

PACKAGE = "paged_transformers"
MAPPED = {f"{PACKAGE}.kernels": "kernels", f"{PACKAGE}.patches": "patches"}  # package -> folder


def _packages_in(name: str, folder: str) -> list[str]:
    """``name`` and every package below ``folder``, named inside ``name``."""
    return [name] + [f"{name}.{sub}" for sub in find_packages(folder)]


setup(
    packages=[p for name, folder in {PACKAGE: PACKAGE, **MAPPED}.items() for p in _packages_in(name, folder)],
    package_dir={PACKAGE: PACKAGE, **MAPPED},
    package_data={f"{PACKAGE}.kernels.w4a16": ["configs/*.json"]},
)
