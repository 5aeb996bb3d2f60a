#!/usr/bin/env bash
# research/startup_profile.py on the GPU machine: the tree's tracing settings against --specialize-one, each with
# a cold Inductor/Triton cache (a fresh machine) and then warm (a user's later runs), then the warm construction
# under cProfile. One device-tool call from the repo root: bash research/gpu_startup.sh
set -o pipefail
export PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
OUT=${OUT:-research/out}; mkdir -p "$OUT"
caches=$(mktemp -d)  # one Inductor / Triton cache pair per variant: cold at its first run, warm at its second
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
for variant in new old; do
  flag=""; [ "$variant" = old ] && flag="--specialize-one"
  export TORCHINDUCTOR_CACHE_DIR=$caches/inductor_$variant TRITON_CACHE_DIR=$caches/triton_$variant
  for run in cold warm; do
    timeout 170 python3 research/startup_profile.py --variant compiled $flag --out "$OUT" --tag "${variant}_$run" > "$OUT/log_${variant}_$run.txt" 2>&1
    echo "== $variant $run rc=$?"; grep -E '"(construction_s|first_call_s|second_call_s|b1_ms_per_step|b64_ms_per_step)"' "$OUT/log_${variant}_$run.txt"
  done
done
export TORCHINDUCTOR_CACHE_DIR=$caches/inductor_new TRITON_CACHE_DIR=$caches/triton_new
timeout 120 python3 research/startup_profile.py --variant compiled --cprofile --out "$OUT" --tag new_warm_prof > "$OUT/log_prof.txt" 2>&1
echo "== prof rc=$?"; grep -E '"(construction_s|first_call_s)"' "$OUT/log_prof.txt"
(cd "$OUT" && tar czf logs.tgz log_*.txt && rm -f log_*.txt startup_new_warm_prof.json)
