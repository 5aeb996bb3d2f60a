#!/usr/bin/env bash
# Issue 23's first measurement on the tree of record: the workload of record (`paged-transformers bench --no-batch1`)
# for bf16, GPTQ and AWQ 4-bit g128 (random weights, Llama-3-8B shape) in one call, then a kernel-by-kernel profile
# of GPTQ decode steps at batch 1 and 256 with the default layers (research/profile_decode.py --compile off: the fused
# eager layers). About 9 min. One device-tool call from the repo root:  bash research/gpu_quantized.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-research/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2  # python3's pip: the image's `pip` is another Python's
for q in bf16 gptq awq; do
  flag=""; [ "$q" != bf16 ] && flag="--quantization $q"
  timeout 170 paged-transformers bench --model llama-3-8b --no-batch1 $flag --output-json "$OUT/workload_$q.json" \
    > "$OUT/log_bench_$q.txt" 2>&1
  echo "== bench $q rc=$?"; grep -E "^paged|GPU idle|KV:" "$OUT/log_bench_$q.txt"
done
timeout 120 python3 research/profile_decode.py --compile off --batches 1 256 --steps 5 --quantization gptq \
  --out "$OUT/profile_decode_gptq.json" > "$OUT/log_profile_gptq.txt" 2>&1
echo "== profile gptq rc=$?"; tail -30 "$OUT/log_profile_gptq.txt"
(cd "$OUT" && tar czf logs.tgz log_*.txt && rm -f log_*.txt)
