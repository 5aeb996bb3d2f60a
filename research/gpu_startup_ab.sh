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
run() {  # run TAG VARIANT CACHES: one process, its report in $OUT/startup_TAG.json
  local tag=$1 variant=$2 caches=$3
  TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton timeout 200 \
    python3 research/startup_profile.py --out "$OUT" --tag "$tag" --variant "$variant" > "$OUT/log_$tag.txt" 2>&1
  echo "== $tag rc=$? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))
print('construction', round(r['construction_s'],2), 'first call', round(r['first_call_s'],2), 'b64 first call',
      round(r['b64_first_call_s'],2), 'ms/step b1 b64', round(r['b1_ms_per_step'],2), round(r['b64_ms_per_step'],2),
      'our variants', r['our_kernel_variants'])" "$OUT/startup_$tag.json" 2>&1 | tail -1)"
}
declare -A first
for i in 1 2; do
  for variant in before-compile-only tree; do
    caches=$(mktemp -d); [ "$i" = 1 ] && first[$variant]=$caches
    run "${variant}_cold$i" "$variant" "$caches"
  done
done
for variant in before-compile-only tree; do
  run "${variant}_warm" "$variant" "${first[$variant]}"
done
run eager-graphs_cold eager-graphs "$(mktemp -d)"
(cd "$OUT" && tar czf logs.tgz log_*.txt && rm -f log_*.txt)
