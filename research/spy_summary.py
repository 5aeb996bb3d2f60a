"""Bucket the main thread's py-spy samples of a start-up run (``research/gpu_startup_spy.sh``) by what they were doing.

    python research/spy_summary.py spy_cold.txt.gz [--under engine_for] [--rate 50]

Input: py-spy ``--format raw --threads --subprocesses --idle`` output (one collapsed stack and its sample count per
line). Each MainThread sample under a frame containing ``--under`` goes to the first bucket of ``BUCKETS`` whose marker
its stack contains (imports before Triton before Inductor before Dynamo: the innermost cause wins). Seconds are
samples / rate: py-spy ``--nonblocking`` drops samples when it falls behind (the H200 runs of 2026-12-02 counted 22 s of
a 34 s construction), so read the shares, not the sums.
"""

import argparse
import collections
import gzip

BUCKETS = [("python imports", "_find_and_load ("), ("Triton JIT (our kernels)", "JITFunction.run"),
           ("Inductor: loading compiled modules (waits for its Triton compiles)", "PyCodeCache.load_by_key_path"),
           ("Inductor: autotuning", "benchmark_all_configs"), ("Inductor: lowering and codegen", "compile_fx ("),
           ("Dynamo: tracing", "_compile.<locals>._compile_inner"), ("KV pool sizing", "profile_activation_bytes"),
           ("fusing projections", "fuse_projections"), ("CUDA graph capture", "DecodeGraphs.record"),
           ("eager forward", "ModelRunner._forward")]


def summarize(path: str, under: str) -> collections.Counter:
    """Samples per bucket (``"other"`` for the rest) of the main thread's stacks under ``under``."""
    counts = collections.Counter()
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        for line in f:
            stack, n = line.rstrip().rsplit(" ", 1)
            frames = stack.split(";")
            if len(frames) < 2 or "MainThread" not in frames[1] or under not in stack:
                continue
            counts[next((name for name, marker in BUCKETS if marker in stack), "other")] += int(n)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--under", default="engine_for", help="only stacks with a frame containing this")
    ap.add_argument("--rate", type=float, default=50, help="py-spy's --rate (samples per second)")
    args = ap.parse_args()
    counts = summarize(args.path, args.under)
    total = sum(counts.values())
    print(f"{args.path}: {total / args.rate:.1f} s of samples under {args.under}")
    for name, n in counts.most_common():
        print(f"{n / args.rate:7.2f} s {n / total:6.1%}  {name}")


if __name__ == "__main__":
    main()
