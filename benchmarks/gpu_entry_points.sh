#!/usr/bin/env bash
# The GPU run of record for the entry points (issue 18), as one device-tool call from the repo root:
#   1. `bench --entry-points` in a first process (Inductor's compile cache cold: a fresh machine),
#   2. the first engine and first call of a second process (the cache the first one wrote: a user's later runs),
#      research/startup_profile.py,
#   3. CUDA tests, each file in its own process (every engine there sizes its KV pool at 0.9 of the GPU's memory);
#      each stage has its own time limit so the call ends inside the 10-minute cap.
# Usage: bash benchmarks/gpu_entry_points.sh [pytest files...]
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"  # the device tool sets OUT
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/nvidia_smi.txt"
# caches of this call's own, empty: the first construction of a fresh machine's first process
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
timeout 230 paged-transformers bench --entry-points --model llama-3-8b --output-json "$OUT/entry_points_cold.json" \
  2>&1 | grep -v Warning > "$OUT/entry_points_cold.log"
timeout 60 python3 research/startup_profile.py --out "$OUT" --tag warm > "$OUT/startup_warm.log" 2>&1
tests=("$@"); [ ${#tests[@]} -eq 0 ] && tests=(tests/test_runner.py tests/test_warm_engine.py tests/test_triton_backend.py)
start=$SECONDS
for t in "${tests[@]}"; do
  [ $((SECONDS - start)) -lt 170 ] || { echo "$t: not run (time)" >> "$OUT/pytest.log"; continue; }
  timeout $((180 - SECONDS + start)) python3 -m pytest -q -p no:cacheprovider "$t" > "$OUT/pytest_one.log" 2>&1
  echo "$t rc=$? $(tail -1 "$OUT/pytest_one.log")" >> "$OUT/pytest.log"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_one.log" >> "$OUT/pytest.log"
done
rm -f "$OUT/pytest_one.log"; cat "$OUT/pytest.log"; tail -16 "$OUT/entry_points_cold.log"
grep -E '"(construction_s|first_call_s|second_call_s)"' "$OUT/startup_warm.log"
