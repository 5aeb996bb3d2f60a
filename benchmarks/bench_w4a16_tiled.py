"""The tiled W4A16 GEMM (``kernels/w4a16_tiled.py``) on GPU: correctness at real sizes, then CUDA-graph timings of
its candidate configs vs bf16 ``torch.matmul`` vs the current ``w4a16_matmul`` dispatch (DEQUANT_MATMUL at M > 16,
the split-K DOT kernels at M = 16). About 2.5 minutes on an H200 (Triton compiles included).

Usage (GPU, repo root, package installed)::

    python3 benchmarks/bench_w4a16_tiled.py --out $OUT/w4a16_tiled_h200.json [--budget-s 150] [--quick]

1. Correctness: ``w4a16_tiled_matmul`` vs ``w4a16_matmul_ref`` (fp32 activations, exact fp32 weight) as
   ``||out - ref|| / ||ref||`` (ok below 1e-2): every candidate config on 4096x4096 group 128 at M = 256, and the
   default config on per-channel K = 4104 (not a multiple of BLOCK_K), group 32 + bias, 8-bit, fp16 activations,
   M = 17 / 1000 and N = 1000 (not multiples of the tile), and a CUDA-graph replay of a split-K call.
2. Timings: shapes ``K x N`` = 4096x4096, 4096x14336, 14336x4096, group 128, bf16, at M = 256, 1024, 64, 16 (in
   that order, so the target rows come first if ``--budget-s`` runs out): ``graph_us`` from
   ``bench_w4a16.graph_time_ms`` (a CUDA graph of 16 calls rotating over weight sets > 4x L2, replayed).
   Every config is checked against the reference before it is timed. x = bf16 time / candidate time.
"""

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_w4a16 import graph_time_ms, random_layer, rel_err
from paged_transformers.kernels import w4a16 as k
from paged_transformers.kernels import w4a16_tiled as t

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K, N)
MS = [256, 1024, 64, 16]
GROUP = 128
C = t.TiledConfig


def candidates(M: int, N: int, K: int, sms: int, quick: bool) -> list[C]:
    """The default and alternatives: tile shape, warps/stages, unpack variant, operand order, split-K."""

    def split(bm, bn, bk=64):
        tiles = -(-M // bm) * -(-N // bn)
        return max(1, min(-(-K // bk) // 4, sms // tiles))

    default = t.default_tiled_config(M, N, K, sms)
    if quick:
        return [default]
    if M <= 16:
        out = [C(16, 128, 64, 8, split(16, 128), 4, 4, unpack=2), C(16, 64, 128, 8, split(16, 64, 128), 4, 4, unpack=2),
               C(16, 128, 64, 8, split(16, 128), 4, 4, swap=True, unpack=2), C(64, 128, 64, 8, split(64, 128), 4, 4, unpack=2)]
    else:
        out = [C(128, 128, 64, 8, split(128, 128), 8, 3, unpack=2), C(128, 128, 64, 8, 1, 8, 3, unpack=2),
               C(128, 128, 64, 8, split(128, 128), 4, 4, unpack=2), C(64, 128, 64, 8, split(64, 128), 4, 4, unpack=2),
               C(128, 256, 64, 8, split(128, 256), 8, 3, unpack=2), C(256, 128, 64, 8, split(256, 128), 8, 3, unpack=2),
               C(128, 128, 128, 8, split(128, 128, 128), 8, 3, unpack=2),
               C(128, 128, 64, 8, split(128, 128), 8, 3, swap=True, unpack=2),
               C(128, 128, 64, 8, split(128, 128), 8, 3, unpack=1), C(128, 128, 64, 8, split(128, 128), 8, 3, unpack=0)]
        if M <= 64:
            out = [c for c in out if c.block_m <= 128]
    return list(dict.fromkeys([default] + out))


def check_correctness(device, configs: list[C]) -> list[dict]:
    rows = []

    def case(name, M, K, N, bits, group, dtype=torch.bfloat16, config=None, bias=False, layer=None):
        try:
            qweight, scales, zeros = layer or random_layer(K, N, bits, group, device)
            x = torch.randn(M, K, device=device, dtype=dtype)
            b = torch.randn(N, device=device, dtype=dtype) if bias else None
            out = t.w4a16_tiled_matmul(x, qweight, scales, zeros, bits, group, bias=b, config=config)
            err = rel_err(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, bits, group, bias=b))
            rows.append(dict(case=name, config=str(config or "default"), M=M, K=K, N=N, bits=bits, group=group,
                             dtype=str(dtype), rel_err=err, ok=err < 1e-2 and bool(torch.isfinite(out).all())))
        except Exception as e:  # noqa: BLE001 (record and go on: one call of device time)
            rows.append(dict(case=name, config=str(config or "default"), M=M, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))

    layer = random_layer(4096, 4096, 4, GROUP, device)
    for cfg in configs:
        case("4096x4096 g128", 256, 4096, 4096, 4, GROUP, config=cfg, layer=layer)
    for M in (17, 256, 1000):
        case("per-channel, K = 4104", M, 4104, 1000, 4, 4104)
        case("group 32, bias", M, 4096, 1000, 4, 32, bias=True)
        case("8-bit group 128", M, 4096, 1024, 8, 128)
        case("fp16 activations", M, 4096, 1024, 4, 128, dtype=torch.float16)
    case("split-K 4, per-channel K = 4104, bias", 200, 4104, 1000, 4, 4104, config=C(128, 128, 64, 8, 4, 8, 3, unpack=2), bias=True)
    case("swap, group 32, bias", 200, 4096, 1000, 4, 32, config=C(128, 128, 64, 8, 2, 8, 3, swap=True, unpack=2), bias=True)
    case("swap 8-bit", 200, 4096, 1024, 8, 128, config=C(128, 128, 64, 8, 1, 8, 3, swap=True, unpack=2))
    try:  # CUDA-graph capture + replay of a split-K call (the workspace and counters must reset themselves)
        qweight, scales, zeros = layer
        x = torch.randn(256, 4096, device=device, dtype=torch.bfloat16)
        cfg = C(128, 128, 64, 8, 2, 8, 3, unpack=2)
        t.w4a16_tiled_matmul(x, qweight, scales, zeros, 4, GROUP, config=cfg)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = t.w4a16_tiled_matmul(x, qweight, scales, zeros, 4, GROUP, config=cfg)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
        torch.cuda.synchronize()
        err = rel_err(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, GROUP))
        rows.append(dict(case="CUDA graph replay x3, split-K 2", config=str(cfg), M=256, rel_err=err, ok=err < 1e-2))
    except Exception as e:  # noqa: BLE001
        rows.append(dict(case="CUDA graph replay x3, split-K 2", M=256, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))
    ws, locks = k._WORKSPACE._buffers[device]
    rows.append(dict(case="split-K workspace left zeroed", ok=bool((ws == 0).all() and (locks == 0).all())))
    return rows


def time_gemms(device, quick: bool, budget_s: float, t_start: float) -> list[dict]:
    l2_bytes = 50 * 2**20
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    data = {}
    for K, N in SHAPES:
        int4_bytes = K * N // 2 + 2 * (K // GROUP) * N * 2
        n_q = max(2, math.ceil(4 * l2_bytes / int4_bytes))
        n_b = max(2, math.ceil(4 * l2_bytes / (K * N * 2)))
        data[K, N] = ([random_layer(K, N, 4, GROUP, device) for _ in range(n_q)],
                      [torch.randn(K, N, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(n_b)])
    for M in MS:
        for K, N in SHAPES:
            qsets, bsets = data[K, N]
            xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(max(len(qsets), len(bsets)))]
            bf16_us = graph_time_ms(lambda i, xs=xs, bsets=bsets: torch.matmul(xs[i % len(xs)], bsets[i % len(bsets)])) * 1e3
            current = k.default_config(M, N, K, GROUP, device)
            entries = [("current " + str(current), "current", None)]
            entries += [(str(c), "tiled", c) for c in candidates(M, N, K, sms, quick)]
            for label, kind, cfg in entries:
                if time.perf_counter() - t_start > budget_s:
                    rows.append(dict(K=K, N=N, M=M, config=label, skipped="budget"))
                    continue
                try:
                    if kind == "current":
                        def fn(i, xs=xs, qsets=qsets):
                            return k.w4a16_matmul(xs[i % len(xs)], *qsets[i % len(qsets)], 4, GROUP)
                    else:
                        def fn(i, cfg=cfg, xs=xs, qsets=qsets):
                            return t.w4a16_tiled_matmul(xs[i % len(xs)], *qsets[i % len(qsets)], 4, GROUP, config=cfg)
                    err = rel_err(fn(0), k.w4a16_matmul_ref(xs[0].float(), *qsets[0], 4, GROUP))
                    if not err < 1e-2:
                        raise AssertionError(f"rel_err {err:.3g}")
                    us = graph_time_ms(fn) * 1e3
                except Exception as e:  # noqa: BLE001 (record and go on)
                    rows.append(dict(K=K, N=N, M=M, config=label, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    print(f"  K={K} N={N} M={M} {label} FAILED {rows[-1]['error']}", flush=True)
                    continue
                rows.append(dict(K=K, N=N, M=M, config=label, kind=kind, graph_us=us, bf16_graph_us=bf16_us,
                                 speedup=bf16_us / us, rel_err=err, tflops=2 * M * N * K / us / 1e6))
                print(f"  K={K:5d} N={N:5d} M={M:4d} {label[:52]:52s} {us:8.1f} us  bf16 {bf16_us:7.1f}  x{bf16_us / us:5.2f}"
                      f"  ({time.perf_counter() - t_start:.0f}s)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--quick", action="store_true", help="default tiled config only")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop timing new configs after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_w4a16_tiled needs a CUDA GPU")
    import transformers
    import triton

    device = torch.device("cuda", torch.cuda.current_device())
    report = {
        "command": " ".join(["python3 benchmarks/bench_w4a16_tiled.py"] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "cuda": torch.version.cuda},
    }
    t_start = time.perf_counter()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    configs = list(dict.fromkeys(c for M in (256, 16) for c in candidates(M, 4096, 4096, sms, args.quick)))
    report["correctness"] = check_correctness(device, configs)
    bad = [r for r in report["correctness"] if not r["ok"]]
    print(f"correctness: {len(report['correctness']) - len(bad)}/{len(report['correctness'])} ok "
          f"({time.perf_counter() - t_start:.0f}s)", flush=True)
    for r in bad:
        print("  FAIL", r, flush=True)
    report["gemm"] = time_gemms(device, args.quick, args.budget_s, t_start)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    print("\nus per call, CUDA-graph clock; x = bf16 time / this time (target at M >= 17: x >= 0.8)")
    print(f"{'K x N':11s} {'M':>5s} {'bf16':>7s} {'current':>8s} {'x':>5s} {'tiled def':>9s} {'x':>5s} {'best tiled':>10s} {'x':>5s}  best config")
    for M in MS:
        for K, N in SHAPES:
            rows = [r for r in report["gemm"] if r["K"] == K and r["N"] == N and r["M"] == M and "graph_us" in r]
            cur = next((r for r in rows if r["kind"] == "current"), None)
            tiled = [r for r in rows if r["kind"] == "tiled"]
            if not tiled:
                continue
            d = tiled[0] if tiled[0]["config"] == str(t.default_tiled_config(M, N, K, sms)) else None
            b = min(tiled, key=lambda r: r["graph_us"])
            def fmt(r, w):
                return (f"{r['graph_us']:{w}.1f} {r['speedup']:5.2f}") if r else f"{'-':>{w}s} {'-':>5s}"
            print(f"{K:5d}x{N:<5d} {M:5d} {b['bf16_graph_us']:7.1f} {fmt(cur, 8)} {fmt(d, 9)} {fmt(b, 10)}  {b['config']}")
    print(f"correctness: {len(report['correctness']) - len(bad)}/{len(report['correctness'])} ok; "
          f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
