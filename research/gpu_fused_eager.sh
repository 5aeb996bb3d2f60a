#!/usr/bin/env bash
# The fused eager layers (compilation/fused_layers.py) against the compiled layers and the model's own eager layers
# (issue 18's <= 10 s first construction on empty compile caches, at the compiled layers' speed): first
# research/startup_profile.py per variant in alternating processes, each on Inductor / Triton caches of its own that
# start empty (ROUNDS times, default 1): construction, first call, decode ms per step at batch 1 and 64. Then the workload of record
# and batch-1 decode (`paged-transformers bench`) with compiled layers and with fused eager layers (--no-compile), in
# the same call (about 7 min). One device-tool call from the repo root:  bash research/gpu_fused_eager.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-research/out}; mkdir -p "$OUT"
source research/startup_run.sh
for i in $(seq "${ROUNDS:-1}"); do
  for variant in fused-eager tree eager-graphs; do
    run_startup "${variant}_cold$i" "$variant" "$(mktemp -d)"
  done
done
for mode in compiled fused-eager; do
  flag=""; [ "$mode" = fused-eager ] && flag="--no-compile"
  timeout 400 paged-transformers bench --model llama-3-8b $flag --output-json "$OUT/workload_$mode.json" \
    > "$OUT/log_bench_$mode.txt" 2>&1
  echo "== bench $mode rc=$?"; tail -15 "$OUT/log_bench_$mode.txt"
done
(cd "$OUT" && tar czf logs.tgz log_*.txt startup_*.json && rm -f log_*.txt startup_*.json)
