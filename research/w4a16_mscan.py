"""Issue 23: the W4A16 GEMM at every row count a decode batch may have, with the config ``default_config`` picks, next
to bf16 ``torch.matmul`` and, with ``--ab-dispatch FILE``, the config another copy of ``kernels/w4a16/dispatch.py``
picks (e.g. ``git show COMMIT:kernels/w4a16/dispatch.py``), on the engine's fused Llama-3-8B shapes (q|k|v 4096x6144,
o 4096x4096, gate|up 4096x28672, down 14336x4096). us per call on the CUDA-graph clock over weight sets of > 4x L2
(``benchmarks/bench_w4a16.py``). Each shape runs its M values twice, ascending then descending, so a clock that drifts
during the run shows as two columns that disagree. ``--pad`` also times this dispatch's config on x padded with zero
rows to a whole number of its row tiles, with and without the padding copy. ``--ab-kernel FILES`` also times this
dispatch's config with the kernel and TMA descriptors of each copy of ``kernels/w4a16/wgmma_kernels.py`` named
(``w4a16_wgmma.kernel_copies``).

    python research/w4a16_mscan.py --ab-dispatch research/dispatch_prev.py --out $OUT/mscan.json    # GPU (Hopper)
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_w4a16 import GROUP, graph_time_ms, rel_err, rotating_sets  # noqa: E402
from w4a16_wgmma import kernel_copies, load_module, swapped_in  # noqa: E402  (this folder, the script's sys.path[0])

from paged_transformers.kernels.w4a16 import W4A16Config, default_config, w4a16_matmul, w4a16_matmul_ref  # noqa: E402

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="17,32,48,64,80,96,112,128,144,160,176,192,208,224,240,256")
    ap.add_argument("--ab-dispatch", default=None, help="another dispatch.py whose default_config is timed too")
    ap.add_argument("--pad", action="store_true",
                    help="also time this dispatch's config on x padded with zero rows to a whole number of its tiles: "
                         "pre-padded ('padded') and padded in each call ('pad_copy', the copy timed too)")
    ap.add_argument("--ab-kernel", default=None,
                    help="comma-separated copies of wgmma_kernels.py: this dispatch's config also timed with each "
                         "one's kernel and descriptors ('k_<file name>')")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    other = load_module(args.ab_dispatch, "paged_transformers.kernels.w4a16._dispatch_ab") if args.ab_dispatch else None
    paths = args.ab_kernel.split(",") if args.ab_kernel else []
    names = {os.path.splitext(os.path.basename(path))[0]: path for path in paths}
    if len(names) < len(paths):
        raise SystemExit(f"--ab-kernel: two files of one name in {paths}")
    copies = kernel_copies(paths, dev)
    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    for K, N in SHAPES:
        _, n_q, n_b, qsets, bsets = rotating_sets(K, N, dev)
        for order in (ms, ms[::-1]):
            for M in order:
                xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(max(n_q, n_b))]
                row = dict(K=K, N=N, M=M, pass_="asc" if order is ms else "desc")
                row["bf16_us"] = graph_time_ms(lambda i: torch.matmul(xs[i % len(xs)], bsets[i % n_b])) * 1e3
                cfgs = {"new": default_config(M, N, K, GROUP, dev)}
                if other:
                    c = other.default_config(M, N, K, GROUP, dev)  # its classes are the copy's: rebuilt as ours
                    cfgs["prev"] = W4A16Config(c.block_m, c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages,
                                               c.algo.value)
                ref = w4a16_matmul_ref(xs[0].float(), *qsets[0], 4, GROUP)
                for name, cfg in cfgs.items():
                    fn = lambda i, cfg=cfg: w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, GROUP, config=cfg)
                    row[f"{name}_cfg"] = str(cfg)
                    row[f"{name}_rel_err"] = err = rel_err(fn(0), ref)
                    row[f"{name}_us"] = graph_time_ms(fn) * 1e3 if err < 1e-2 else float("nan")
                if args.pad:  # whether the rows of x's last tile past the batch are what costs (BENCHMARKS.md)
                    cfg, rows_past = cfgs["new"], -M % cfgs["new"].block_m
                    padded = [F.pad(x, (0, 0, 0, rows_past)) for x in xs]
                    variants = {"padded": lambda i: w4a16_matmul(padded[i % len(xs)], *qsets[i % n_q], 4, GROUP,
                                                                 config=cfg)[:M],
                                "pad_copy": lambda i: w4a16_matmul(F.pad(xs[i % len(xs)], (0, 0, 0, rows_past)),
                                                                   *qsets[i % n_q], 4, GROUP, config=cfg)[:M]}
                    for name, fn in variants.items():
                        row[f"{name}_rel_err"] = err = rel_err(fn(0), ref)
                        row[f"{name}_us"] = graph_time_ms(fn) * 1e3 if err < 1e-2 else float("nan")
                for name, path in names.items():
                    cfg = cfgs["new"]
                    fn = lambda i: w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, GROUP, config=cfg)
                    with swapped_in(copies, path, dev):
                        row[f"k_{name}_rel_err"] = err = rel_err(fn(0), ref)
                        row[f"k_{name}_us"] = graph_time_ms(fn) * 1e3 if err < 1e-2 else float("nan")
                rows.append(row)
        del qsets, bsets
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"{'K x N':>11} {'M':>4} {'bf16':>13} {'new':>13} {'x':>5} {'prev':>13} {'x':>5}  (us ascending / descending;"
          " x = bf16's mean / the mean)  new config [prev config]")
    for K, N in SHAPES:
        for M in ms:
            a, d = (next(r for r in rows if (r["K"], r["N"], r["M"], r["pass_"]) == (K, N, M, p))
                    for p in ("asc", "desc"))
            mean = {key: (a[key] + d[key]) / 2 for key in a if key.endswith("_us")}
            line = (f"{K:>5}x{N:<5} {M:4d} {a['bf16_us']:6.1f}/{d['bf16_us']:<6.1f} "
                    f"{a['new_us']:6.1f}/{d['new_us']:<6.1f} {mean['bf16_us'] / mean['new_us']:5.2f}")
            if other:
                line += f" {a['prev_us']:6.1f}/{d['prev_us']:<6.1f} {mean['bf16_us'] / mean['prev_us']:5.2f}"
            if args.pad:
                line += f" padded {mean['padded_us']:6.1f} pad+copy {mean['pad_copy_us']:6.1f}"
            for name in names:
                line += f" {name} {mean[f'k_{name}_us']:6.1f}"
            line += f"  {a['new_cfg']}" + (f" [{a['prev_cfg']}]" if other and a["prev_cfg"] != a["new_cfg"] else "")
            print(line, flush=True)


if __name__ == "__main__":
    main()
