#!/usr/bin/env bash
# Issue 4 GPU run: install, CUDA-only runner tests (graph vs eager), then the bench of record.
# Usage (device tool, repo root): bash benchmarks/gpu_issue4.sh [HF_SUBSET] [EXTRA BENCH ARGS...]
set -o pipefail
export PYTHONUNBUFFERED=1
# triton 3.6 rejects `NAME: tl.constexpr = v` module globals (3.9 accepts them); see BENCHMARKS.md
export TRITON_ALLOW_NON_CONSTEXPR_GLOBALS=1
SUBSET=${1:-128}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/nvidia_smi.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_runner.py -k cuda 2>&1 | tail -5 | tee "$OUT/pytest_cuda.txt"
paged-transformers bench --model llama-3-8b --num-requests 256 --input-len-range 64 1024 \
  --output-len-range 16 512 --seed 0 --compare hf-generate,hf-cb --compare-num-requests "$SUBSET" \
  --hf-batch-size 64 --output-json "$OUT/bench_llama3_8b.json" "$@" 2>&1 | grep -v Warning | tee "$OUT/bench.log" | tail -40
