#!/usr/bin/env bash
# Issue 23 in one device call (~7 min): the W4A16 CUDA tests (the WGMMA kernel against the reference; the fixtures'
# goldens when a copy of ../shared/fixtures' tiny models travels as .fixtures/, which is put in place first), then
# the workload of record (`paged-transformers bench`, with batch-1 decode) for bf16, GPTQ and AWQ, then the W4A16
# GEMM benchmark of record (`benchmarks/bench_w4a16.py --no-e2e`).
#   bash research/gpu_quantized.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-research/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2  # python3's pip: the image's `pip` is another Python's
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [ -d .fixtures ] && [ ! -d ../shared/fixtures ]; then mkdir -p ../shared && cp -r .fixtures ../shared/fixtures; fi
timeout 330 python3 -m pytest -q -rs tests/test_w4a16_wgmma.py tests/test_w4a16.py tests/test_quantization.py \
    -k "not smollm2" > "$OUT/log_pytest.txt" 2>&1
echo "== pytest rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/log_pytest.txt" | tail -12
bench() {  # name, then the command
  local name=$1; shift
  timeout 110 "$@" --output-json "$OUT/workload_$name.json" > "$OUT/log_bench_$name.txt" 2>&1
  echo "== bench $name rc=$? at ${SECONDS}s"; grep -E "^paged|GPU idle|KV:|batch-1|per token" "$OUT/log_bench_$name.txt"
}
bench bf16 paged-transformers bench --model llama-3-8b
bench gptq paged-transformers bench --model llama-3-8b --quantization gptq
bench awq paged-transformers bench --model llama-3-8b --quantization awq --no-batch1
timeout 150 python3 benchmarks/bench_w4a16.py --no-e2e --out "$OUT/w4a16.json" > "$OUT/log_w4a16.txt" 2>&1
echo "== bench_w4a16 rc=$? at ${SECONDS}s"; tail -25 "$OUT/log_w4a16.txt"
(cd "$OUT" && tar czf logs.tgz log_*.txt && rm -f log_*.txt)
