#!/usr/bin/env bash
# Issue 23 in one device call (~8 min): the Gluon W4A16 kernel checked and swept (research/w4a16_wgmma.py), then the
# workload of record (`paged-transformers bench --no-batch1`) for bf16, then GPTQ and AWQ each with the Gluon kernel
# where the sweep found it faster (research/w4a16_wgmma_e2e.py) and on the product's kernels, in that order.
#   bash research/gpu_quantized.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-research/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2  # python3's pip: the image's `pip` is another Python's
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 280 python3 research/w4a16_wgmma.py --out "$OUT/w4a16_wgmma.json" --budget-s 140 > "$OUT/log_wgmma.txt" 2>&1
echo "== wgmma sweep rc=$?"; grep -c "'rel_err'" "$OUT/log_wgmma.txt"; grep "error\|Error" "$OUT/log_wgmma.txt" | head -5
grep -A40 "K x N" "$OUT/log_wgmma.txt"
bench() {  # name, then the command
  local name=$1; shift
  timeout 150 "$@" --output-json "$OUT/workload_$name.json" > "$OUT/log_bench_$name.txt" 2>&1
  echo "== bench $name rc=$?"; grep -E "^paged|GPU idle|KV:|calls by path" "$OUT/log_bench_$name.txt"
}
bench bf16 paged-transformers bench --model llama-3-8b --no-batch1
bench gptq_wgmma python3 research/w4a16_wgmma_e2e.py --table "$OUT/w4a16_wgmma.json" -- bench --model llama-3-8b --no-batch1 --quantization gptq
bench gptq paged-transformers bench --model llama-3-8b --no-batch1 --quantization gptq
bench awq_wgmma python3 research/w4a16_wgmma_e2e.py --table "$OUT/w4a16_wgmma.json" -- bench --model llama-3-8b --no-batch1 --quantization awq
bench awq paged-transformers bench --model llama-3-8b --no-batch1 --quantization awq
(cd "$OUT" && tar czf logs.tgz log_*.txt && rm -f log_*.txt)
