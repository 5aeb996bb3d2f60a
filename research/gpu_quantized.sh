#!/usr/bin/env bash
# Issue 23 in device calls of < 10 min. Parts, run in the order given (default: tests workload w4a16):
#   tests     the W4A16 CUDA tests (the WGMMA kernel against the reference; the fixtures' goldens when a copy of
#             ../shared/fixtures' tiny models travels as .fixtures/, which is put in place first), ~4-5 min
#   workload  the workload of record (`paged-transformers bench`, with batch-1 decode) for $WORKLOADS (default bf16
#             gptq awq), $ROUNDS times (1; each run's files then end in _<round>), with the GPU's SM and memory
#             clocks, power and temperature alongside, ~40 s a run
#   profile   a decode step's kernels at 128 and 256 rows, bf16 then GPTQ (research/profile_decode.py), ~4 min
#   w4a16     the W4A16 GEMM benchmark of record (`benchmarks/bench_w4a16.py --no-e2e`), ~2 min
#   sweep     research/w4a16_wgmma.py at M = $MS (128,256) over $CANDS (its --cands) for $SWEEP_S seconds (220), each
#             config also with the kernel of each file of $AB (comma-separated) when set (its --ab), ~4 min
#   ncu       Nsight Compute on the WGMMA kernel (research/gpu_ncu_wgmma.sh), ~3 min
#   bash research/gpu_quantized.sh tests workload
set -o pipefail
PARTS="${*:-tests workload w4a16}"
for p in $PARTS; do case $p in tests|workload|profile|w4a16|sweep|ncu) ;; *) echo "unknown part $p"; exit 2 ;; esac; done
export PYTHONUNBUFFERED=1
OUT=${OUT:-research/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2  # python3's pip: the image's `pip` is another Python's
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
bench() {  # name, then the command; the GPU's SM and memory clocks (MHz), power (W) and temperature (C) every 0.5 s
  local name=$1; shift
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 500 \
      > "$OUT/log_smi_$name.txt" 2>&1 &
  local smi=$!
  timeout 110 "$@" --output-json "$OUT/workload_$name.json" > "$OUT/log_bench_$name.txt" 2>&1
  echo "== bench $name rc=$? at ${SECONDS}s"; kill $smi
  grep -E "^paged|GPU idle|KV:|CUDA graphs|batch-1|per token" "$OUT/log_bench_$name.txt"
  awk -F', *' '$1 ~ /^[0-9]/ {print $1, $2, $3, $4}' "$OUT/log_smi_$name.txt" | sort -n |
      awk '{c[NR] = $1; if (!m || $2 < m) m = $2; p += $3; if ($4 > t) t = $4}
      END {if (NR) printf "SM clock median %d MHz (min %d), memory clock min %d MHz, power mean %.0f W, temperature max %d C\n",
                   c[int((NR + 1) / 2)], c[1], m, p / NR, t}'
}
for p in $PARTS; do case $p in
tests)
  if [ -d .fixtures ] && [ ! -d ../shared/fixtures ]; then mkdir -p ../shared && cp -r .fixtures ../shared/fixtures; fi
  timeout 420 python3 -m pytest -q -rs tests/test_w4a16_wgmma.py tests/test_w4a16.py tests/test_quantization.py \
      -k "not smollm2" > "$OUT/log_pytest.txt" 2>&1
  echo "== pytest rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/log_pytest.txt" | tail -12 ;;
workload)
  for r in $(seq "${ROUNDS:-1}"); do for q in ${WORKLOADS:-bf16 gptq awq}; do
    n=$q; [ "${ROUNDS:-1}" -gt 1 ] && n=${q}_$r
    b1=""; [ "$r" -gt 1 ] && b1=--no-batch1  # batch-1 decode in the first round only
    case $q in
    bf16) bench $n paged-transformers bench --model llama-3-8b $b1 ;;
    gptq) bench $n paged-transformers bench --model llama-3-8b --quantization gptq $b1 ;;
    awq) bench $n paged-transformers bench --model llama-3-8b --quantization awq --no-batch1 ;;
  esac; done; done ;;
profile)
  for q in bf16 gptq; do
    a=""; [ $q = gptq ] && a="--quantization gptq"
    timeout 150 python3 research/profile_decode.py --compile off --batches 128 256 --steps 5 $a \
        --out "$OUT/profile_$q.json" > "$OUT/log_profile_$q.txt" 2>&1
    echo "== profile $q rc=$? at ${SECONDS}s"; grep -E "^batch|^prefill" "$OUT/log_profile_$q.txt"
  done ;;
w4a16)
  timeout 150 python3 benchmarks/bench_w4a16.py --no-e2e --out "$OUT/w4a16.json" > "$OUT/log_w4a16.txt" 2>&1
  echo "== bench_w4a16 rc=$? at ${SECONDS}s"; tail -25 "$OUT/log_w4a16.txt" ;;
sweep)
  timeout 280 python3 research/w4a16_wgmma.py --ms ${MS:-128,256} --budget-s ${SWEEP_S:-220} ${CANDS:+--cands "$CANDS"} ${AB:+--ab "$AB" --check-dtypes bf16} \
      --out "$OUT/w4a16_wgmma.json" > "$OUT/log_sweep.txt" 2>&1
  echo "== sweep rc=$? at ${SECONDS}s"; grep -A40 "^ *K x N" "$OUT/log_sweep.txt" ;;
ncu)
  bash research/gpu_ncu_wgmma.sh > "$OUT/log_ncu.txt" 2>&1; echo "== ncu rc=$? at ${SECONDS}s"; tail -40 "$OUT/log_ncu.txt" ;;
esac; done
(cd "$OUT" && tar czf logs.tgz log_*.txt && rm -f log_*.txt)
