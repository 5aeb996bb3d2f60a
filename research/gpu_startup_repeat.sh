#!/usr/bin/env bash
# The first engine construction of successive processes on one machine (issue 18's <= 10 s): research/startup_profile.py
# four times on caches that start empty (the first process fills them, the later ones are a user's later runs), then
# three times again on empty caches with Dynamo's local PGO off (TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO=0: whether
# the second process's dynamic-shape decisions, read back from PGO's file, make it trace and compile other graphs).
# No profiler attached. Each process reports its Inductor / AOTAutograd cache hits and misses.
# One device-tool call from the repo root:  bash research/gpu_startup_repeat.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-research/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
run() {  # run TAG [ENV=VALUE ...]: one process, its report in $OUT/startup_TAG.json
  local tag=$1; shift
  env "$@" timeout 150 python3 research/startup_profile.py --variant compiled --out "$OUT" --tag "$tag" > "$OUT/log_$tag.txt" 2>&1
  echo "== $tag rc=$? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); c=r['cache_counters_construction']
print(round(r['construction_s'],2), round(r['first_call_s'],2), {g: dict(v) for g, v in c.items() if v})" "$OUT/startup_$tag.json" 2>&1 | tail -1)"
}
for variant in default no_pgo; do
  caches=$(mktemp -d)
  export TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton
  extra=(); [ "$variant" = no_pgo ] && extra=(TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO=0)
  for i in 1 2 3 4; do
    [ "$variant" = no_pgo ] && [ "$i" = 4 ] && break
    run "${variant}_$i" "${extra[@]}"
  done
done
(cd "$OUT" && tar czf logs.tgz log_*.txt && rm -f log_*.txt)
