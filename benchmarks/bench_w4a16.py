"""W4A16 GEMM on GPU: correctness at real sizes, timings vs bf16 ``torch.matmul``, and batch-1 decode of a
Llama-3-8B-shaped GPTQ model vs bf16 through the paged engine. About 3 minutes on an H200.

Usage (GPU)::

    python benchmarks/bench_w4a16.py --out benchmarks/results/w4a16_h200_round2.json
    python benchmarks/bench_w4a16.py --variants gemv --out benchmarks/results/w4a16_h200_round4_gemv.json  # M = 1 only
    python benchmarks/bench_w4a16.py --variants tc --out benchmarks/results/w4a16_h200_round5_tc.json  # M = 1, 4, 16
    python benchmarks/bench_w4a16.py --variants tc2 --out benchmarks/results/w4a16_h200_round7_tc2.json  # M = 4-256
    python benchmarks/bench_w4a16.py --variants r7 --out benchmarks/results/w4a16_h200_round7.json  # M = 1
    python benchmarks/bench_w4a16.py --variants r8 --out benchmarks/results/w4a16_h200_round8_gemv.json  # M = 1
    python benchmarks/bench_w4a16.py --variants floor --out benchmarks/results/w4a16_h200_round8_floor.json  # M = 1
    python benchmarks/bench_w4a16.py --sass  # no GPU: SASS instructions per weight of the DOT / TC kernels (sm_90)

1. Correctness: ``w4a16_matmul`` vs ``w4a16_matmul_ref`` (both from ``paged_transformers.kernels.w4a16``)
   as ``||out - ref|| / ||ref||`` on fresh random data, for the Llama-3-8B layer shapes at every M and
   every algo off the tile grid (per-channel K = 4104, group 32 + bias, 8-bit, fp16), act-order and AWQ
   through ``QuantLinear``, the custom op under ``torch.compile(fullgraph=True)``, and a CUDA-graph
   capture + replay of the default split-K path.
2. GEMM timings, shapes ``K x N`` = 4096x4096, 4096x14336, 14336x4096 at M = 1, 4, 16, 64, 256, group 128,
   bf16: the default config and a few alternatives per (shape, M), each checked against the reference
   first. Two clocks: ``graph_us``, device time per call from replaying a CUDA graph of 16 calls that
   rotate over weight sets totalling > 4x L2 (what decode sees: the engine replays graphs), and
   ``eager_us``, ``triton.testing.do_bench``'s median per eager call (includes any launch cost the GPU
   waits for: round 1 measured only this, and its bimodal 15/55 us GEMV results are suspected to be it).
3. End to end: ``run_paged`` (``paged_transformers.bench``) on a Llama-3-8B-shaped model with random
   weights, bf16 and GPTQ 4-bit g128, compiled layers and CUDA graphs (the engine defaults): 4 requests,
   then one request alone, 512-token prompt, 64 decode steps: median wall and device time per step.
"""

import argparse
import datetime
import json
import math
import platform
import time

import torch

from paged_transformers.kernels import w4a16 as k

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K, N) = (in_features, out_features)
MS = [1, 4, 16, 64, 256]
GROUP = 128
# targets of issue 7: speedup over bf16 at M in {1, 4, 16}; at M = 256 at least 0.8x
TARGET_SMALL_M = {(4096, 4096): 2.5, (4096, 14336): 3.0, (14336, 4096): 3.0}

A = k.W4A16Algo


def sweep_configs(M: int, N: int, K: int, sms: int, device: torch.device) -> list[tuple[str, k.W4A16Config]]:
    """A few alternatives to the default per (M, N, K): the round-1 runners-up and, at M = 1, the round-3 GEMV
    runners-up (narrower tiles, more programs per SM, the hand prefetch) and the tensor-core path."""

    def split(bm, bn, bk, per_sm=4):
        return k.split_k_for(-(-M // bm) * -(-N // bn), -(-K // bk), sms, per_sm)

    out = []
    if M == 1:
        for bn, bk, w, pf, per_sm in ((512, 32, 4, False, 4), (1024, 32, 8, False, 4), (512, 64, 4, True, 4)):
            out.append(k.W4A16Config(1, bn, bk, split(1, bn, bk, per_sm), w, 1, A.GEMV, prefetch=pf))
        out.append(k.W4A16Config(16, 64, 128, split(16, 64, 128), 4, 3, A.DOT))
    elif M <= 64:
        bm = 16 if M <= 16 else 64
        for algo in (A.DOT, A.DOT_SWAP):
            for bn in (64, 128):
                out.append(k.W4A16Config(bm, bn, 128, split(bm, bn, 128), 4, 3, algo))
        if M == 64:
            out.append(k.W4A16Config(128, 128, 128, 1, 4, 3, A.DEQUANT_MATMUL))
    else:
        out.append(k.W4A16Config(16, 64, 256, 1, 4, 3, A.DEQUANT_MATMUL))
        out.append(k.W4A16Config(128, 128, 128, 1, 8, 3, A.DOT_SWAP))
    default = k.default_config(M, N, K, GROUP, device)
    return [(str(c), c) for c in dict.fromkeys(out) if c != default]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def random_layer(K: int, N: int, bits: int, group: int, device, scales_dtype=torch.float16):
    pack = 32 // bits
    G = K // group
    qweight = torch.randint(-(2**31), 2**31, (K // pack, N), dtype=torch.int32, device=device)
    scales = ((0.5 + torch.rand(G, N, device=device)) * 0.005).to(scales_dtype)
    zeros = torch.randint(0, (1 << bits) + 1, (G, N), device=device).to(torch.int16)
    return qweight, scales, zeros


def check_correctness(device) -> list[dict]:
    """Kernel vs reference on fresh random data; returns one record per case."""
    rows = []

    def case(*args, **kwargs):
        try:
            _case(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (record and go on: one call of device time)
            rows.append(dict(case=args[0], M=args[1], ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))

    def _case(name, M, K, N, bits, group, dtype=torch.bfloat16, config=None, bias=False, layer=None):
        qweight, scales, zeros = layer or random_layer(K, N, bits, group, device)
        x = torch.randn(M, K, device=device, dtype=dtype)
        b = torch.randn(N, device=device, dtype=dtype) if bias else None
        out = k.w4a16_matmul(x, qweight, scales, zeros, bits, group, bias=b, config=config)
        ref = k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, bits, group, bias=b)  # fp32 weight, fp32 matmul
        err = rel_err(out, ref)
        rows.append(dict(case=name, M=M, K=K, N=N, bits=bits, group=group, dtype=str(dtype), rel_err=err,
                         ok=err < 1e-2 and bool(torch.isfinite(out).all())))

    for K, N in SHAPES:
        for M in MS:
            case("llama3-8b", M, K, N, 4, GROUP)
    case("per-channel, K % BLOCK_K != 0", 16, 4104, 1024, 4, 4104)
    case("per-channel, K % BLOCK_K != 0, M=1", 1, 4104, 1024, 4, 4104)
    case("group 32, bias", 7, 4096, 1000, 4, 32, bias=True)
    case("8-bit group 128", 4, 4096, 4096, 8, 128)
    case("8-bit group 128 M=256", 256, 4096, 4096, 8, 128)
    case("fp16 activations", 16, 4096, 4096, 4, 128, dtype=torch.float16)
    case("fp16 activations M=256", 256, 4096, 4096, 4, 128, dtype=torch.float16)
    # every algo off the tile grid: per-channel K = 4104, group 32 with bias, 8-bit, fp16
    for cfg in (k.W4A16Config(1, 1024, 32, 4, 8, 1, A.GEMV), k.W4A16Config(1, 512, 64, 33, 4, 1, A.GEMV, prefetch=True),
                k.W4A16Config(16, 64, 128, 4, algo=A.DOT), k.W4A16Config(16, 64, 128, 4, algo=A.DOT_SWAP),
                k.W4A16Config(128, 128, 128, 1, 8, algo=A.DOT), k.W4A16Config(64, 128, 128, 1, 4, algo=A.DOT_SWAP),
                k.W4A16Config(16, 128, 128, 1, algo=A.DEQUANT_MATMUL)):
        M = 1 if cfg.algo == A.GEMV else 3 if cfg.block_m == 16 else 200
        case(f"{cfg} per-channel K=4104", M, 4104, 1000, 4, 4104, config=cfg)
        case(f"{cfg} group 32, bias", M, 4096, 1000, 4, 32, config=cfg, bias=True)
        case(f"{cfg} fp16", M, 4096, 1024, 4, 128, dtype=torch.float16, config=cfg)
        cfg8 = k.W4A16Config(cfg.block_m, cfg.block_n, 64, cfg.split_k, cfg.num_warps, cfg.num_stages, cfg.algo, cfg.prefetch)
        case(f"{cfg8} 8-bit", M, 4096, 1024, 8, 128, config=cfg8)
    # CUDA-graph capture of the default (split-K) path, as QuantLinear runs inside captured decode graphs
    try:
        qweight, scales, zeros = random_layer(4096, 4096, 4, 128, device)
        x = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            k.w4a16_matmul(x, qweight, scales, zeros, 4, 128)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = k.w4a16_matmul(x, qweight, scales, zeros, 4, 128)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        err = rel_err(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 128))
        rows.append(dict(case="CUDA graph replay, default config M=1", M=1, rel_err=err, ok=err < 1e-2))
    except Exception as e:  # noqa: BLE001
        rows.append(dict(case="CUDA graph replay, default config M=1", M=1, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))
    # the custom op inside torch.compile: one opaque node (fullgraph=True fails on a graph break)
    try:
        qweight, scales, zeros = random_layer(4096, 4096, 4, 128, device)
        x = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
        torch._dynamo.reset()
        fn = torch.compile(lambda x: torch.nn.functional.silu(k.w4a16_matmul_op(x, qweight, scales, zeros, 4, 128)), fullgraph=True)
        err = rel_err(fn(x), torch.nn.functional.silu(k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 128)))
        rows.append(dict(case="custom op in torch.compile(fullgraph=True)", M=1, rel_err=err, ok=err < 1e-2))
    except Exception as e:  # noqa: BLE001
        rows.append(dict(case="custom op in torch.compile(fullgraph=True)", M=1, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))
    # act-order and AWQ through the converters, then through QuantLinear (the gather + kernel)
    from paged_transformers.quantization import QuantLinear, awq_to_kernel_layout, gptq_to_kernel_layout
    from paged_transformers.quantization.formats import AWQ_ORDER  # noqa: F401 (documents the layout)

    for method in ("gptq-actorder", "awq"):
        K, N, G = 4096, 4096, 128
        if method == "awq":
            packed = awq_to_kernel_layout(
                torch.randint(-(2**31), 2**31, (K, N // 8), dtype=torch.int32, device=device),
                torch.randint(-(2**31), 2**31, (K // G, N // 8), dtype=torch.int32, device=device),
                ((0.5 + torch.rand(K // G, N, device=device)) * 0.005).half(), G)
        else:
            g_idx = (torch.arange(K, device=device) // G)[torch.randperm(K, device=device)].int()
            packed = gptq_to_kernel_layout(
                torch.randint(-(2**31), 2**31, (K // 8, N), dtype=torch.int32, device=device),
                torch.randint(-(2**31), 2**31, (K // G, N // 8), dtype=torch.int32, device=device),
                ((0.5 + torch.rand(K // G, N, device=device)) * 0.005).half(), g_idx, 4, G)
        lin = QuantLinear(K, N, 4, G, bias=False, act_order=packed.perm is not None, dtype=torch.bfloat16, device=device)
        lin.load_packed(packed, method)
        for M in (1, 64):
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            out = lin(x)
            ref = x.float() @ lin.dequantize().t()
            err = rel_err(out, ref)
            rows.append(dict(case=f"QuantLinear {method}", M=M, K=K, N=N, bits=4, group=G, dtype="bf16", rel_err=err, ok=err < 1e-2))
    ws, locks = k._WORKSPACE._buffers[device]
    rows.append(dict(case="split-K workspace left zeroed", ok=bool((ws == 0).all() and (locks == 0).all())))
    return rows


def graph_time_ms(fn, num_calls: int = 16, replays: int = 20) -> float:
    """Device time per call (ms): ``fn(i)`` for i < ``num_calls`` captured in one CUDA graph, replayed
    ``replays`` times between CUDA events (no host launch cost; L2 is not flushed, but the calls rotate
    over weight sets totalling > 4x L2)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (replays * num_calls)


def rotating_sets(K: int, N: int, device, l2_bytes: int = 50 * 2**20):
    """Weight sets for the graph clock, enough of each to total >= 4x the L2 (50 MB on H100/H200), so every
    timed call reads its weight from HBM as decode does: ``(int4_bytes, n_q, n_b, qsets, bsets)`` with
    ``qsets`` W4A16 layers (group ``GROUP``) and ``bsets`` bf16 ``[K, N]`` weights."""
    int4_bytes = K * N // 2 + 2 * (K // GROUP) * N * 2
    n_q = max(2, math.ceil(4 * l2_bytes / int4_bytes))
    n_b = max(2, math.ceil(4 * l2_bytes / (K * N * 2)))
    qsets = [random_layer(K, N, 4, GROUP, device) for _ in range(n_q)]
    bsets = [torch.randn(K, N, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(n_b)]
    return int4_bytes, n_q, n_b, qsets, bsets


def time_gemms(device, quick: bool) -> list[dict]:
    """Per (shape, M): bf16 matmul and W4A16 (default config + alternatives), graph and eager clocks (us)."""
    import triton

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for K, N in SHAPES:
        int4_bytes, n_q, n_b, qsets, bsets = rotating_sets(K, N, device)
        for M in MS:
            xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(max(n_q, n_b))]
            it = {"i": 0}

            def eager(fn):
                def call():
                    it["i"] += 1
                    return fn(it["i"])
                return triton.testing.do_bench(call, warmup=10, rep=30, return_mode="median")

            def bf16_fn(i):
                return torch.matmul(xs[i % len(xs)], bsets[i % n_b])

            bf16 = dict(graph_us=graph_time_ms(bf16_fn) * 1e3, eager_us=eager(bf16_fn) * 1e3)
            configs = [("default", None)] + ([] if quick else sweep_configs(M, N, K, sms, device))
            for label, cfg in configs:
                q0 = qsets[0]
                used = cfg or k.default_config(M, N, K, GROUP, device)
                try:
                    out = k.w4a16_matmul(xs[0], *q0, 4, GROUP, config=cfg)
                    err = rel_err(out, k.w4a16_matmul_ref(xs[0].float(), *q0, 4, GROUP))
                    if not err < 1e-2:
                        raise AssertionError(f"rel_err {err:.3g}")

                    def q_fn(i, cfg=cfg):
                        return k.w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, GROUP, config=cfg)

                    g_us, e_us = graph_time_ms(q_fn) * 1e3, eager(q_fn) * 1e3
                except Exception as e:  # noqa: BLE001 (record and go on: one call of device time)
                    rows.append(dict(K=K, N=N, M=M, config=label, used=str(used), error=f"{type(e).__name__}: {str(e)[:300]}"))
                    print("  config failed", label, rows[-1]["error"], flush=True)
                    continue
                rows.append(dict(K=K, N=N, M=M, config=label, used=str(used), graph_us=g_us, eager_us=e_us,
                                 bf16_graph_us=bf16["graph_us"], bf16_eager_us=bf16["eager_us"], speedup=bf16["graph_us"] / g_us,
                                 rel_err=err, int4_bytes_floor_us=int4_bytes / 4.2e6))
                print(f"  K={K:5d} N={N:5d} M={M:3d} {label[:34]:34s} {str(used)[:34]:34s} graph {g_us:7.1f} us (bf16 {bf16['graph_us']:6.1f}, "
                      f"x{bf16['graph_us'] / g_us:4.2f})  eager {e_us:7.1f} us (bf16 {bf16['eager_us']:6.1f})", flush=True)
    return rows


def gemv_candidates(N: int, K: int, sms: int) -> list[k.W4A16Config]:
    """M = 1 candidates (``W4A16Algo.GEMV``), round 4: mostly ``biased_fma`` (no FADD per weight; T = 12: 4 shifts per
    int32 word, T = 15: 5 shifts, smaller bias), with a whole group per step (``BLOCK_K = 128``: 16 packed rows, 16
    16-byte loads per thread in flight) or 32/64, 4 columns per thread (``BLOCK_N = 128 * num_warps``) or 8 (256 *),
    2-4 programs per SM, the hand prefetch; plus the round-3 runners-up without it."""
    out = []
    for bn, bk, w, per_sm, pf, bfma in ((1024, 32, 8, 2, False, 12), (1024, 64, 8, 2, False, 12),
                                        (1024, 128, 8, 2, False, 12), (1024, 128, 8, 4, False, 12),
                                        (512, 128, 4, 4, False, 12), (2048, 64, 8, 2, False, 12),
                                        (2048, 32, 8, 2, False, 12), (1024, 128, 8, 2, True, 12),
                                        (1024, 64, 8, 2, False, 15), (2048, 64, 8, 2, False, 15),
                                        (512, 32, 4, 4, False, 0), (1024, 32, 8, 4, False, 0)):
        split = k.split_k_for(-(-N // bn), -(-K // bk), sms, per_sm)
        out.append(k.W4A16Config(1, bn, bk, split, w, 1, k.W4A16Algo.GEMV, prefetch=pf, biased_fma=bfma))
    return out


def time_gemv_variants(device) -> list[dict]:
    """``--variants gemv``: at M = 1 on the three shapes, bf16 matmul, the default config and every
    ``gemv_candidates`` config, each checked against ``w4a16_matmul_ref`` (fresh data, also with a bias and with
    K = 4104 per-channel; ``biased_fma`` ones also with fp16 x and groups of 32, and 8-bit, on the first shape)
    before it is timed on the graph clock."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for K, N in SHAPES:
        int4_bytes, n_q, n_b, qsets, bsets = rotating_sets(K, N, device)
        xs = [torch.randn(1, K, device=device, dtype=torch.bfloat16) for _ in range(max(n_q, n_b))]
        bf16_us = graph_time_ms(lambda i: torch.matmul(xs[i % len(xs)], bsets[i % n_b])) * 1e3
        default = k.default_config(1, N, K, GROUP, device)
        for cfg in [None] + [c for c in gemv_candidates(N, K, sms) if c != default]:
            used = str(cfg or default)
            label = "default" if cfg is None else used
            try:
                bias = torch.randn(N, device=device, dtype=torch.bfloat16)
                out = k.w4a16_matmul(xs[0], *qsets[0], 4, GROUP, bias=bias, config=cfg)
                err = rel_err(out, k.w4a16_matmul_ref(xs[0].float(), *qsets[0], 4, GROUP, bias=bias))
                if cfg is not None:  # off the tile grid: per-channel, K = 4104
                    q2 = random_layer(4104, 1000, 4, 4104, device)
                    x2 = torch.randn(1, 4104, device=device, dtype=torch.bfloat16)
                    err = max(err, rel_err(k.w4a16_matmul(x2, *q2, 4, 4104, config=cfg), k.w4a16_matmul_ref(x2.float(), *q2, 4, 4104)))
                if cfg is not None and cfg.biased_fma and (K, N) == SHAPES[0]:  # fp16 with groups of 32, and 8-bit
                    q3 = random_layer(4096, 1000, 4, 32, device)
                    x3 = torch.randn(1, 4096, device=device, dtype=torch.float16)
                    err = max(err, rel_err(k.w4a16_matmul(x3, *q3, 4, 32, config=cfg), k.w4a16_matmul_ref(x3.float(), *q3, 4, 32)))
                    q4 = random_layer(4096, 1024, 8, 128, device)
                    err = max(err, rel_err(k.w4a16_matmul(x3, *q4, 8, 128, config=cfg), k.w4a16_matmul_ref(x3.float(), *q4, 8, 128)))
                if not err < 1e-2:
                    raise AssertionError(f"rel_err {err:.3g}")
                g_us = graph_time_ms(lambda i, cfg=cfg: k.w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, GROUP, config=cfg)) * 1e3
            except Exception as e:  # noqa: BLE001 (record and go on: one call of device time)
                rows.append(dict(K=K, N=N, M=1, config=label, used=used, error=f"{type(e).__name__}: {str(e)[:300]}"))
                print("  config failed", label, rows[-1]["error"], flush=True)
                continue
            rows.append(dict(K=K, N=N, M=1, config=label, used=used, graph_us=g_us, bf16_graph_us=bf16_us,
                             speedup=bf16_us / g_us, rel_err=err, int4_tb_s=int4_bytes / g_us / 1e6))
            print(f"  K={K:5d} N={N:5d} {used[:44]:44s} {g_us:7.1f} us  x{bf16_us / g_us:4.2f}  {int4_bytes / g_us / 1e6:4.2f} TB/s  err {err:.1e}", flush=True)
    ws, locks = k._WORKSPACE._buffers[device]
    rows.append(dict(case="split-K workspace left zeroed", ok=bool((ws == 0).all() and (locks == 0).all())))
    return rows


def tc_candidates(M: int, N: int, K: int, sms: int) -> list[k.W4A16Config]:
    """``--variants tc`` candidates (issue 7, round 5 second pass): ``TC_ASM`` with ``tc_perm`` (SASS: 4.2
    instructions per weight in the loop at 16x128x128, no shared-memory round trip of the unpacked weights), 16
    rows for every M (the first pass's 8-row wgmma ran 2-6x slower than 16 rows at M = 1 and 4), around its best
    first-pass config 16x64x128 / 4 programs per SM / 3 stages / 4 warps: 32-column tiles, 2 and 8 programs per SM,
    2 and 4 stages, 2 and 8 warps. M = 1 keeps the GEMV (7.0 / 13.5 / 13.9 us against 9.6 / 21.9 / 20.7 here)."""
    if M == 1:
        return []
    out = []
    for bn, per_sm, stages, warps in ((64, 4, 3, 4), (64, 2, 3, 4), (64, 8, 3, 4), (64, 4, 2, 4), (64, 4, 4, 4),
                                      (64, 4, 3, 2), (32, 4, 3, 4), (32, 8, 3, 4), (32, 8, 3, 2), (128, 4, 3, 8)):
        split = k.split_k_for(-(-M // 16) * -(-N // bn), -(-K // 128), sms, per_sm)
        out.append(k.W4A16Config(16, bn, 128, split, warps, stages, k.W4A16Algo.TC_ASM, tc_perm=True))
    return out


def time_tc_variants(device, report: dict, out_path: str | None) -> list[dict]:
    """``--variants tc`` (round 5): ``time_variants`` at M = 1, 4, 16 over ``tc_candidates``, ``report["tc"]``."""
    return time_variants(device, report, out_path, "tc", (1, 4, 16), tc_candidates)


TC2_MS = [4, 16, 32, 64, 256]  # --variants tc2: M = 1 is the GEMV's (every TC config lost to it in round 6)


def tc2_candidates(M: int, N: int, K: int, sms: int) -> list[k.W4A16Config]:
    """``--variants tc2`` candidates (issue 7, round 7), all ``TC_ASM`` + ``tc_perm`` unless said otherwise. Round 6's
    latency options (``prefetch``, ``tc_x_index``, ``tc_prescale``) lost everywhere and were removed
    (``_tc_kernel_fn``'s NOTE); what is left:

    * M = 4, 16: round 5's default (16x64x128, 4 per SM, 3 stages, 4 warps) against 128 columns, 4 stages, 8 per
      SM, and 2 per SM with 2 stages (the tile / stage / split choices round 6 timed only with the options on);
    * M = 32 (the wide 17-64 rule is an extrapolation from M = 64): DEQUANT_MATMUL 128x128 and TC_ASM 64x128x128
      split 1 on 8 warps, whichever is not the default;
    * M = 64, 256: DEQUANT_MATMUL and TC_ASM 64x128x128 on 8 warps, 3 stages, split 1, plus 128x128x128 at M = 256
      (at M = 64 it lost to 64x128 on every shape in round 6: half its rows are padding). 64x128 won only on the wide
      shape at M = 64, where it has 112 programs; square and tall have 32. The next experiment: the same tiles with
      split-K so that the grid has >= 1 and >= 2 programs per SM (>= 132 and >= 264 on the H200: splits 5 and 9 for
      the 32 tiles of square and tall at M = 64, 2 and 3 for wide at M = 64), wherever that split is > 1."""
    A = k.W4A16Algo.TC_ASM
    k_iters = -(-K // 128)
    if M <= 16:
        out = []
        for bn, per_sm, stages in ((64, 4, 3), (128, 4, 3), (64, 4, 4), (64, 8, 3), (64, 2, 2)):
            split = k.split_k_for(-(-N // bn), k_iters, sms, per_sm)
            out.append(k.W4A16Config(16, bn, 128, split, 4, stages, A, tc_perm=True))
        return out
    out = [k.W4A16Config(128, 128, 128, 1, 4, 3, k.W4A16Algo.DEQUANT_MATMUL)]
    tiles = (64, 128) if M > 64 else (64,)
    out += [k.W4A16Config(bm, 128, 128, 1, 8, 3, A, tc_perm=True) for bm in tiles]
    if M > 32:
        for bm in tiles:
            for per_sm in (1, 2):
                split = k.split_k_for(-(-M // bm) * -(-N // 128), k_iters, sms, per_sm)
                if split > 1:
                    out.append(k.W4A16Config(bm, 128, 128, split, 8, 3, A, tc_perm=True))
    return list(dict.fromkeys(out))


def time_tc2_variants(device, report: dict, out_path: str | None, budget_s: float = 150.0) -> list[dict]:
    """``--variants tc2`` (issue 7, round 7): ``time_variants`` at M in ``TC2_MS`` over ``tc2_candidates``, with a
    ``budget_s`` time budget, ``report["tc2"]``."""
    return time_variants(device, report, out_path, "tc2", TC2_MS, tc2_candidates, budget_s)


def time_variants(device, report: dict, out_path: str | None, key: str, ms, candidates,
                  budget_s: float = float("inf"), shapes=SHAPES) -> list[dict]:
    """At each M of ``ms`` on ``shapes``: bf16 matmul, the default config and every ``candidates(M, N, K, sms)``
    config, each checked against ``w4a16_matmul_ref`` on the timed layer (and on ``_off_grid_errors``' cases: for
    the first TC config of each (tile, split-K or not), and for every GEMV candidate) before it is timed on the
    graph clock.
    Configs left when ``budget_s`` seconds have passed are recorded as skipped; ``report[key]`` (the rows so far) is
    written to ``out_path`` after each shape, in case the run is cut short. ``shapes``: ``(K, N)`` pairs."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = report[key] = []
    t0 = time.perf_counter()
    checked = set()
    for K, N in shapes:
        int4_bytes, n_q, n_b, qsets, bsets = rotating_sets(K, N, device)
        for M in ms:
            xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(max(n_q, n_b))]
            bf16_us = graph_time_ms(lambda i: torch.matmul(xs[i % len(xs)], bsets[i % n_b])) * 1e3
            default = k.default_config(M, N, K, GROUP, device)
            for cfg in [None] + [c for c in candidates(M, N, K, sms) if c != default]:
                used = str(cfg or default)
                label = "default" if cfg is None else used
                if cfg is not None and time.perf_counter() - t0 > budget_s:
                    rows.append(dict(K=K, N=N, M=M, config=label, used=used, skipped=f"time budget {budget_s:.0f} s"))
                    continue
                try:
                    out = k.w4a16_matmul(xs[0], *qsets[0], 4, GROUP, config=cfg)
                    err = rel_err(out, k.w4a16_matmul_ref(xs[0].float(), *qsets[0], 4, GROUP))
                    c = cfg or default
                    key = (c.algo, c.block_m, c.block_n, c.split_k > 1)
                    if c.algo in (k.W4A16Algo.TC, k.W4A16Algo.TC_ASM) and key not in checked:
                        checked.add(key)
                        err = max([err] + _off_grid_errors(c, M, device))
                    elif c.algo == k.W4A16Algo.GEMV and cfg is not None:
                        err = max([err] + _off_grid_errors(c, M, device))
                    if not err < 1e-2:
                        raise AssertionError(f"rel_err {err:.3g}")
                    g_us = graph_time_ms(lambda i, cfg=cfg: k.w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, GROUP, config=cfg)) * 1e3
                except Exception as e:  # noqa: BLE001 (record and go on: one call of device time)
                    rows.append(dict(K=K, N=N, M=M, config=label, used=used, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    print("  config failed", label, rows[-1]["error"], flush=True)
                    continue
                rows.append(dict(K=K, N=N, M=M, config=label, used=used, graph_us=g_us, bf16_graph_us=bf16_us,
                                 speedup=bf16_us / g_us, rel_err=err, int4_tb_s=int4_bytes / g_us / 1e6))
                print(f"  K={K:5d} N={N:5d} M={M:3d} {used[:52]:52s} {g_us:7.1f} us  x{bf16_us / g_us:4.2f}  "
                      f"{int4_bytes / g_us / 1e6:4.2f} TB/s  err {err:.1e}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(report, f, indent=1)
    ws, locks = k._WORKSPACE._buffers[device]
    rows.append(dict(case="split-K workspace left zeroed", ok=bool((ws == 0).all() and (locks == 0).all())))
    return rows


# the batch-1 projections of the engine's Llama-3-8B layer (fused q|k|v, o, fused gate|up, down) and the wide shape
E2E_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 14336)]


def r7_candidates(M: int, N: int, K: int, sms: int) -> list[k.W4A16Config]:
    """``--variants r7`` candidates (issue 7, round 7), M = 1 only, on the engine's projection shapes: the GEMV
    (``biased_fma=15``, no hand prefetch) with whole-group steps and 16 warps, one program per SM, which beat the
    default of then on the fused q|k|v shape (4096x6144: 8.6 vs 10.0 us) in the round's first sweep, its neighbours
    and the square and wide/tall rules' tiles.
    The round's other GEMV variants lost on every shape and were removed (``_gemv_kernel_fn``'s NOTE)."""
    return _gemv_grid_configs(((2048, 128, 16, 1), (2048, 64, 16, 1), (2048, 128, 8, 1), (1024, 128, 16, 1),
                               (1024, 128, 8, 2), (4096, 128, 16, 1), (1024, 64, 8, 2), (2048, 64, 8, 2)), N, K, sms)


def _gemv_grid_configs(grids, N: int, K: int, sms: int) -> list[k.W4A16Config]:
    """``W4A16Algo.GEMV`` configs with ``biased_fma=15`` for ``(block_n, block_k, num_warps, programs_per_sm)``
    grids, split-K from ``split_k_for``; duplicates (grids that land on the same split) dropped."""
    out = []
    for bn, bk, w, per_sm in grids:
        split = k.split_k_for(-(-N // bn), -(-K // bk), sms, per_sm)
        out.append(k.W4A16Config(1, bn, bk, split, w, 1, A.GEMV, biased_fma=15))
    return list(dict.fromkeys(out))


FLOOR_SHAPES = SHAPES + [(4096, 6144), (4096, 28672)]  # the shapes, then the engine's other two projections
ENGINE_PROJECTIONS = {"q|k|v": (4096, 6144), "o": (4096, 4096), "gate|up": (4096, 28672), "down": (14336, 4096)}


def floor_candidates(N: int, K: int, sms: int) -> list[tuple[int, int, int, int]]:
    """``--variants floor`` grids of the read-only kernel (``benchmarks/read_floor.py``) as ``(block_n, bkp, split_k,
    num_warps)``: 512-2048 columns, 8 or 16 packed rows per load, 1-8 programs per SM, 4 or 8 warps."""
    out = []
    for bn in (512, 1024, 2048):
        for bkp in (8, 16):
            for per_sm in (1, 2, 4, 8):
                split = k.split_k_for(-(-N // bn), -(-K // (8 * bkp)), sms, per_sm)
                for w in (4, 8):
                    out.append((bn, bkp, split, w))
    return list(dict.fromkeys(out))


def time_floor(device, report: dict, out_path: str | None) -> list[dict]:
    """``--variants floor`` (issue 7, round 8): at M = 1 on ``FLOOR_SHAPES``, bf16 ``torch.matmul``, the default
    W4A16 config (checked against ``w4a16_matmul_ref``) and the read-only kernel on every ``floor_candidates`` grid
    and on the default GEMV's own grid (each checked by its checksum first), all on the graph clock with rotating
    weights; then ``library_reads`` of the same byte count; last, ``empty_launch`` grids (the launch cost under the
    floor). ``report["floor"]`` is written to ``out_path`` after each shape."""
    import read_floor as rf  # this folder is on sys.path when run as a script (as bench_gemv imports this file)

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = report["floor"] = []
    t0 = time.perf_counter()
    for K, N in FLOOR_SHAPES:
        int4_bytes, n_q, n_b, qsets, bsets = rotating_sets(K, N, device)
        xs = [torch.randn(1, K, device=device, dtype=torch.bfloat16) for _ in range(max(n_q, n_b))]
        bf16_us = graph_time_ms(lambda i: torch.matmul(xs[i % len(xs)], bsets[i % n_b])) * 1e3
        default = k.default_config(1, N, K, GROUP, device)
        err = rel_err(k.w4a16_matmul(xs[0], *qsets[0], 4, GROUP), k.w4a16_matmul_ref(xs[0].float(), *qsets[0], 4, GROUP))
        if not err < 1e-2:
            raise AssertionError(f"default config rel_err {err:.3g} on {K}x{N}")
        gemv_us = graph_time_ms(lambda i: k.w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, GROUP)) * 1e3
        base = dict(K=K, N=N, M=1, bf16_graph_us=bf16_us, int4_bytes=int4_bytes)
        rows.append(dict(base, kind="gemv default", used=str(default), graph_us=gemv_us, rel_err=err))
        own = (default.block_n, default.block_k // 8, default.split_k, default.num_warps)
        for grid in [own] + [g for g in floor_candidates(N, K, sms) if g != own]:
            bn, bkp, split, w = grid
            label = f"floor {bn}x{bkp * 8} split{split} w{w}"
            try:
                q, s, z = qsets[0]
                got = int(rf.read_floor(q, s, z, GROUP, bn, bkp, split, w).to(torch.int64).sum()) % 2**32
                if got != rf.checksum_ref(q, s, z, GROUP, split, bkp):
                    raise AssertionError("checksum mismatch: the kernel skipped or repeated bytes")
                g_us = graph_time_ms(lambda i: rf.read_floor(*qsets[i % n_q], GROUP, bn, bkp, split, w)) * 1e3
            except Exception as e:  # noqa: BLE001 (record and go on: one call of device time)
                rows.append(dict(base, kind="floor", used=label, error=f"{type(e).__name__}: {str(e)[:300]}"))
                print("  floor failed", label, rows[-1]["error"], flush=True)
                continue
            rows.append(dict(base, kind="floor (default grid)" if grid == own else "floor", used=label, graph_us=g_us,
                             int4_tb_s=int4_bytes / g_us / 1e6))
            print(f"  K={K:5d} N={N:5d} {label:32s} {g_us:6.1f} us  {int4_bytes / g_us / 1e6:4.2f} TB/s  "
                  f"(gemv {gemv_us:.1f}, bf16 {bf16_us:.1f}; {time.perf_counter() - t0:.0f} s)", flush=True)
        for label, us in library_reads(int4_bytes, N, device).items():
            rows.append(dict(base, kind="library read", used=label, graph_us=us, int4_tb_s=int4_bytes / us / 1e6))
            print(f"  K={K:5d} N={N:5d} {label:44s} {us:6.1f} us  {int4_bytes / us / 1e6:4.2f} TB/s", flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(report, f, indent=1)
    for programs, w in ((1, 4), (264, 8), (1064, 4), (8 * sms, 2)):  # one program, 2 and 8 per SM
        us = graph_time_ms(lambda i: rf.empty_launch(programs, w, device)) * 1e3
        rows.append(dict(kind="empty launch", programs=programs, num_warps=w, graph_us=us))
        print(f"  empty launch: {programs} programs of {w} warps {us:.2f} us", flush=True)
    return rows


def library_reads(nbytes: int, N: int, device, l2_bytes: int = 50 * 2**20) -> dict[str, float]:
    """The same byte count read by PyTorch's own kernels, us per call on the graph clock with buffers rotating over
    >= 4x L2: cuBLAS's bf16 GEMV ``[1, R] @ [R, N]`` with ``R = ceil(nbytes / 2N)`` rows, and ``torch.sum`` of an int32
    buffer of ``nbytes / 4`` elements. A check that ``read_floor``'s kernel is not a slow way to read those bytes."""
    r = -(-nbytes // (2 * N))
    n_sets = max(2, math.ceil(4 * l2_bytes / nbytes))
    ws = [torch.randn(r, N, device=device, dtype=torch.bfloat16) for _ in range(n_sets)]
    x = torch.randn(1, r, device=device, dtype=torch.bfloat16)
    bufs = [torch.randint(-(2**31), 2**31, (nbytes // 4,), dtype=torch.int32, device=device) for _ in range(n_sets)]
    out = {f"cuBLAS bf16 [1, {r}] @ [{r}, {N}]": graph_time_ms(lambda i: torch.matmul(x, ws[i % n_sets])) * 1e3,
           f"torch.sum int32 [{nbytes // 4}]": graph_time_ms(lambda i: bufs[i % n_sets].sum()) * 1e3}
    return out


def print_floor_table(rows: list[dict]) -> None:
    """Per shape: bf16, the time the issue's target allows, the best read-only time, the read-only time on the
    GEMV's own grid, the GEMV; then the engine's four projections summed over 32 layers."""
    print("K x N        bf16 us  target us  read floor us (grid)                  floor, GEMV grid  library read  GEMV us  GEMV/floor")
    best = {}
    for K, N in FLOOR_SHAPES:
        rs = [r for r in rows if r.get("K") == K and r.get("N") == N and "graph_us" in r]
        gemv = next((r for r in rs if r["kind"] == "gemv default"), None)
        floors = [r for r in rs if r["kind"].startswith("floor")]
        lib = min((r["graph_us"] for r in rs if r["kind"] == "library read"), default=float("nan"))
        if not gemv or not floors:
            continue
        b = min(floors, key=lambda r: r["graph_us"])
        own = next((r["graph_us"] for r in floors if r["kind"] == "floor (default grid)"), float("nan"))
        best[(K, N)] = (b["graph_us"], gemv["graph_us"])
        target = TARGET_SMALL_M.get((K, N))
        ttxt = f"{gemv['bf16_graph_us'] / target:9.1f}" if target else f"{'-':>9s}"
        print(f"{K:5d}x{N:<5d} {gemv['bf16_graph_us']:8.1f} {ttxt}  {b['graph_us']:6.1f} ({b['used'][6:]:28s})  "
              f"{own:10.1f}  {lib:12.1f}  {gemv['graph_us']:8.1f}  {gemv['graph_us'] / b['graph_us']:6.2f}")
    if all(s in best for s in ENGINE_PROJECTIONS.values()):
        f = sum(best[s][0] for s in ENGINE_PROJECTIONS.values()) * 32
        g = sum(best[s][1] for s in ENGINE_PROJECTIONS.values()) * 32
        print(f"engine projections x 32 layers (batch-1 decode step): GEMVs {g:.0f} us, read floor {f:.0f} us, "
              f"at most {g - f:.0f} us to gain")
    for r in rows:
        if r["kind"] == "empty launch":
            print(f"empty launch, {r['programs']} programs of {r['num_warps']} warps: {r['graph_us']:.2f} us")


def r8_candidates(M: int, N: int, K: int, sms: int) -> list[k.W4A16Config]:
    """``--variants r8`` candidates (issue 7, round 8), M = 1 only, on the engine's projection shapes: the GEMV
    (``biased_fma=15``) on the grids where ``--variants floor`` read the weight fastest, 256-1024 columns on 2-8 warps
    at 4-16 programs per SM (round 7's 2048x64 tiles on 8 warps hold 64 words per thread and step in 120 registers, so
    2 programs fit an SM; 32 words per thread compile to 48 registers on sm_90, triton 3.9), and round 7's rules.
    The round-8 rule (512x64 on 2 warps, 8 per SM) is the default now."""
    return _gemv_grid_configs(((512, 64, 4, 8), (512, 64, 4, 6), (512, 64, 4, 4), (512, 64, 4, 10), (512, 32, 4, 8),
                               (512, 128, 4, 8), (256, 64, 2, 8), (256, 64, 2, 16), (256, 32, 2, 16), (1024, 64, 4, 4),
                               (1024, 32, 4, 8), (1024, 64, 8, 4), (512, 64, 2, 8), (2048, 64, 8, 2), (1024, 64, 8, 2)),
                              N, K, sms)


def print_tc2_table(rows: list[dict]) -> None:
    """One line per (shape, M): the default's and the best config's us, bf16's, both ratios and the target."""
    print("K x N        M  default us  best us  best config                                        bf16 us  x(def) x(best) target")
    for K, N in SHAPES:
        for M in TC2_MS:
            rs = [r for r in rows if r.get("K") == K and r.get("N") == N and r.get("M") == M and "graph_us" in r]
            if not rs:
                continue
            d = next((r for r in rs if r["config"] == "default"), None)
            b = min(rs, key=lambda r: r["graph_us"])
            target = TARGET_SMALL_M[(K, N)] if M <= 16 else 0.8
            dus, dx = (f"{d['graph_us']:10.1f}", f"{d['speedup']:6.2f}") if d else (f"{'failed':>10s}", f"{'-':>6s}")
            print(f"{K:5d}x{N:<5d} {M:4d} {dus} {b['graph_us']:8.1f}  {b['used'][:50]:50s} {b['bf16_graph_us']:8.1f} {dx} "
                  f"{b['speedup']:7.2f}  {target}")


def _off_grid_errors(cfg: k.W4A16Config, M: int, device) -> list[float]:
    """Relative errors of ``cfg`` off the timed grid, each case against ``w4a16_matmul_ref``: per-channel K = 4104
    (K % BLOCK_K != 0) with N = 1000 (N % BLOCK_N != 0) and a bias, then fp16 x; for the GEMV (M = 1) with groups of
    32, for the others at N = 1024 and again at M = 2 * BLOCK_M + 3 (several M tiles)."""
    if cfg.algo == k.W4A16Algo.GEMV:
        cases = ((4104, 1000, 4104, torch.bfloat16, 1, True), (4096, 1000, 32, torch.float16, 1, False))
    else:
        cases = ((4104, 1000, 4104, torch.bfloat16, M, True), (4096, 1024, 128, torch.float16, M, False),
                 (4096, 1024, 128, torch.bfloat16, 2 * cfg.block_m + 3, False))
    errs = []
    for K, N, G, dtype, m, bias in cases:
        q = random_layer(K, N, 4, G, device)
        x = torch.randn(m, K, device=device, dtype=dtype)
        b = torch.randn(N, device=device, dtype=dtype) if bias else None
        errs.append(rel_err(k.w4a16_matmul(x, *q, 4, G, bias=b, config=cfg), k.w4a16_matmul_ref(x.float(), *q, 4, G, bias=b)))
    return errs


def sass_report() -> list[dict]:
    """``--sass`` (no GPU needed): compile the M <= 16 kernels for sm_90 with this machine's Triton and count the SASS
    instructions of the K loop (the longest backward branch) per weight a thread unpacks per step, plus the
    instructions that say where the weight tile goes: STS/LDS/LDSM (shared-memory round trip), HGMMA/HMMA, SHFL."""
    import collections
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    cuobjdump = triton.knobs.nvidia.cuobjdump.path if hasattr(triton, "knobs") else "cuobjdump"
    base = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*i16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
            "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32"}
    variants = [(f"dot 16x{bn}x128", k._w4a16_kernel, dict(BITS=4, ALGO=1), 16, bn, 4) for bn in (64, 128)]
    variants += [("dot_swap 16x64x128", k._w4a16_kernel, dict(BITS=4, ALGO=2), 16, 64, 4)]
    for asm, perm, bm, bn in ((True, True, 16, 64), (True, True, 16, 128), (True, True, 8, 128), (False, True, 16, 128),
                              (True, False, 16, 128), (False, False, 16, 128)):
        name = f"{'tc_asm' if asm else 'tc'} {bm}x{bn}x128{' perm' if perm else ''}"
        variants.append((name, k._tc_kernel, dict(USE_ASM=asm, PERMUTE_K=perm, EVEN_K=True), bm, bn, 4))
    # the large-M tiles of --variants tc2 (8 warps)
    for bm in (64, 128):
        variants.append((f"tc_asm {bm}x128x128 w8 perm", k._tc_kernel, dict(USE_ASM=True, PERMUTE_K=True, EVEN_K=True),
                         bm, 128, 8))
    # the launch specializes 16-divisible pointers and ints ("tt.divisibility"): without it Triton cannot prove x's
    # 16-byte alignment and leaves x as a plain load (not cp.async) -- the SASS of round 5 was compiled so
    args = list(base)
    attrs = {(args.index(a),): [["tt.divisibility", 16]] for a in args if a not in ("M",)}
    rows = []
    for name, fn, extra, bm, bn, warps in variants:
        cx = dict(GROUP_SIZE=128, HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, SPLIT_K=4, **extra)
        sig = dict(base, **{n: "constexpr" for n in cx})
        c = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=3))
        ttgir = c.asm["ttgir"]
        pendings = [int(v) for v in re.findall(r"warp_group_dot_wait[^\n]*pendings = (\d+)", ttgir)]
        plain_loads = len(re.findall(r"= tt\.load ", ttgir))
        async_copies = len(re.findall(r"ttg\.async_copy_global_to_local", ttgir))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"])
            f.flush()
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s*([^;/]*);", sass)]
        loop = []
        for addr, txt in ins:
            m = re.search(r"BRA (0x[0-9a-f]+)", txt)
            if m and int(m.group(1), 16) < addr:
                body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
                loop = body if len(body) > len(loop) else loop
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in loop)
        per_thread = bn * 128 / (32 * warps)  # weights a thread unpacks per K step

        def n(*prefixes):
            return sum(v for op, v in ops.items() if op.startswith(prefixes))

        rows.append(dict(variant=name, loop_instr=len(loop), instr_per_weight=len(loop) / per_thread,
                         sts=n("STS"), lds=n("LDS"), ldsm=n("LDSM"), mma=n("HGMMA", "HMMA"), shfl=n("SHFL"),
                         local=n("LDL", "STL"), regs=c.n_regs if hasattr(c, "n_regs") else None,
                         shared_bytes=c.metadata.shared, top=ops.most_common(8), dot_wait_pendings=pendings,
                         ttgir_plain_loads=plain_loads, ttgir_async_copies=async_copies))
        print(f"{name:28s} loop {len(loop):4d} instr = {len(loop) / per_thread:5.2f}/weight  STS {rows[-1]['sts']:3d} "
              f"LDS {rows[-1]['lds']:3d} LDSM {rows[-1]['ldsm']:2d} MMA {rows[-1]['mma']:2d} SHFL {rows[-1]['shfl']:3d} "
              f"local {rows[-1]['local']} smem {c.metadata.shared} | TTGIR: {plain_loads} tt.load, {async_copies} cp.async, "
              f"dot wait pendings {pendings}", flush=True)
    return rows


def e2e_paged(device, num_requests: int = 4, context: int = 512, decode_steps: int = 64) -> dict:
    """Batch-1 decode through the paged engine (compiled layers + CUDA graphs, the engine's defaults) of a
    Llama-3-8B-shaped model with random weights: bf16 vs GPTQ 4-bit g128 (``run_paged``'s ``decode_batch1``)."""
    from paged_transformers import EngineConfig
    from paged_transformers.bench import BenchRequest, build_model, run_paged

    result = {"model": "llama-3-8b shape, random weights", "context": context, "decode_steps": decode_steps}
    requests = [BenchRequest(list(range(100 + i, 228 + i)), 16) for i in range(num_requests)]
    for name, quant in (("bf16", None), ("gptq", "gptq")):
        t0 = time.perf_counter()
        model = build_model("llama-3-8b", torch.bfloat16, str(device), quantization=quant, bits=4, group_size=128)
        config = EngineConfig(max_model_len=1024, max_num_seqs=8, gpu_memory_utilization=0.5)
        res = run_paged(model, requests, config, batch1_context=context, batch1_tokens=decode_steps)
        b1 = res.extra["decode_batch1"]
        result[name] = dict(total_s=time.perf_counter() - t0, init_s=res.extra["init_s"], decode_batch1=b1,
                            cuda_graphs=res.extra["cuda_graphs"], cuda_graph_capture_error=res.extra["cuda_graph_capture_error"])
        print(f"  e2e {name}: batch-1 decode wall p50 {b1['tpot_s_p50'] * 1e3:.2f} ms, device p50 {b1['device_s_p50'] * 1e3:.2f} ms, "
              f"kinds {b1['kinds']} ({time.perf_counter() - t0:.0f} s)", flush=True)
        del model, res
        torch.cuda.empty_cache()
    for key in ("tpot_s_p50", "device_s_p50"):
        result[f"speedup_{key}"] = result["bf16"]["decode_batch1"][key] / result["gptq"]["decode_batch1"][key]
    return result


def print_best(rows: list[dict], K: int, N: int, M: int | None, top: int, width: int) -> None:
    """The ``top`` fastest timed rows of one shape (and ``M``, if given), plus the default if it is not among them."""
    rs = sorted((r for r in rows if r.get("K") == K and r.get("N") == N and (M is None or r.get("M") == M) and "graph_us" in r),
                key=lambda r: r["graph_us"])
    for r in rs[:top] + [r for r in rs[top:] if r["config"] == "default"]:
        m = "" if M is None else f" M={M:2d}"
        print(f"{K:5d}x{N:<5d}{m} {r['config'][:width]:{width}s} {r['graph_us']:7.1f} x{r['speedup']:4.2f} "
              f"{r['int4_tb_s']:4.2f} TB/s  (bf16 {r['bf16_graph_us']:.1f}, target x{TARGET_SMALL_M.get((K, N), '-')})")


def print_failed(rows: list[dict], t_start: float) -> None:
    """The count of failed rows and the run's wall time."""
    failed = [r for r in rows if "error" in r or r.get("ok") is False]
    print(f"failed: {len(failed)}; total {time.perf_counter() - t_start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--quick", action="store_true", help="default configs only (no sweep)")
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--variants", choices=["gemv", "tc", "tc2", "r7", "r8", "floor"], default=None,
                        help="gemv: only the M = 1 GEMV candidates vs the default (about 2 minutes); tc: the "
                             "tensor-core W4A16Algo.TC/TC_ASM candidates vs the default at M = 1, 4, 16; tc2: TC_ASM "
                             "tile/stage/split choices at M = 4, 16, and 64x128 / 128x128 tiles with and without split-K vs "
                             "DEQUANT_MATMUL at M = 32, 64, 256 (about 2-3 minutes); r7: GEMV tiles at M = 1 on the "
                             "engine's projection shapes, q|k|v, o, gate|up, down (r7_candidates); r8: the same with "
                             "r8_candidates; floor: at M = 1, the "
                             "read-only kernel of read_floor.py vs the GEMV and bf16 (about 2 minutes)")
    parser.add_argument("--sass", action="store_true",
                        help="no GPU: compile the M <= 16 kernels for sm_90 and count SASS instructions per weight")
    args = parser.parse_args()
    if args.sass:
        rows = sass_report()
        if args.out:
            with open(args.out, "w") as f:
                import triton

                json.dump({"command": "python benchmarks/bench_w4a16.py --sass", "target": "cuda sm_90 (compiled, not run)",
                           "triton": triton.__version__, "date": datetime.date.today().isoformat(), "sass": rows}, f, indent=1)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_w4a16 needs a CUDA GPU")
    import transformers
    import triton

    device = torch.device("cuda", torch.cuda.current_device())
    report = {
        "command": "python benchmarks/bench_w4a16.py" + (" --quick" if args.quick else "") + (" --no-e2e" if args.no_e2e else ""),
        "kernel_round": 2,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "cuda": torch.version.cuda},
    }
    t0 = t_start = time.perf_counter()
    if args.variants in ("tc", "tc2"):
        report["command"] = f"python benchmarks/bench_w4a16.py --variants {args.variants}"
        report["kernel_round"] = {"tc": 5, "tc2": 7}[args.variants]
        rows = (time_tc2_variants if args.variants == "tc2" else time_tc_variants)(device, report, args.out)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        if args.variants == "tc2":
            print("\nus per call (CUDA-graph clock, rotating weights); x = bf16 / W4A16; target: x at M <= 16, >= 0.8 at M >= 64")
            print_tc2_table(rows)
        else:
            print("\nus per call (CUDA-graph clock, rotating weights); x = bf16 / W4A16; TB/s = int4 + scale/zero bytes")
            for K, N in SHAPES:
                for M in (1, 4, 16):
                    print_best(rows, K, N, M, top=3, width=40)
        print_failed(rows, t_start)
        return
    if args.variants in ("r7", "r8"):
        report["command"] = f"python benchmarks/bench_w4a16.py --variants {args.variants}"
        report["kernel_round"] = int(args.variants[1])
        candidates = r7_candidates if args.variants == "r7" else r8_candidates
        rows = time_variants(device, report, args.out, args.variants, (1,), candidates, shapes=E2E_SHAPES)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        print("\nus per call (CUDA-graph clock, rotating weights); x = bf16 / W4A16; TB/s = int4 + scale/zero bytes")
        for K, N in E2E_SHAPES:
            print_best(rows, K, N, 1, top=4, width=48)
        print_failed(rows, t_start)
        return
    if args.variants == "floor":
        report["command"] = "python benchmarks/bench_w4a16.py --variants floor"
        report["kernel_round"] = 8
        rows = time_floor(device, report, args.out)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        print("\nM = 1, us per call (CUDA-graph clock, rotating weights); target us = bf16 us / the issue's ratio")
        print_floor_table(rows)
        print_failed(rows, t_start)
        return
    if args.variants == "gemv":
        report["command"] = "python benchmarks/bench_w4a16.py --variants gemv"
        report["kernel_round"] = 4
        report["gemv"] = rows = time_gemv_variants(device)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        print("\nM = 1, us per call (CUDA-graph clock, rotating weights); x = bf16 / W4A16; TB/s = int4 + scale/zero bytes")
        for K, N in SHAPES:
            print_best(rows, K, N, None, top=5, width=44)
        print_failed(rows, t_start)
        return
    report["correctness"] = check_correctness(device)
    bad = [r for r in report["correctness"] if not r["ok"]]
    print(f"correctness: {len(report['correctness']) - len(bad)}/{len(report['correctness'])} ok ({time.perf_counter() - t0:.0f}s)", flush=True)
    for r in bad:
        print("  FAIL", r, flush=True)
    report["gemm"] = time_gemms(device, args.quick)
    if not args.no_e2e:
        try:
            report["e2e_paged_batch1"] = e2e_paged(device)
        except Exception as e:  # noqa: BLE001
            report["e2e_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print("e2e failed:", report["e2e_error"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    print("\nus per call, CUDA-graph clock (eager clock in brackets); x = bf16 / W4A16")
    print("K x N        M   default                            best (config)                                    bf16     x(def)  x(best) target")
    for K, N in SHAPES:
        for M in MS:
            rows = [r for r in report["gemm"] if r["K"] == K and r["N"] == N and r["M"] == M and "graph_us" in r]
            if not rows:
                continue
            d = next((r for r in rows if r["config"] == "default"), None)
            b = min(rows, key=lambda r: r["graph_us"])
            target = TARGET_SMALL_M[(K, N)] if M <= 16 else 0.8
            dtxt = f"{d['graph_us']:6.1f} [{d['eager_us']:6.1f}] {d['used'][:18]:18s}" if d else f"{'failed':33s}"
            print(f"{K:5d}x{N:<5d} {M:4d} {dtxt} {b['graph_us']:6.1f} [{b['eager_us']:6.1f}] ({b['used'][:34]:34s}) "
                  f"{b['bf16_graph_us']:6.1f} {d['speedup'] if d else float('nan'):8.2f} {b['speedup']:8.2f}  >= {target}")
    bad = [r for r in report["correctness"] if not r["ok"]]
    print(f"correctness: {len(report['correctness']) - len(bad)}/{len(report['correctness'])} ok")
    if "e2e_paged_batch1" in report:
        e = report["e2e_paged_batch1"]
        print(f"e2e paged batch-1 decode (compiled layers, CUDA graphs): bf16 wall {e['bf16']['decode_batch1']['tpot_s_p50'] * 1e3:.2f} ms "
              f"device {e['bf16']['decode_batch1']['device_s_p50'] * 1e3:.2f} ms | gptq wall {e['gptq']['decode_batch1']['tpot_s_p50'] * 1e3:.2f} ms "
              f"device {e['gptq']['decode_batch1']['device_s_p50'] * 1e3:.2f} ms | speedup wall {e['speedup_tpot_s_p50']:.2f} device {e['speedup_device_s_p50']:.2f}")
    print(f"total {time.perf_counter() - t_start:.0f} s")

if __name__ == "__main__":
    main()
