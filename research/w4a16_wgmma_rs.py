"""Issue 23: the register-operand W4A16 wgmma kernel (``research/wgmma_rs_kernels.py``, swap-AB, the weight as
wgmma's A operand in registers) against the product's ``W4A16Algo.WGMMA`` (weight through shared memory) and bf16
``torch.matmul``: checked against ``w4a16_matmul_ref``, then timed on the engine's Llama-3-8B shapes at M = 16-256
(us per call, CUDA-graph clock over weight sets of > 4x L2, as ``benchmarks/bench_w4a16.py``).

    python research/w4a16_wgmma_rs.py --out $OUT/w4a16_wgmma_rs.json      # GPU (Hopper)
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_w4a16 import graph_time_ms, random_layer, rel_err, rotating_sets  # noqa: E402
from w4a16_wgmma import splits_for  # noqa: E402
from wgmma_rs_kernels import _w4a16_wgmma_rs_kernel  # noqa: E402

from paged_transformers.kernels.w4a16 import default_config, w4a16_matmul, w4a16_matmul_ref  # noqa: E402
from paged_transformers.kernels.w4a16 import wgmma_kernels as wk  # noqa: E402
from paged_transformers.kernels.w4a16.matmul import _WORKSPACE  # noqa: E402

# (block_m, block_n, block_k, num_stages, num_warps): block_m is wgmma's N (x rows, a power of two), block_n its M
# (weight rows, 16 per warp, a multiple of 16 * num_warps)
CANDIDATES = {
    16: [(16, 64, 64, 4, 4), (16, 128, 64, 4, 8), (16, 64, 128, 4, 4), (16, 128, 128, 4, 8)],
    32: [(32, 64, 64, 4, 4), (32, 128, 64, 4, 4), (32, 128, 64, 4, 8), (32, 64, 128, 4, 4), (32, 128, 128, 4, 8)],
    64: [(64, 64, 64, 4, 4), (64, 128, 64, 4, 8), (64, 128, 64, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 3, 8)],
    128: [(128, 64, 64, 4, 4), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (128, 128, 128, 3, 8), (64, 128, 64, 4, 4)],
    192: [(256, 64, 64, 4, 4), (256, 128, 64, 4, 8), (128, 128, 64, 4, 8), (128, 64, 64, 4, 4)],
    256: [(256, 64, 64, 4, 4), (256, 128, 64, 4, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 64, 64, 4, 4)],
}


def rs_matmul(x, qweight, scales, zeros, group, cand, split, bias=None, paired=True):
    bm, bn, bk, stages, warps = cand
    M, K = x.shape
    N = qweight.shape[1]
    assert K % (bk * split) == 0 and (group % bk == 0 or group == K) and K // (bk * split) >= 2
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    num_tiles = -(-M // bm) * -(-N // bn)
    ws, locks = _WORKSPACE.get(x.device, M * N, num_tiles) if split > 1 else (out, out)
    descs = wk.descriptors(x, qweight, scales, zeros, bm, bn, bk)
    _w4a16_wgmma_rs_kernel[(num_tiles, split)](
        *descs, bias if bias is not None else out, out, ws, locks, M, N, K, out.stride(0), HAS_BIAS=bias is not None,
        GROUP_SIZE=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, SPLIT_K=split, num_warps=warps, PAIRED=paired)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--ms", default="256,128,64,192,32,16", help="the M to time, in this order")
    ap.add_argument("--serial", action="store_true", help="also the one-wgmma-in-flight loop (PAIRED=False)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(), "check": [], "sweep": []}
    K, N = 1024, 776  # correctness: N off the tile grid, split-K, bias, fp16 x and fp32 scales
    for M, cand, split, dt, sdt, bias in [
        (1, CANDIDATES[16][0], 1, torch.bfloat16, torch.float16, False),
        (70, CANDIDATES[128][1], 2, torch.bfloat16, torch.float16, True),
        (256, CANDIDATES[256][0], 1, torch.float16, torch.float16, True),
        (200, CANDIDATES[256][1], 4, torch.float16, torch.float32, False),
        (33, CANDIDATES[64][2], 1, torch.bfloat16, torch.bfloat16, False),
        (128, CANDIDATES[128][3], 1, torch.bfloat16, torch.float32, True),
        (40, CANDIDATES[64][3], 1, torch.bfloat16, torch.float16, False),  # K = 1152: an odd number of K steps
    ]:
        K = 1152 if M == 40 else 1024
        layer = random_layer(K, N, 4, 128, dev, scales_dtype=sdt)
        x = torch.randn(M, K, device=dev, dtype=dt)
        b = torch.randn(N, device=dev, dtype=dt) if bias else None
        row = dict(M=M, cand=cand, split=split, dtype=str(dt), scales=str(sdt), bias=bias)
        try:
            out = rs_matmul(x, *layer, 128, cand, split, bias=b)
            prod = w4a16_matmul(x, *layer, 4, 128, bias=b)
            row["rel_err"] = rel_err(out, w4a16_matmul_ref(x.float(), *layer, 4, 128, bias=b))
            row["max_abs_vs_product"] = float((out.float() - prod.float()).abs().max())
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        report["check"].append(row)
        print("check", row, flush=True)
    for K, N in [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]:
        t_start = time.perf_counter()
        int4_bytes, n_q, n_b, qsets, bsets = rotating_sets(K, N, dev)
        for M in [int(m) for m in args.ms.split(",")]:  # the workload's decode batches first
            xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(max(n_q, n_b))]
            row = dict(K=K, N=N, M=M, default=str(default_config(M, N, K, 128, dev)), variants=[])
            row["bf16_us"] = graph_time_ms(lambda i: torch.matmul(xs[i % len(xs)], bsets[i % n_b])) * 1e3
            row["default_us"] = graph_time_ms(lambda i: w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, 128)) * 1e3
            ref = w4a16_matmul_ref(xs[0].float(), *qsets[0], 4, 128)
            # the one-wgmma-in-flight loop (PAIRED=False) on the first candidate only
            todo = ([(CANDIDATES[M][0], False)] if args.serial else []) + [(c, True) for c in CANDIDATES[M]]
            for cand, paired in todo:
                if time.perf_counter() - t_start > args.budget_s / 4:
                    break
                for split in splits_for(M, N, K, *cand[:3]):
                    fn = lambda i, cand=cand, split=split, paired=paired: rs_matmul(
                        xs[i % len(xs)], *qsets[i % n_q], 128, cand, split, paired=paired)
                    v = dict(cand=cand, split=split, paired=paired)
                    try:
                        err = rel_err(fn(0), ref)
                        assert err < 1e-2, f"rel_err {err:.3g}"
                        row["variants"].append(v | dict(us=graph_time_ms(fn) * 1e3, rel_err=err))
                        print("  ", row["variants"][-1], flush=True)
                    except Exception as e:  # noqa: BLE001
                        row["variants"].append(v | dict(error=f"{type(e).__name__}: {str(e)[:200]}"))
            ok = [v for v in row["variants"] if "us" in v]
            row["best"] = min(ok, key=lambda v: v["us"]) if ok else None
            serial = [v for v in ok if not v["paired"]]
            row["serial_best_us"] = min(v["us"] for v in serial) if serial else None
            report["sweep"].append(row)
            print(K, N, M, f"bf16 {row['bf16_us']:.1f} product {row['default_us']:.1f} best rs", row["best"], flush=True)
            if args.out:  # after every row: a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
        del qsets, bsets
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"{'K x N':>12} {'M':>4} {'bf16':>7} {'product':>8} {'x bf16':>7} {'serial':>7} {'rs best':>8} {'x bf16':>7}  rs config")
    for r in report["sweep"]:
        b = r["best"] or {"us": float("nan"), "cand": "", "split": ""}
        print(f"{r['K']:>5}x{r['N']:<6} {r['M']:4d} {r['bf16_us']:7.1f} {r['default_us']:8.1f} "
              f"{r['bf16_us'] / r['default_us']:7.2f} {r['serial_best_us'] or float('nan'):7.1f} {b['us']:8.1f} {r['bf16_us'] / b['us']:7.2f}  {b['cand']} s{b['split']}")


if __name__ == "__main__":
    main()
