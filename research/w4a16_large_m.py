"""Issue 23: can the tensor-core W4A16 kernel (``tc_kernels``) win at M = 64-256, where ``default_config`` runs
``DEQUANT_MATMUL`` (dequantize to a scratch bf16 weight, then cuBLAS) at 0.51-0.65x of bf16?

Round 6 timed the product TC kernel there with 64x128 and 128x128 tiles and lost (150.8 vs 85.3 us wide, 142.8 vs
90.6 tall at M = 256). Its per-program cost that grows with the x tile is the permutation of x into the weight's
fragment K order in registers (``_tc_kperm_x``: a shared-memory round trip of ``BLOCK_M x BLOCK_K`` per step, for
every one of the ``N / BLOCK_N`` programs). This script's kernel takes x already permuted (one ``torch`` copy per
call, ``x_tile_order``, timed as part of the call), so the x tile goes from HBM/L2 to shared memory by the
pipeliner's cp.async and into the wgmma untouched. Variant ``prescale``: the tile dequantized to ``(q - z) * s``
(one rounding, as the reference), the accumulator chained into the dot (no fp32 FMA over the
``[BLOCK_N, BLOCK_M]`` accumulator per step).

    python research/w4a16_large_m.py --out $OUT/w4a16_large_m.json        # GPU, ~3 min
    python research/w4a16_large_m.py --shapes engine --out $OUT/w4a16_large_m_engine.json   # the fused shapes
    TRITON_INTERPRET=1 python research/w4a16_large_m.py --check-only      # CPU: the kernel against the reference

Prints a table last: per (shape, M) bf16 matmul, the product default, and the best variant (us per call, CUDA-graph
clock over weight sets of > 4x L2, as ``benchmarks/bench_w4a16.py``).

NOTE (H200, 2026-12-02, ``benchmarks/results/w4a16_large_m_h200_2026-12-02.json``): 128x64x128 tiles on 4 warps, 3
stages, without prescale, won at M = 128 (41.0 vs 75.3 us on 4096x14336, 55.0 vs 79.8 on 14336x4096) and M = 256
(76.0 vs 85.8, 81.3 vs 91.8), where the x copy alone took 2.5-12.3 us. Put in the dispatch for M = 65-256 (wide, tall;
square to 128), the workload of record ran GPTQ at 3,787 output tok/s against 4,170 without it, in one call
(BENCHMARKS.md, issue 23), so the product keeps DEQUANT_MATMUL there. ``prescale`` 128x128x64 failed its check once at
4096x14336, M = 256 (a wrong result, not looked into).
"""

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

from paged_transformers.kernels.w4a16 import w4a16_matmul, w4a16_matmul_ref
from paged_transformers.kernels.w4a16.common_kernels import _split_k_tile, _write_tile
from paged_transformers.kernels.w4a16.tc_kernels import _tc_magic_value, _tc_unpack_asm, _tc_unpack_bits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))


@triton.jit
def _tc_large_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K, stride_xm, stride_om,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr, PRESCALE: tl.constexpr,
):  # fmt: skip
    """The product ``_w4a16_tc_kernel`` with x given in tile order (``x_tile_order``), no bias, ``K % BLOCK_K == 0``;
    ``PRESCALE``: ``w = (q - z) * s`` in ``x.dtype`` and ``acc = dot(w, x^T, acc)``."""
    BKP: tl.constexpr = BLOCK_K // 8
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid, it_start, it_end, offs_m, offs_n = _split_k_tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    offs_kp = tl.arange(0, BKP)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_x = tl.minimum(offs_m, M - 1)
    MAGIC: tl.constexpr = _tc_magic_value(DT)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for it in range(it_start, it_end):
        k0 = it * BLOCK_K
        kp = k0 // 8 + offs_kp
        p = tl.load(qw_ptr + kp[None, :] * N + offs_n[:, None], mask=mask_n[:, None], other=0)
        p = tl.reshape(p, (BLOCK_N, 4, BKP // 4))
        xt = tl.trans(tl.load(x_ptr + rows_x[:, None] * stride_xm + (k0 + offs_k)[None, :]))  # [BLOCK_K, BLOCK_M]
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)
        if USE_ASM:
            zb = (z + MAGIC).to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            zpair = tl.reshape(tl.broadcast_to((zb | (zb << 16))[:, None], (BLOCK_N, BKP)), (BLOCK_N, 4, BKP // 4))
            w = _tc_unpack_asm(p, zpair, DT)
        else:
            w = _tc_unpack_bits(p, DT) - (z + MAGIC).to(DT)[:, None]
        if PRESCALE:
            acc = tl.dot((w.to(tl.float32) * s[:, None]).to(DT), xt, acc)
        else:
            acc += s[:, None] * tl.dot(w, xt)
    _write_tile(tl.trans(acc), offs_m, offs_n, mask_m, mask_n, out_ptr, ws_ptr, lock_ptr, out_ptr, pid, N,
                stride_om, False, SPLIT_K)


def x_tile_order(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x ``[M, K]`` with the columns of each ``block_k`` step in the weight tile's K order (``_tc_kperm_x``: within a
    step, ``[c, t, u, h, e] -> [t, u, h, c, e]``), as one contiguous copy."""
    M, K = x.shape
    T = block_k // 32
    return x.view(M, K // block_k, 4, T, 2, 2, 2).permute(0, 1, 3, 4, 5, 2, 6).reshape(M, K)


_WS = {}


def tc_large(x, qweight, scales, zeros, group_size, block_m, block_n, block_k, split_k, num_warps, num_stages,
             prescale):
    """``x @ W`` through ``_tc_large_kernel`` (4-bit, K % block_k == 0), the x permutation included."""
    M, K = x.shape
    N = qweight.shape[1]
    xp = x_tile_order(x, block_k)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    num_tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if split_k > 1:
        key = x.device
        if key not in _WS or _WS[key][0].numel() < M * N or _WS[key][1].numel() < num_tiles:
            _WS[key] = (torch.zeros(max(M * N, 1 << 22), dtype=torch.float32, device=x.device),
                        torch.zeros(max(num_tiles, 1 << 14), dtype=torch.int32, device=x.device))
        ws, locks = _WS[key]
    else:
        ws, locks = out, out
    _tc_large_kernel[(num_tiles, split_k)](
        xp, qweight, scales, zeros, out, ws, locks, M, N, K, xp.stride(0), out.stride(0), GROUP_SIZE=group_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, USE_ASM=x.is_cuda, PRESCALE=prescale,
        num_warps=num_warps, num_stages=num_stages)
    return out


# (block_m, block_n, block_k, num_warps, num_stages, prescale); split-K is chosen to give >= 1 program per SM
CANDIDATES = [
    (64, 128, 128, 8, 3, False), (64, 128, 128, 8, 3, True),
    (128, 128, 64, 8, 3, False), (128, 128, 64, 8, 3, True), (128, 128, 128, 8, 2, False),
    (128, 128, 128, 8, 2, True), (128, 64, 128, 4, 3, False), (128, 64, 128, 4, 3, True),
    (256, 128, 64, 8, 2, True), (256, 64, 64, 4, 3, True),
]
CPU_CANDIDATES = [(16, 32, 64, 4, 1, False), (16, 32, 64, 4, 1, True), (32, 16, 128, 4, 1, True)]  # the interpreter


def split_for(M, N, K, block_m, block_n, block_k, sms=132):
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    return max(1, min(K // block_k, -(-sms // tiles)))


def check(device, shapes, ms) -> list[dict]:
    from bench_w4a16 import random_layer, rel_err

    rows = []
    for K, N in shapes:
        layer = random_layer(K, N, 4, 128, device)
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
            ref = w4a16_matmul_ref(x.float(), *layer, 4, 128)
            for bm, bn, bk, nw, ns, pre in CANDIDATES if device.type == "cuda" else CPU_CANDIDATES:
                split = split_for(M, N, K, bm, bn, bk)
                out = tc_large(x, *layer, 128, bm, bn, bk, split, nw, ns, pre)
                err = rel_err(out, ref)
                rows.append(dict(K=K, N=N, M=M, cfg=[bm, bn, bk, nw, ns, pre], split=split, rel_err=err))
                print(f"check K={K} N={N} M={M} {bm}x{bn}x{bk} w{nw} s{ns} pre={pre} split={split}: {err:.2e}",
                      flush=True)
                assert err < 1e-2, rows[-1]
    return rows


# (K, N) per --shapes: the Llama-3-8B layer's projections as the targets name them, or as the engine runs them
# (q|k|v and gate|up fused: compilation/fusion.py), the shapes of the end-to-end run where the variant lost
SHAPES = {"layer": [(4096, 4096), (4096, 14336), (14336, 4096)],
          "engine": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]}


def sweep(device, budget_s: float, shapes: str = "layer") -> list[dict]:
    from bench_w4a16 import graph_time_ms, rel_err, rotating_sets

    t_start = time.perf_counter()
    rows = []
    for K, N in SHAPES[shapes]:
        int4_bytes, n_q, n_b, qsets, bsets = rotating_sets(K, N, device)
        for M in (64, 128, 256):
            xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(max(n_q, n_b))]
            row = dict(K=K, N=N, M=M)
            row["bf16_us"] = graph_time_ms(lambda i: torch.matmul(xs[i % len(xs)], bsets[i % n_b])) * 1e3
            row["default_us"] = graph_time_ms(lambda i: w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, 128)) * 1e3
            row["xperm_us"] = graph_time_ms(lambda i: x_tile_order(xs[i % len(xs)], 128)) * 1e3
            row["variants"] = []
            ref = w4a16_matmul_ref(xs[0].float(), *qsets[0], 4, 128)
            for bm, bn, bk, nw, ns, pre in CANDIDATES:
                if time.perf_counter() - t_start > budget_s:
                    row["variants"].append(dict(cfg=[bm, bn, bk, nw, ns, pre], skipped="budget"))
                    continue
                split = split_for(M, N, K, bm, bn, bk)
                fn = lambda i, c=(bm, bn, bk, split, nw, ns, pre): tc_large(xs[i % len(xs)], *qsets[i % n_q], 128, *c)
                try:
                    err = rel_err(fn(0), ref)
                    assert err < 1e-2, f"rel_err {err:.3g}"
                    us = graph_time_ms(fn) * 1e3
                    row["variants"].append(dict(cfg=[bm, bn, bk, nw, ns, pre], split=split, us=us, rel_err=err))
                except Exception as e:  # noqa: BLE001 (record and go on: one call of device time)
                    row["variants"].append(dict(cfg=[bm, bn, bk, nw, ns, pre], split=split,
                                                error=f"{type(e).__name__}: {str(e)[:200]}"))
            ok = [v for v in row["variants"] if "us" in v]
            row["best"] = min(ok, key=lambda v: v["us"]) if ok else None
            rows.append(row)
            b = row["best"]
            print(f"K={K:5d} N={N:5d} M={M:3d} bf16 {row['bf16_us']:6.1f} default {row['default_us']:6.1f} "
                  f"xperm {row['xperm_us']:5.1f} best {b['us'] if b else float('nan'):6.1f} {b['cfg'] if b else ''} "
                  f"split {b['split'] if b else ''}", flush=True)
        del qsets, bsets
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="layer")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        check(device, [(256, 128)], [5, 33])
        return
    report = {"check": check(device, [(4096, 4096), (512, 640)], [70, 256])}
    if not args.check_only:
        report["sweep"] = sweep(device, args.budget_s, args.shapes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"{'K x N':>12} {'M':>4} {'bf16':>7} {'default':>8} {'best':>7} {'x bf16':>7}  best config")
    for r in report.get("sweep", []):
        b = r["best"]
        if b:
            print(f"{r['K']:>5}x{r['N']:<6} {r['M']:4d} {r['bf16_us']:7.1f} {r['default_us']:8.1f} {b['us']:7.1f} "
                  f"{r['bf16_us'] / b['us']:7.2f}  {b['cfg']} split {b['split']}")


if __name__ == "__main__":
    main()
