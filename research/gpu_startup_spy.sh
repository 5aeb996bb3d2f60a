#!/usr/bin/env bash
# Where the first engine of a process spends its wall time, cold and warm (issue 18's <= 10 s construction):
# research/startup_profile.py under py-spy (wall-clock samples of every thread, compile workers included), first
# with empty Inductor / Triton caches (a fresh machine), then again on the caches the first run wrote (a user's
# later runs). research/spy_summary.py buckets the samples afterwards. Then `bench --entry-points` on those caches.
# One device-tool call from the repo root, py-spy's wheel carried in .whl:  bash research/gpu_startup_spy.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-research/out}; mkdir -p "$OUT"
caches=$(mktemp -d)
export TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
for run in cold warm; do
  timeout 170 py-spy record --format raw --rate 50 --idle --threads --subprocesses --nonblocking \
    -o "$OUT/spy_$run.txt" -- python3 research/startup_profile.py --variant compiled --out "$OUT" --tag "$run" > "$OUT/log_$run.txt" 2>&1
  echo "== $run rc=$?"; grep -E '"(construction_s|first_call_s|second_call_s|b1_ms_per_step|b64_ms_per_step)"' "$OUT/log_$run.txt"
done
timeout 240 paged-transformers bench --entry-points --model llama-3-8b --output-json "$OUT/entry_points.json" \
  2>&1 | grep -v Warning > "$OUT/entry_points.log"
echo "== bench rc=$?"; tail -16 "$OUT/entry_points.log"
gzip "$OUT"/spy_*.txt; (cd "$OUT" && tar czf logs.tgz log_*.txt && rm -f log_*.txt)
