"""W4A16 GEMM on GPU, the product dispatch: correctness at real sizes, timings of ``default_config``'s kernels vs bf16
``torch.matmul``, and batch-1 decode of a Llama-3-8B-shaped GPTQ model vs bf16 through the paged engine. About 2
minutes on an H200.

Usage (GPU)::

    python benchmarks/bench_w4a16.py --out $OUT/w4a16_h200.json

1. Correctness: ``w4a16_matmul`` vs ``w4a16_matmul_ref`` (both from ``paged_transformers.kernels.w4a16``)
   as ``||out - ref|| / ||ref||`` on fresh random data, for the Llama-3-8B layer shapes at every M and off the
   tile grid (per-channel K = 4104, group 32 + bias, 8-bit, fp16), act-order and AWQ through ``QuantLinear``, the
   custom op under ``torch.compile(fullgraph=True)``, and a CUDA-graph capture + replay of the default split-K path.
2. GEMM timings, shapes ``K x N`` = 4096x4096, 4096x14336, 14336x4096 at M = 1, 4, 16, 64, 256, group 128,
   bf16, the default config. Two clocks: ``graph_us``, device time per call from replaying a CUDA graph of 16
   calls that rotate over weight sets totalling > 4x L2 (what decode sees: the engine replays graphs), and
   ``eager_us``, ``triton.testing.do_bench``'s median per eager call (includes any launch cost the GPU waits for).
3. End to end: ``run_paged`` (``paged_transformers.bench``) on a Llama-3-8B-shaped model with random
   weights, bf16 and GPTQ 4-bit g128, compiled layers and CUDA graphs (the engine defaults): 4 requests,
   then one request alone, 512-token prompt, 64 decode steps: median wall and device time per step.

The kernel-variant sweeps that chose ``default_config``'s rules are in docs/benchmark-history.md (issue 7); the
read floor of the GEMV is ``research/read_floor.py``.
"""

import argparse
import datetime
import json
import math
import platform
import time

import torch

from paged_transformers.kernels import w4a16 as k
from paged_transformers.kernels.w4a16.matmul import _WORKSPACE

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K, N) = (in_features, out_features)
MS = [1, 4, 16, 64, 256]
GROUP = 128
# targets of issue 7: speedup over bf16 at M in {1, 4, 16}; at M = 256 at least 0.8x
TARGET_SMALL_M = {(4096, 4096): 2.5, (4096, 14336): 3.0, (14336, 4096): 3.0}


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
    """The default configs vs the reference on fresh random data; returns one record per case."""
    rows = []

    def case(*args, **kwargs):
        try:
            _case(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (record and go on: one call of device time)
            rows.append(dict(case=args[0], M=args[1], ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))

    def _case(name, M, K, N, bits, group, dtype=torch.bfloat16, bias=False):
        qweight, scales, zeros = random_layer(K, N, bits, group, device)
        x = torch.randn(M, K, device=device, dtype=dtype)
        b = torch.randn(N, device=device, dtype=dtype) if bias else None
        out = k.w4a16_matmul(x, qweight, scales, zeros, bits, group, bias=b)
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
    # the 17 <= M <= 64 rules off the tile grid (per-channel K % BLOCK_K != 0, N % BLOCK_N != 0, bias)
    case("per-channel, K % BLOCK_K != 0, M=40, wide", 40, 4104, 9000, 4, 4104, bias=True)
    case("per-channel, K % BLOCK_K != 0, M=40, tall", 40, 4104, 1000, 4, 4104, bias=True)
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
    ws, locks = _WORKSPACE._buffers[device]
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


def time_gemms(device) -> list[dict]:
    """Per (shape, M): bf16 matmul and W4A16 with its default config, graph and eager clocks (us)."""
    import triton

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

            def q_fn(i):
                return k.w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, GROUP)

            bf16 = dict(graph_us=graph_time_ms(bf16_fn) * 1e3, eager_us=eager(bf16_fn) * 1e3)
            used = str(k.default_config(M, N, K, GROUP, device))
            try:
                err = rel_err(q_fn(0), k.w4a16_matmul_ref(xs[0].float(), *qsets[0], 4, GROUP))
                if not err < 1e-2:
                    raise AssertionError(f"rel_err {err:.3g}")
                g_us, e_us = graph_time_ms(q_fn) * 1e3, eager(q_fn) * 1e3
            except Exception as e:  # noqa: BLE001 (record and go on: one call of device time)
                rows.append(dict(K=K, N=N, M=M, config="default", used=used, error=f"{type(e).__name__}: {str(e)[:300]}"))
                print("  default config failed", rows[-1]["error"], flush=True)
                continue
            rows.append(dict(K=K, N=N, M=M, config="default", used=used, graph_us=g_us, eager_us=e_us,
                             bf16_graph_us=bf16["graph_us"], bf16_eager_us=bf16["eager_us"], speedup=bf16["graph_us"] / g_us,
                             rel_err=err, int4_bytes_floor_us=int4_bytes / 4.2e6))
            print(f"  K={K:5d} N={N:5d} M={M:3d} {used[:34]:34s} graph {g_us:7.1f} us (bf16 {bf16['graph_us']:6.1f}, "
                  f"x{bf16['graph_us'] / g_us:4.2f})  eager {e_us:7.1f} us (bf16 {bf16['eager_us']:6.1f})", flush=True)
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


def print_report(report: dict, t_start: float) -> None:
    """The GEMM table (default config vs bf16, both clocks), the correctness count and the end-to-end line."""
    print("\nus per call, CUDA-graph clock (eager clock in brackets); x = bf16 / W4A16")
    print("K x N        M   default                            bf16     x     target")
    for r in report["gemm"]:
        if "graph_us" not in r:
            continue
        target = TARGET_SMALL_M[(r["K"], r["N"])] if r["M"] <= 16 else 0.8
        print(f"{r['K']:5d}x{r['N']:<5d} {r['M']:4d} {r['graph_us']:6.1f} [{r['eager_us']:6.1f}] {r['used'][:18]:18s} "
              f"{r['bf16_graph_us']:6.1f} {r['speedup']:6.2f}  >= {target}")
    bad = [r for r in report["correctness"] if not r["ok"]]
    print(f"correctness: {len(report['correctness']) - len(bad)}/{len(report['correctness'])} ok")
    if "e2e_paged_batch1" in report:
        e = report["e2e_paged_batch1"]
        print(f"e2e paged batch-1 decode (compiled layers, CUDA graphs): bf16 wall {e['bf16']['decode_batch1']['tpot_s_p50'] * 1e3:.2f} ms "
              f"device {e['bf16']['decode_batch1']['device_s_p50'] * 1e3:.2f} ms | gptq wall {e['gptq']['decode_batch1']['tpot_s_p50'] * 1e3:.2f} ms "
              f"device {e['gptq']['decode_batch1']['device_s_p50'] * 1e3:.2f} ms | speedup wall {e['speedup_tpot_s_p50']:.2f} device {e['speedup_device_s_p50']:.2f}")
    print(f"total {time.perf_counter() - t_start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end batch-1 decode")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_w4a16 needs a CUDA GPU")
    import transformers
    import triton

    device = torch.device("cuda", torch.cuda.current_device())
    report = {
        "command": "python benchmarks/bench_w4a16.py" + (" --no-e2e" if args.no_e2e else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "cuda": torch.version.cuda},
    }
    t_start = time.perf_counter()
    report["correctness"] = check_correctness(device)
    bad = [r for r in report["correctness"] if not r["ok"]]
    print(f"correctness: {len(report['correctness']) - len(bad)}/{len(report['correctness'])} ok "
          f"({time.perf_counter() - t_start:.0f}s)", flush=True)
    for r in bad:
        print("  FAIL", r, flush=True)
    report["gemm"] = time_gemms(device)
    if not args.no_e2e:
        try:
            report["e2e_paged_batch1"] = e2e_paged(device)
        except Exception as e:  # noqa: BLE001
            report["e2e_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print("e2e failed:", report["e2e_error"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print_report(report, t_start)


if __name__ == "__main__":
    main()
