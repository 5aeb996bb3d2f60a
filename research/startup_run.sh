# Sourced by the research/gpu_*.sh scripts: run_startup TAG VARIANT CACHES runs research/startup_profile.py once, on
# the Inductor / Triton caches under CACHES, its report in $OUT/startup_TAG.json and its log in $OUT/log_TAG.txt, and
# prints its construction, first calls, decode ms per step and compiled kernel variants on one line.
run_startup() {
  local tag=$1 variant=$2 caches=$3
  TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton timeout 200 \
    python3 research/startup_profile.py --out "$OUT" --tag "$tag" --variant "$variant" > "$OUT/log_$tag.txt" 2>&1
  echo "== $tag rc=$? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))
print('construction', round(r['construction_s'],2), 'first call', round(r['first_call_s'],2), 'b64 first call',
      round(r['b64_first_call_s'],2), 'ms/step b1 b64', round(r['b1_ms_per_step'],2), round(r['b64_ms_per_step'],2),
      'our variants', r['our_kernel_variants'])" "$OUT/startup_$tag.json" 2>&1 | tail -1)"
}
