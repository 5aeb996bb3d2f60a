#!/usr/bin/env bash
# The fused eager layers as the default for Llama-family layers on CUDA against the layers compiled by Inductor
# (issue 18's <= 10 s first construction on empty compile caches): research/startup_profile.py for the tree (fused
# eager) and --variant compiled in alternating processes, each on Inductor / Triton caches of its own that start empty
# (ROUNDS, default 1): construction, first call, decode ms per step at batch 1 and 64. Then the workload of record and
# batch-1 decode (`paged-transformers bench`) with the default and with --compile, in the same call (about 8 min).
# One device-tool call from the repo root:  bash research/gpu_fused_default.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-research/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2  # python3's pip: the image's `pip` is another Python's
source research/startup_run.sh
for i in $(seq "${ROUNDS:-1}"); do
  for variant in tree compiled; do
    run_startup "${variant}_cold$i" "$variant" "$(mktemp -d)"
  done
done
for mode in default compiled; do
  flag=""; [ "$mode" = compiled ] && flag="--compile"
  timeout 240 paged-transformers bench --model llama-3-8b $flag --output-json "$OUT/workload_$mode.json" \
    > "$OUT/log_bench_$mode.txt" 2>&1
  echo "== bench $mode rc=$?"; tail -12 "$OUT/log_bench_$mode.txt"
done
(cd "$OUT" && tar czf logs.tgz log_*.txt startup_*.json && rm -f log_*.txt startup_*.json)
