#!/usr/bin/env bash
# The workload of record and batch-1 decode of two trees side by side in one device-tool call (issue 19's "within
# 3% of the tree before the change"): the tree before (a copy of its package in .oldtree, carried) and this tree,
# installed in turn, each run twice in the order old, new, old, new. From the repo root:
#   rm -rf .oldtree && mkdir .oldtree && git archive <commit> paged_transformers kernels patches pyproject.toml \
#     setup.py README.md | tar -x -C .oldtree      # then carry .oldtree
#   bash benchmarks/gpu_side_by_side.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
for round in 1 2; do
  for tree in old new; do
    dir=.; [ "$tree" = old ] && dir=.oldtree
    # the new tree picks its step limits by device: give it the old tree's fixed ones to compare like with like
    limits=(--max-num-seqs 256 --max-num-batched-tokens 8192 --max-cudagraph-capture-size 256); [ "$tree" = old ] && limits=()
    python3 -m pip install -q --no-build-isolation --no-deps -e "$dir" 2>&1 | tail -1
    timeout 170 paged-transformers bench --model llama-3-8b --num-requests 256 --input-len-range 64 1024 \
      --output-len-range 16 512 --seed 0 "${limits[@]}" --output-json "$OUT/side_${tree}_$round.json" > "$OUT/side_${tree}_$round.log" 2>&1
    echo "== $tree round $round rc=$?"; grep -E "^paged |batch-1 decode" "$OUT/side_${tree}_$round.log"
  done
done
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -1
