#!/usr/bin/env bash
# kernels.compile_only against the tree before it (issue 18's <= 10 s first construction): research/startup_profile.py
# in alternating processes, each variant on Inductor / Triton caches of its own that start empty (twice), then once
# more on the caches its first process wrote. No profiler attached. Each report counts the variants of our Triton
# kernels compiled during the construction and each call after it. Last, the eager layers in decode graphs
# (EngineConfig(compile_layers=False)) on empty caches: the start and decode speed without torch.compile.
# One device-tool call from the repo root:  bash research/gpu_startup_ab.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-research/out}; mkdir -p "$OUT"
source research/startup_run.sh
declare -A first
for i in 1 2; do
  for variant in before-compile-only compiled; do
    caches=$(mktemp -d); [ "$i" = 1 ] && first[$variant]=$caches
    run_startup "${variant}_cold$i" "$variant" "$caches"
  done
done
for variant in before-compile-only compiled; do
  run_startup "${variant}_warm" "$variant" "${first[$variant]}"
done
run_startup eager-graphs_cold eager-graphs "$(mktemp -d)"
(cd "$OUT" && tar czf logs.tgz log_*.txt && rm -f log_*.txt)
