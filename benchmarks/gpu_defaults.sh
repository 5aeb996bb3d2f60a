#!/usr/bin/env bash
# The step limits picked by device (EngineConfig: vLLM's 1024 sequences / 16384 tokens / decode graphs up to 512 on a
# CUDA device of >= 70 GiB that is not an A100) against the earlier fixed values (256 / 8192 / 256, given explicitly),
# each pair in one process (the new defaults first, then the old values as a `--sweep` point: single sweep values
# make one point), Llama-3-8B shape, random weights, bf16:
#   a. the workload of record (BENCHMARKS.md: 256 requests, prompts U[64,1024], outputs U[16,512], seed 0; the paged
#      engine only, without its --compare stock engines), with batch-1 decode at context 512 for both;
#   b. 1,024 requests at once: prompts U[32,128], outputs U[128,256], EOS ignored (bench's synthetic workload);
#   c. batch 8: 8 requests of 512 prompt / 128 output tokens (its TPOT is the batch-8 step), with batch-1 decode;
#   d. `bench --entry-points` once (per-call ratios against stock), with the new defaults.
# Then a short table. Each stage has a time limit, all within the 9 minutes left by a 10-minute device call.
# Usage (repo root, CUDA, the package installed editable): bash benchmarks/gpu_defaults.sh; results in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"; rm -f "$OUT/stages.log"
python3 -c "import paged_transformers" 2>/dev/null || python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/nvidia_smi.txt"
OLD=(--sweep max_num_seqs=256 --sweep max_num_batched_tokens=8192 --sweep max_cudagraph_capture_size=256)
BENCH=(paged-transformers bench --model llama-3-8b --seed 0)
deadline=$((SECONDS + ${DEADLINE_S:-530}))  # DEADLINE_S: the seconds all stages may take; STAGES: which (a b c d)
stage() {  # stage NAME CAP_S COMMAND...: run with the smaller of its cap and the time left; log to $OUT/NAME.log
  local name=$1 cap=$2; shift 2
  case " ${STAGES:-a b c d} " in *" ${name%%_*} "*) ;; *) echo "$name: not run (STAGES)" | tee -a "$OUT/stages.log"; return;; esac
  local left=$((deadline - SECONDS)); [ "$left" -lt "$cap" ] && cap=$left
  [ "$cap" -gt 10 ] || { echo "$name: not run (no time left)" | tee -a "$OUT/stages.log"; return; }
  local t0=$SECONDS
  timeout "$cap" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0)) s (limit $cap s)" | tee -a "$OUT/stages.log"
}
stage a_record 130 "${BENCH[@]}" --num-requests 256 --input-len-range 64 1024 --output-len-range 16 512 "${OLD[@]}" \
  --output-json "$OUT/a_record.json"
stage b_concurrency 130 "${BENCH[@]}" --num-requests 1024 --input-len-range 32 128 --output-len-range 128 256 \
  --no-batch1 "${OLD[@]}" --output-json "$OUT/b_concurrency.json"
stage c_batch8 70 "${BENCH[@]}" --num-requests 8 --input-len-range 512 512 --output-len-range 128 128 "${OLD[@]}" \
  --output-json "$OUT/c_batch8.json"
stage d_entry_points 230 paged-transformers bench --entry-points --model llama-3-8b --output-json "$OUT/d_entry_points.json"
python3 - "$OUT" <<'EOF'
import json, os, sys

out = sys.argv[1]


def load(name):
    path = os.path.join(out, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else None


def limits(d):
    return "/".join(str(d[k]) for k in ("max_num_seqs", "max_num_batched_tokens", "max_cudagraph_capture_size"))


def ms(v):
    return f"{v * 1e3:.2f}" if v else "-"


print("\nworkload        limits new -> old        out tok/s new   old   new/old  TPOT p50 ms new / old  batch-1 ms new / old")
for name, label in (("a_record", "record 256"), ("b_concurrency", "1024 at once"), ("c_batch8", "batch 8")):
    r = load(name)
    paged = (r or {}).get("engines", {}).get("paged", {})
    sweep = (r or {}).get("sweep") or [{}]
    if "output_tokens_per_s" not in paged or "output_tokens_per_s" not in sweep[0]:
        print(f"{label:<15} missing: see {name}.log ({paged.get('error', 'no report')})")
        continue
    new, old = paged, sweep[0]
    b1_new = (r.get("decode_batch1") or {}).get("tpot_s_p50")
    print(f"{label:<15} {limits(new['engine_limits']):>14} -> {limits(old['engine_limits']):<12} "
          f"{new['output_tokens_per_s']:>9.0f} {old['output_tokens_per_s']:>7.0f} "
          f"{new['output_tokens_per_s'] / old['output_tokens_per_s']:>7.3f}x  "
          f"{ms(new['tpot_s']['p50']):>8} / {ms(old['tpot_s_p50']):<8}  {ms(b1_new):>8} / {ms(old['decode_batch1_s_p50'])}")
d = load("d_entry_points")
if d:
    print("\nentry points (new defaults), stock s / paged s / x stock")
    for g in d.get("generate", []) if isinstance(d.get("generate"), list) else []:
        print(f"  generate() batch {g['batch']} {g['prompt_len']}/{g['new_tokens']}: {g['stock_s']:.3f} / {g['patched_s']:.3f} / {g['speedup']:.2f}x")
    for key, paged_key in (("eval_loop", "paged_generate_s"), ("pipeline", "patched_s")):
        e = d.get(key) or {}
        if "speedup" in e:
            print(f"  {key}: {e['stock_s']:.3f} / {e[paged_key]:.3f} / {e['speedup']:.2f}x")
    w = d.get("workload") or {}
    if "held_engine_mean_tok_s" in w:
        print(f"  workload of record: held engine {w['held_engine_mean_tok_s']:.0f} tok/s, paged_generate "
              f"{w['paged_generate_later_mean_tok_s']:.0f} ({w['later_calls_over_held']:.3f}x)")
else:
    print("\nentry points: missing, see d_entry_points.log")
EOF
cat "$OUT/stages.log"
