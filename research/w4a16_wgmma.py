"""Issue 23: the sweep that chooses the ``W4A16Algo.WGMMA`` candidates of the tuning tables (``kernels/w4a16/configs``;
``--table-out``), formerly the rows of ``kernels/w4a16/dispatch.RULES``: launch configs of
the product's Gluon kernel (``kernels/w4a16/wgmma_kernels.py``) checked against ``w4a16_matmul_ref``, then timed on
the shapes the engine runs (Llama-3-8B q|k|v 4096x6144, o 4096x4096, gate|up 4096x28672, down 14336x4096) at M =
16-256, next to bf16 ``torch.matmul`` and the config ``default_config`` picks (us per call, CUDA-graph clock over
weight sets of > 4x L2, as ``benchmarks/bench_w4a16.py``). Each (shape, M) row gets an equal share of
``--budget-s``, its configs tried in the order below (the first always).

    python research/w4a16_wgmma.py --out $OUT/w4a16_wgmma.json            # GPU (Hopper)
    python research/w4a16_wgmma.py --quick --out ...                      # 5 configs, gate|up and down, M = 64-256
    # the dispatch's table for this GPU: each swept (shape, M)'s fastest config first (research/w4a16_tables.py)
    python research/w4a16_wgmma.py --out $OUT/w4a16_wgmma.json --table-out $OUT/TABLE.json \
        --table-base kernels/w4a16/configs/NVIDIA_H100_80GB_HBM3.json

Its history (BENCHMARKS.md, issue 23, 2026-12-06): the first kernel stored each dequantized weight tile to shared
memory (cp.async copies, then TMA; Nsight Compute found 4-way bank conflicts on those stores and I2F on the zero
points, both fixed); it is in git at commit 1771266. A ``FAST`` variant of it, the fp16 scale rounded to bf16 and one
``mul.bf16x2`` per pair (two roundings), was 2-19% faster on gate|up and down; the product keeps one rounding, as
``w4a16_matmul_ref`` (commit 305a187). The kernel that replaced it, the weight as wgmma's register operand, was
first written and compared in ``research/wgmma_rs_kernels.py`` / ``research/w4a16_wgmma_rs.py`` (commit 2e5ed42); its
producer warp in ``research/wgmma_ws_kernels.py`` (commit 0c825c4).
"""

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_w4a16 import graph_time_ms, random_layer, rel_err, rotating_sets  # noqa: E402

from paged_transformers.kernels.w4a16 import W4A16Algo, W4A16Config, default_config, w4a16_matmul, w4a16_matmul_ref  # noqa: E402
from paged_transformers.kernels.w4a16.dispatch import wgmma_consumers  # noqa: E402
from paged_transformers.kernels.w4a16.tables import Table  # noqa: E402
from w4a16_tables import dumps, from_sweep, versions  # noqa: E402

# (block_m, block_n, block_k, num_stages, num_warps): the winners of the H100 sweep of 2026-12-06 (third session) first;
# block_m is wgmma's N (a power of two), block_n its M (16 rows per warp)
QUICK = [(256, 128, 64, 4, 8), (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 128, 4, 4)]
# 256-row weight tiles on 8 warps (untimed): a quarter of the x tile reads from L2 that 64-row tiles make
CANDIDATES = QUICK + [(256, 64, 64, 4, 4), (64, 64, 64, 4, 4), (32, 128, 64, 4, 4), (32, 64, 128, 4, 4),
                      (128, 128, 64, 4, 8), (64, 128, 64, 4, 8), (128, 256, 64, 3, 8), (64, 256, 64, 4, 8)]


def splits_for(M, N, K, cand, sms=132):
    """Split-K counts to try for candidate ``cand``: the powers of two from 1 up to the first that gives at least two
    programs per SM (at most 8, dividing ``K // bk`` into slices of a multiple of ``2 * consumers`` K steps, so at
    least 2 a consumer warpgroup)."""
    bm, bn, bk = cand[:3]
    consumers = wgmma_consumers(config(cand, 1))
    tiles = -(-M // bm) * -(-N // bn)
    out = [1]
    while tiles * out[-1] < 2 * sms and out[-1] < 8 and (K // bk) % (out[-1] * 4 * consumers) == 0:
        out.append(out[-1] * 2)
    return out


def load_module(path: str, name: str):
    """The file ``path`` as the module ``name`` (a name inside the package resolves its relative imports there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kernel_copies(paths: list[str], device: torch.device) -> dict:
    """The launch parts of each copy of ``kernels/w4a16/wgmma_kernels.py`` at ``paths`` (e.g. ``git show
    COMMIT:kernels/w4a16/wgmma_kernels.py``), and the product's under ``None``: ``{path: (kernel, descriptors,
    maxnreg)}`` for ``swapped_in``. Each copy keeps its own TMA descriptors, whose boxes are the ones its kernel
    copies, and its own ``maxnreg(config)`` where it defines one; a copy without a producer warp launches as it did,
    without ``maxnreg``."""
    from paged_transformers.kernels._launch import load_triton_kernels
    from paged_transformers.kernels.w4a16 import matmul as matmul_mod

    mod = load_triton_kernels("w4a16.wgmma_kernels", device)
    copies = {None: (mod._w4a16_wgmma_kernel, mod.descriptors, matmul_mod.wgmma_maxnreg)}
    for i, path in enumerate(paths):
        other = load_module(path, f"wgmma_kernels_ab{i}")
        with open(path) as f:
            ws = "warp_specialize" in f.read()
        kernel = other._w4a16_wgmma_kernel
        if "CONSUMERS" not in kernel.arg_names:  # a copy from before two consumers: one consumer always
            kernel = _WithoutConsumers(kernel)
        copies[path] = (kernel, other.descriptors,
                        getattr(other, "maxnreg", None) or (matmul_mod.wgmma_maxnreg if ws else lambda cfg: None))
    return copies


class _WithoutConsumers:
    """A kernel copy without the ``CONSUMERS`` argument, launched as ``w4a16_matmul`` launches the product's (which
    passes ``CONSUMERS`` = 1 for every config such a copy ran)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, CONSUMERS, **kwargs):
            assert CONSUMERS == 1, "a copy from before two consumers runs one"
            return launch(*args, **kwargs)

        return run


@contextlib.contextmanager
def swapped_in(copies: dict, path: str, device: torch.device):
    """Inside the block, ``w4a16_matmul``'s WGMMA launches use copy ``path`` of ``kernel_copies``; the product's after."""
    from paged_transformers.kernels._launch import load_triton_kernels
    from paged_transformers.kernels.w4a16 import matmul as matmul_mod

    mod = load_triton_kernels("w4a16.wgmma_kernels", device)
    mod._w4a16_wgmma_kernel, mod.descriptors, matmul_mod.wgmma_maxnreg = copies[path]
    try:
        yield
    finally:
        mod._w4a16_wgmma_kernel, mod.descriptors, matmul_mod.wgmma_maxnreg = copies[None]


def config(cand, split):
    bm, bn, bk, stages, warps = cand
    return W4A16Config(bm, bn, bk, split, warps, stages, W4A16Algo.WGMMA)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--quick", action="store_true", help="5 configs on gate|up and down at M = 64, 128, 256")
    ap.add_argument("--ms", default=None, help="comma-separated M values to time (default: by --quick)")
    ap.add_argument("--cands", default=None,
                    help="configs to try instead of the lists above: 'bm,bn,bk,stages,warps' separated by ';'")
    ap.add_argument("--shapes", default=None, help="comma-separated KxN weight shapes to time (default: by --quick)")
    ap.add_argument("--splits", default=None, help="comma-separated split-K counts to try (default: splits_for's)")
    ap.add_argument("--check-dtypes", default="bf16,fp16", help="x dtypes of the correctness check (bf16, fp16)")
    ap.add_argument("--table-out", default=None, help="write the dispatch's table for this GPU here (from-sweep)")
    ap.add_argument("--table-base", default=None, help="the table whose other candidates --table-out keeps")
    ap.add_argument("--ab", default=None,
                    help="comma-separated copies of wgmma_kernels.py (e.g. `git show COMMIT:kernels/w4a16/"
                         "wgmma_kernels.py`; one without a producer warp launches without maxnreg, as it did): "
                         "every variant is also timed with each one's kernel, in the same process ('ab')")
    args = ap.parse_args()
    dev = torch.device("cuda")
    copies = kernel_copies(args.ab.split(","), dev) if args.ab else None
    cands = QUICK if args.quick else CANDIDATES
    if args.cands:
        cands = [tuple(int(v) for v in c.split(",")) for c in args.cands.split(";") if c.strip()]
    report = {"device": torch.cuda.get_device_name(), "num_sms": torch.cuda.get_device_properties(dev).multi_processor_count,
              "versions": versions(), "check": [], "sweep": []}
    K, N = 1024, 768  # correctness first, off the M grid, with split-K; fp16 x too
    layer = random_layer(K, N, 4, 128, dev)
    for M in (1, 70, 256):
        for dt in [{"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in args.check_dtypes.split(",")]:
            x = torch.randn(M, K, device=dev, dtype=dt)
            ref = w4a16_matmul_ref(x.float(), *layer, 4, 128)
            for cand in cands:
                for split in splits_for(M, N, K, cand):
                    row = dict(M=M, dtype=str(dt), cfg=str(config(cand, split)))
                    try:
                        row["rel_err"] = rel_err(w4a16_matmul(x, *layer, 4, 128, config=config(cand, split)), ref)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    report["check"].append(row)
    bad = [r for r in report["check"] if r.get("rel_err", 1.0) > 1e-2]
    print(f"check: {len(report['check'])} cases, {len(bad)} over 1e-2: {bad[:3]}", flush=True)
    shapes = [(4096, 28672), (14336, 4096)] if args.quick else [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")] if args.ms else (64, 128, 256) if args.quick else (16, 32, 64, 128, 192, 256)
    for K, N in shapes:
        int4_bytes, n_q, n_b, qsets, bsets = rotating_sets(K, N, dev)
        for M in ms:
            t_start = time.perf_counter()  # each (shape, M) row an equal share of the budget
            xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(max(n_q, n_b))]
            row = dict(K=K, N=N, M=M, default=str(default_config(M, N, K, 128, dev)), variants=[])
            row["bf16_us"] = graph_time_ms(lambda i: torch.matmul(xs[i % len(xs)], bsets[i % n_b])) * 1e3
            row["default_us"] = graph_time_ms(lambda i: w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, 128)) * 1e3
            ref = w4a16_matmul_ref(xs[0].float(), *qsets[0], 4, 128)
            for n, cand in enumerate(cands):
                if n and time.perf_counter() - t_start > args.budget_s / (len(shapes) * len(ms)):
                    break  # (the first config always runs)
                for split in [int(v) for v in args.splits.split(",")] if args.splits else splits_for(M, N, K, cand):
                    cfg = config(cand, split)
                    fn = lambda i, cfg=cfg: w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, 128, config=cfg)
                    try:
                        err = rel_err(fn(0), ref)
                        assert err < 1e-2, f"rel_err {err:.3g}"
                        v = dict(cfg=str(cfg), us=graph_time_ms(fn) * 1e3, rel_err=err)
                        for path in args.ab.split(",") if copies else []:
                            ab = v.setdefault("ab", {}).setdefault(path, {})
                            try:
                                with swapped_in(copies, path, dev):
                                    ab["rel_err"] = rel_err(fn(0), ref)
                                    assert ab["rel_err"] < 1e-2, f"rel_err {ab['rel_err']:.3g}"
                                    ab["us"] = graph_time_ms(fn) * 1e3
                            except Exception as e:  # noqa: BLE001
                                ab["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        row["variants"].append(v)
                    except Exception as e:  # noqa: BLE001
                        row["variants"].append(dict(cfg=str(cfg), error=f"{type(e).__name__}: {str(e)[:200]}"))
            ok = [v for v in row["variants"] if "us" in v]
            row["best"] = min(ok, key=lambda v: v["us"]) if ok else None
            report["sweep"].append(row)
            print(K, N, M, f"bf16 {row['bf16_us']:.1f} default {row['default_us']:.1f} ({row['default']}) best",
                  row["best"], flush=True)
            for v in ok if copies else []:
                others = ", ".join(f"{os.path.basename(p)} {a.get('us', float('nan')):7.1f}" for p, a in v["ab"].items())
                print(f"    {v['cfg']:<32} {v['us']:7.1f} us; {others}", flush=True)
            if args.out:  # after every row: a call cut at its time limit keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
        del qsets, bsets
        torch.cuda.empty_cache()
    print(f"{'K x N':>12} {'M':>4} {'bf16':>7} {'default':>8} {'x bf16':>7} {'best':>7} {'x bf16':>7}  default / best config")
    for r in report["sweep"]:
        b = r["best"] or {"us": float("nan"), "cfg": ""}
        print(f"{r['K']:>5}x{r['N']:<6} {r['M']:4d} {r['bf16_us']:7.1f} {r['default_us']:8.1f} "
              f"{r['bf16_us'] / r['default_us']:7.2f} {b['us']:7.1f} {r['bf16_us'] / b['us']:7.2f}  {r['default']} / {b['cfg']}")
    if args.table_out:
        base = Table.from_json(json.load(open(args.table_base)))
        header = {**base.header, "num_sms": report["num_sms"], "versions": report["versions"],
                  "measured_on": f"{report['device']} (research/w4a16_wgmma.py; the rest as in {args.table_base})",
                  "generated_by": "research/w4a16_wgmma.py --table-out"}
        with open(args.table_out, "w") as f:
            f.write(dumps(Table(report["device"], from_sweep(report, base), header)))
        print(f"table: {args.table_out}")


if __name__ == "__main__":
    main()
