"""The batch-1 GEMV (``kernels.gemv``) against cuBLAS on the Llama-3-8B projections (GPU).

Usage (GPU)::

    python research/bench_gemv.py --out $OUT/gemv_h200.json      # about 1 minute

For each projection of a Llama-3-8B layer as the engine runs it (q|k|v and gate|up fused) and the LM head,
``x [1, K] @ W[N, K]^T`` in bf16: first every candidate config (``CANDIDATES``) and the default are checked
against ``gemv_ref`` (fp32 product; also with a bias, and fp16), then timed on the CUDA-graph clock (16 calls
captured in one graph, replayed; the calls rotate over weight sets totalling >= 4x the 50 MB L2, so each
reads its weight from HBM, as decode does) next to ``torch.nn.functional.linear`` (cuBLAS, what the compiled
layers ran before). Reported: microseconds per call, the weight's bytes per second, and per decode token of
the 32-layer model, the projections' time with cuBLAS, the default GEMV and the best config per shape.
"""

import argparse
import datetime
import json
import math
import pathlib
import platform
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_w4a16 import graph_time_ms  # noqa: E402 (the same CUDA-graph clock)

from paged_transformers.kernels.gemv import DEFAULT_GEMV_CONFIG, WIDE_GEMV_CONFIG, GemvConfig, gemv, gemv_ref

# (name, N, K, launches per decode token of the 32-layer model)
SHAPES = [("q|k|v", 6144, 4096, 32), ("o", 4096, 4096, 32), ("gate|up", 28672, 4096, 32), ("down", 4096, 14336, 32),
          ("lm_head", 128256, 4096, 1)]
CANDIDATES = [GemvConfig(bn, bk, w) for bn, bk, w in (
    (2, 1024, 4), (4, 512, 4), (4, 1024, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (16, 256, 4),
    (16, 512, 4), (16, 512, 8), (4, 512, 2), (8, 512, 2), (32, 256, 8))]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |out - ref| over max |ref|."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def check(cfg: GemvConfig | None, N: int, K: int, dev) -> float:
    """Worst relative error of ``gemv`` vs ``gemv_ref`` for bf16 (with and without bias) and fp16."""
    g = torch.Generator(device=dev).manual_seed(N + K)
    worst = 0.0
    for dtype, with_bias in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)):
        w = torch.randn(N, K, device=dev, generator=g).to(dtype) * 0.02
        x = torch.randn(1, K, device=dev, generator=g).to(dtype)
        b = torch.randn(N, device=dev, generator=g).to(dtype) if with_bias else None
        worst = max(worst, rel_err(gemv(x, w, b, cfg), gemv_ref(x, w, b)))
    return worst


def graph_time_us(fn) -> float:
    """Device time per call (us) of ``fn(i)``: ``benchmarks/bench_w4a16.graph_time_ms`` (16 calls captured in one CUDA graph,
    replayed 20 times)."""
    return graph_time_ms(fn) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA GPU")
    import transformers
    import triton

    dev = torch.device("cuda")
    report = {"command": "python research/bench_gemv.py", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(dev),
              "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version(), "cuda": torch.version.cuda},
              "default": f"{DEFAULT_GEMV_CONFIG}; {WIDE_GEMV_CONFIG} from N = 16384", "rows": []}
    for name, N, K, per_token in SHAPES:
        nbytes = N * K * 2
        sets = max(1, math.ceil(4 * 50e6 / nbytes))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(sets)]
        xs = [torch.randn(1, K, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
        cublas = graph_time_us(lambda i: torch.nn.functional.linear(xs[i % sets], ws[i % sets]))
        report["rows"].append(dict(proj=name, N=N, K=K, config="cublas", us=cublas, TBps=nbytes / cublas / 1e6, per_token=per_token))
        print(f"{name:8s} {N:6d}x{K:<5d} cublas {cublas:8.1f} us {nbytes / cublas / 1e6:5.2f} TB/s", flush=True)
        for cfg in [None] + CANDIDATES:
            label = "default" if cfg is None else str(cfg)
            try:
                err = check(cfg, N, K, dev)
                if not err < 2**-7:
                    raise AssertionError(f"rel_err {err:.3g}")
                us = graph_time_us(lambda i, cfg=cfg: gemv(xs[i % sets], ws[i % sets], config=cfg))
            except Exception as e:  # noqa: BLE001 (record and go on: one call of device time)
                report["rows"].append(dict(proj=name, N=N, K=K, config=label, error=f"{type(e).__name__}: {str(e)[:300]}"))
                print(f"  {label:22s} FAILED {report['rows'][-1]['error']}", flush=True)
                continue
            report["rows"].append(dict(proj=name, N=N, K=K, config=label, us=us, TBps=nbytes / us / 1e6, rel_err=err,
                                       per_token=per_token, vs_cublas=cublas / us))
            print(f"  {label:22s} {us:8.1f} us {nbytes / us / 1e6:5.2f} TB/s x{cublas / us:4.2f} err {err:.1e}", flush=True)
        ws = xs = None  # free before the next shape
        torch.cuda.empty_cache()

    rows = [r for r in report["rows"] if "us" in r]
    totals = {}
    for label in ("cublas", "default"):
        totals[label] = sum(r["us"] * r["per_token"] for r in rows if r["config"] == label)
    best = {}
    for name, *_ in SHAPES:
        b = min((r for r in rows if r["proj"] == name and r["config"] not in ("cublas",)), key=lambda r: r["us"], default=None)
        best[name] = b
    totals["best per shape"] = sum(b["us"] * b["per_token"] for b in best.values() if b)
    report["per_token_us"] = totals
    report["best"] = {k: (v["config"] if v else None) for k, v in best.items()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"\n{'proj':8s} {'cublas us':>10s} {'default us':>10s} {'TB/s':>5s} {'best us':>8s} {'TB/s':>5s} best config")
    for name, N, K, _ in SHAPES:
        c = next(r for r in rows if r["proj"] == name and r["config"] == "cublas")
        d = next((r for r in rows if r["proj"] == name and r["config"] == "default"), None)
        b = best[name]
        print(f"{name:8s} {c['us']:10.1f} {d['us'] if d else float('nan'):10.1f} {d['TBps'] if d else float('nan'):5.2f} "
              f"{b['us']:8.1f} {b['TBps']:5.2f} {b['config']}")
    print("per decode token (32 layers + LM head), us: " + ", ".join(f"{k} {v:.0f}" for k, v in totals.items()))
    failed = [r for r in report["rows"] if "error" in r]
    print(f"failed: {len(failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
