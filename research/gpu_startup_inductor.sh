#!/usr/bin/env bash
# Inductor options against the first engine construction on empty caches (issue 18): research/startup_profile.py once
# per option set, each process on empty Inductor / Triton caches of its own, no profiler attached; each report has the
# decode speed after, so a start-up saving that costs speed shows.
# One device-tool call from the repo root:  bash research/gpu_startup_inductor.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-research/out}; mkdir -p "$OUT"
run() {  # run TAG [--inductor-option NAME=VALUE ...]: one process on empty caches, its report in $OUT/startup_TAG.json
  local tag=$1; shift
  local caches; caches=$(mktemp -d)
  TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton timeout 200 \
    python3 research/startup_profile.py --variant compiled --out "$OUT" --tag "$tag" "$@" > "$OUT/log_$tag.txt" 2>&1
  echo "== $tag rc=$? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))
print('construction', round(r['construction_s'],2), 'first call', round(r['first_call_s'],2),
      'ms/step b1 b64', round(r['b1_ms_per_step'],2), round(r['b64_ms_per_step'],2))" "$OUT/startup_$tag.json" 2>&1 | tail -1)"
}
run tree
run no_pointwise_autotune --inductor-option triton.autotune_pointwise=False
run no_combo --inductor-option combo_kernels=False
run neither --inductor-option triton.autotune_pointwise=False --inductor-option combo_kernels=False
run tree_again
(cd "$OUT" && tar czf logs_inductor.tgz log_*.txt && rm -f log_*.txt)
