"""Issue 23: the host time of an eager ``W4A16Algo.WGMMA`` call, against the kernels ``default_config`` picks without it
(TC to 64 rows on wide/tall weights, DEQUANT_MATMUL above) and bf16 ``torch.matmul``: per shape and M, the median
wall time of a synchronized loop of eager calls (what an eager prefill step of 17-256 rows pays), and the part spent
building the four TMA descriptors.

    python research/wgmma_eager.py --out $OUT/wgmma_eager.json      # GPU (Hopper)
"""

import argparse
import json
import sys
import time

import torch

import paged_transformers.kernels.w4a16.dispatch as dispatch
from paged_transformers.kernels.w4a16 import default_config, w4a16_matmul


def per_call_us(fn, n=200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    from paged_transformers.kernels.w4a16 import wgmma_kernels as wk

    rows = []
    for K, N in ((4096, 6144), (4096, 28672), (14336, 4096)):
        G = K // 128
        q = torch.randint(-(2**31), 2**31, (K // 8, N), dtype=torch.int32, device=dev)
        s = ((0.5 + torch.rand(G, N, device=dev)) * 0.005).half()
        z = torch.randint(0, 16, (G, N), device=dev).to(torch.int16)
        w = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
        for M in (32, 128, 256):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            cfg = default_config(M, N, K, 128, dev)
            row = dict(K=K, N=N, M=M, config=str(cfg))
            row["wgmma_us"] = per_call_us(lambda: w4a16_matmul(x, q, s, z, 4, 128))
            row["descriptors_us"] = per_call_us(lambda: wk.descriptors(x, q, s, z, cfg.block_m, cfg.block_n, cfg.block_k))
            dispatch.has_gluon.cache_clear()
            real = dispatch.has_gluon
            dispatch.has_gluon = lambda: False
            try:
                row["without_config"] = str(default_config(M, N, K, 128, dev))
                row["without_us"] = per_call_us(lambda: w4a16_matmul(x, q, s, z, 4, 128))
            finally:
                dispatch.has_gluon = real
            row["bf16_us"] = per_call_us(lambda: x @ w)
            rows.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "argv": sys.argv, "rows": rows}, f, indent=1)
    print(f"{'K x N':>12} {'M':>4} {'WGMMA':>7} {'descs':>6} {'without':>8} {'bf16':>6}  eager us per call")
    for r in rows:
        print(f"{r['K']:>5}x{r['N']:<6} {r['M']:4d} {r['wgmma_us']:7.1f} {r['descriptors_us']:6.1f} "
              f"{r['without_us']:8.1f} {r['bf16_us']:6.1f}  {r['config']} / {r['without_config']}")


if __name__ == "__main__":
    main()
