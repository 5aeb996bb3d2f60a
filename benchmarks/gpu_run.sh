#!/usr/bin/env bash
# The GPU run of record, as one device-tool call (repo root): install offline, then
#   1. end-to-end bench (paged on the full workload; stock engines on the first HF_SUBSET requests),
#   2. the whole test suite on the GPU machine's transformers (the lowest supported, 5.17) and CUDA,
#   3. the attention-kernel correctness grid and timings (no config sweeps).
# Each stage has its own time limit so the call ends inside the 10-minute cap and keeps what it has.
# Usage: bash benchmarks/gpu_run.sh [HF_SUBSET]
set -o pipefail
export PYTHONUNBUFFERED=1
SUBSET=${1:-128}
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"  # the device tool sets OUT
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/nvidia_smi.txt"
timeout 300 paged-transformers bench --model llama-3-8b --num-requests 256 --input-len-range 64 1024 \
  --output-len-range 16 512 --seed 0 --compare hf-generate,hf-cb --compare-num-requests "$SUBSET" \
  --hf-batch-size 64 --output-json "$OUT/bench_llama3_8b.json" 2>&1 | grep -v Warning > "$OUT/bench.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests > "$OUT/pytest.log" 2>&1
timeout 100 python3 benchmarks/bench_kernels.py --skip-sweeps --out "$OUT" > "$OUT/kernels.log" 2>&1
tail -25 "$OUT/kernels.log"; tail -8 "$OUT/pytest.log"; tail -14 "$OUT/bench.log"
