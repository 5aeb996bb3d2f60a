#!/usr/bin/env bash
# The GPU run of record for the entry points (issue 18), as one device-tool call from the repo root:
#   1. `bench --entry-points` in a first process (Inductor's compile cache cold: a fresh machine),
#   2. the same in a second process (the cache the first one wrote: a user's later runs),
#   3. the CUDA tests of the warm engine, the runner's lazy graphs, the W4A16 package and the Triton backend.
# Each stage has its own time limit so the call ends inside the 10-minute cap and keeps what it has.
# Usage: bash benchmarks/gpu_entry_points.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"  # the device tool sets OUT
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/nvidia_smi.txt"
for run in cold warm; do
  timeout 215 paged-transformers bench --entry-points --model llama-3-8b --output-json "$OUT/entry_points_$run.json" \
    2>&1 | grep -v Warning > "$OUT/entry_points_$run.log"
done
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/test_runner.py tests/test_warm_engine.py tests/test_w4a16.py \
  tests/test_triton_backend.py > "$OUT/pytest.log" 2>&1
tail -5 "$OUT/pytest.log"; for run in cold warm; do echo "== $run"; tail -14 "$OUT/entry_points_$run.log"; done
