"""W4A16 GEMM on GPU: correctness at real sizes, timings vs bf16 ``torch.matmul``, and a batch-1
decode step of a Llama-3-8B-shaped GPTQ model vs bf16.

Usage (GPU)::

    python benchmarks/bench_w4a16.py --out benchmarks/results/w4a16_h200.json

1. Correctness: ``w4a16_matmul`` vs ``w4a16_matmul_ref`` (both from ``paged_transformers.kernels.w4a16``)
   as ``||out - ref|| / ||ref||`` on fresh random data, for the Llama-3-8B layer shapes at every M,
   plus per-channel with K not a multiple of the tile, act-order, 8-bit, AWQ-converted and fp16 cases.
2. GEMM timings, ``triton.testing.do_bench`` median (it clears L2 before every run; inputs also rotate
   over several weight sets whose total exceeds L2), group 128, bf16 activations, shapes ``K x N`` =
   4096x4096, 4096x14336, 14336x4096 at M = 1, 4, 16, 256: the default config and a small sweep of
   launch configs, each checked against the reference before it is timed.
3. End to end (standalone, plain transformers forward, no paged engine): one decode step at batch 1
   after a 128-token prefill, ``StaticCache``; eager, and replayed from a CUDA graph when capture works.
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
MS = [1, 4, 16, 256]
GROUP = 128
# targets of issue 7: speedup over bf16 at M in {1, 4, 16}; at M = 256 at least 0.8x
TARGET_SMALL_M = {(4096, 4096): 2.5, (4096, 14336): 3.0, (14336, 4096): 3.0}

A = k.W4A16Algo


def sweep_configs(M: int, N: int, K: int, sms: int) -> list[tuple[str, k.W4A16Config]]:
    """Candidate configs per (M, N, K) for issue 7 round 1: the per-field kernels (FMA GEMV, DOT, DOT_SWAP,
    split-K sized by ``k.split_k_for`` for 2/4/8 programs per SM), dequant + cuBLAS for M = 256, and the
    round-0 reshape kernel at its old defaults as the baseline of the same run."""

    def split(bm, bn, bk, per_sm=4):
        return k.split_k_for(-(-M // bm) * -(-N // bn), -(-K // bk), sms, per_sm)

    out = []
    if M <= 4:
        bm = 1 if M == 1 else 4
        fma = [(128, 128), (256, 128), (64, 128), (128, 256), (256, 64)] if M == 1 else [(64, 128), (32, 128), (64, 64)]
        for bn, bk in fma:
            for per_sm in (2, 4, 8) if (bn, bk) == fma[0] else (4,):
                out.append(k.W4A16Config(bm, bn, bk, split(bm, bn, bk, per_sm), 4, 3, A.FMA))
        out.append(k.W4A16Config(bm, 256, 128, split(bm, 256, 128), 8, 3, A.FMA))
        if M == 1:  # round-0 defaults
            out.append(k.W4A16Config(1, 32, 256, 8, 4, 3, A.RESHAPE_FMA) if N < 8192 else k.W4A16Config(1, 64, 128, 4, 4, 3, A.RESHAPE_FMA))
    if 2 <= M <= 16:
        for algo in (A.DOT, A.DOT_SWAP):
            for bn, bk in ((64, 128), (128, 128), (64, 256)):
                out.append(k.W4A16Config(16, bn, bk, split(16, bn, bk), 4, 3, algo))
            out.append(k.W4A16Config(16, 64, 128, split(16, 64, 128, 8), 4, 4, algo))
        out.append(k.W4A16Config(16, 64, 128, 8 if -(-N // 64) <= 96 else 4, 4, 4, A.RESHAPE_DOT))  # round-0 default
    if M > 16:
        for bm, bn, bk, w in ((128, 128, 128, 8), (128, 256, 128, 8), (256, 128, 128, 8), (64, 128, 128, 4), (128, 128, 256, 8)):
            out.append(k.W4A16Config(bm, bn, bk, 1, w, 3, A.DOT))
        for bm, bn, bk, w in ((64, 128, 128, 4), (128, 128, 128, 8), (64, 256, 128, 8)):
            out.append(k.W4A16Config(bm, bn, bk, 1, w, 3, A.DOT_SWAP))
        out.append(k.W4A16Config(16, 128, 128, 1, 4, 3, A.DEQUANT_MATMUL))
        out.append(k.W4A16Config(16, 64, 256, 1, 4, 3, A.DEQUANT_MATMUL))
        out.append(k.W4A16Config(64, 128, 64, 1, 4, 4, A.RESHAPE_DOT) if N < 8192 else k.W4A16Config(128, 128, 64, 1, 4, 4, A.RESHAPE_DOT))
    return [(str(c), c) for c in out]


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
    for cfg in (k.W4A16Config(1, 128, 128, 4, algo=A.FMA), k.W4A16Config(4, 64, 128, 4, algo=A.FMA),
                k.W4A16Config(16, 64, 128, 4, algo=A.DOT), k.W4A16Config(16, 64, 128, 4, algo=A.DOT_SWAP),
                k.W4A16Config(128, 128, 128, 1, 8, algo=A.DOT), k.W4A16Config(64, 128, 128, 1, 4, algo=A.DOT_SWAP),
                k.W4A16Config(16, 128, 128, 1, algo=A.DEQUANT_MATMUL)):
        M = {A.FMA: cfg.block_m}.get(cfg.algo, 3 if cfg.block_m == 16 else 200)
        case(f"{cfg} per-channel K=4104", M, 4104, 1000, 4, 4104, config=cfg)
        case(f"{cfg} group 32, bias", M, 4096, 1000, 4, 32, config=cfg, bias=True)
        case(f"{cfg} fp16", M, 4096, 1024, 4, 128, dtype=torch.float16, config=cfg)
        cfg8 = k.W4A16Config(cfg.block_m, cfg.block_n, 64, cfg.split_k, cfg.num_warps, cfg.num_stages, cfg.algo)
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


def time_gemms(device, quick: bool) -> list[dict]:
    """do_bench medians (ms) of W4A16 (default config + sweep) and bf16 matmul per (shape, M)."""
    import triton

    l2_bytes = 50 * 2**20  # H100/H200 L2 is 50 MB; rotate over sets totalling >= 4x that
    rows = []
    for K, N in SHAPES:
        int4_bytes = K * N // 2 + 2 * (K // GROUP) * N * 2
        n_q = max(2, math.ceil(4 * l2_bytes / int4_bytes))
        n_b = max(2, math.ceil(4 * l2_bytes / (K * N * 2)))
        qsets = [random_layer(K, N, 4, GROUP, device) for _ in range(n_q)]
        bsets = [torch.randn(K, N, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(n_b)]
        for M in MS:
            xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(max(n_q, n_b))]

            def bench(fn):
                return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

            it = {"i": 0}

            def bf16_fn():
                it["i"] += 1
                return torch.matmul(xs[it["i"] % len(xs)], bsets[it["i"] % n_b])

            bf16_ms = bench(bf16_fn)
            configs = [("default", None)]
            if not quick:
                configs += sweep_configs(M, N, K, torch.cuda.get_device_properties(device).multi_processor_count)
            for label, cfg in configs:
                q0 = qsets[0]
                try:
                    out = k.w4a16_matmul(xs[0], *q0, 4, GROUP, config=cfg)
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(K=K, N=N, M=M, config=label, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    print("  config failed", label, rows[-1]["error"], flush=True)
                    continue
                err = rel_err(out, k.w4a16_matmul_ref(xs[0].float(), *q0, 4, GROUP))
                if not err < 1e-2:
                    rows.append(dict(K=K, N=N, M=M, config=label, error=f"rel_err {err:.3g}"))
                    continue

                def q_fn(cfg=cfg):
                    it["i"] += 1
                    qs = qsets[it["i"] % n_q]
                    return k.w4a16_matmul(xs[it["i"] % len(xs)], *qs, 4, GROUP, config=cfg)

                ms = bench(q_fn)
                used = cfg or k.default_config(M, N, K, GROUP, device)
                rows.append(dict(K=K, N=N, M=M, config=label, used=str(used), w4a16_ms=ms, bf16_ms=bf16_ms,
                                 speedup=bf16_ms / ms, rel_err=err, int4_bytes_floor_ms=int4_bytes / 4.8e9))
                print(f"  K={K:5d} N={N:5d} M={M:3d} {label[:60]:60s} {ms*1e3:8.1f} us  bf16 {bf16_ms*1e3:8.1f} us  x{bf16_ms/ms:5.2f}", flush=True)
    return rows


LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def e2e_decode(device, steps: int = 32, prompt_len: int = 128, shape: dict = LLAMA3_8B, dtype=torch.bfloat16) -> dict:
    """Batch-1 decode step time (ms) of a Llama-3-8B-shaped model: GPTQ 4-bit g128 vs bf16."""
    import inspect

    import transformers
    from transformers import StaticCache

    from paged_transformers.quantization import build_random_quantized_model
    from paged_transformers.quantization.loader import build_skeleton, finish_loading

    cfg = transformers.LlamaConfig(**shape)
    cfg._attn_implementation = "sdpa"
    result = {"model": "llama-3-8b shape, random weights", "prompt_len": prompt_len, "decode_steps": steps}

    def bf16_model():
        model = build_skeleton(cfg, dtype)
        gen = torch.Generator(device=device).manual_seed(0)
        for module in model.modules():
            for leaf, p in list(module._parameters.items()):
                if p is not None and p.device.type == "meta":
                    v = torch.randn(p.shape, generator=gen, device=device, dtype=dtype) * 0.02 if p.dim() >= 2 else torch.ones(p.shape, device=device, dtype=dtype)
                    module._parameters[leaf] = torch.nn.Parameter(v, requires_grad=False)
        finish_loading(model, device)
        return model.eval()

    for name, build in (("bf16", bf16_model),
                        ("gptq", lambda: build_random_quantized_model(cfg, "gptq", 4, 128, dtype, device))):
        t0 = time.perf_counter()
        model = build()
        _sync(device)
        build_s = time.perf_counter() - t0
        cache = StaticCache(config=model.config, max_cache_len=prompt_len + 4 * steps + 16)
        # transformers 5.17 takes cache_position (graph-capturable); 5.24 derives it from position_ids
        has_cache_position = "cache_position" in inspect.signature(model.model.forward).parameters
        prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=device)
        extra = {"cache_position": torch.arange(prompt_len, device=device)} if has_cache_position else {}
        model(input_ids=prompt, position_ids=torch.arange(prompt_len, device=device)[None], past_key_values=cache, use_cache=True, **extra)
        tok = torch.zeros((1, 1), dtype=torch.long, device=device)
        pos = torch.full((1,), prompt_len, dtype=torch.long, device=device)

        def step():
            extra = {"cache_position": pos} if has_cache_position else {}
            logits = model(input_ids=tok, position_ids=pos[None], past_key_values=cache,
                           use_cache=True, logits_to_keep=1, **extra).logits
            tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
            pos.add_(1)

        for _ in range(3):
            step()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        eager_ms = (time.perf_counter() - t0) / steps * 1e3
        rec = {"build_s": build_s, "eager_step_ms": eager_ms}
        if device.type != "cuda":
            result[name] = rec
            continue
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                graph.replay()
            torch.cuda.synchronize()
            rec["graph_step_ms"] = (time.perf_counter() - t0) / steps * 1e3
        except Exception as e:  # noqa: BLE001 (report, do not fail the whole benchmark)
            rec["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rec["weights_gb"] = sum(b.numel() * b.element_size() for b in list(model.parameters()) + list(model.buffers())) / 1e9
        result[name] = rec
        print(f"  e2e {name}: {rec}", flush=True)
        del model, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for key in ("eager_step_ms", "graph_step_ms"):
        if key in result["bf16"] and key in result["gptq"]:
            result[f"speedup_{key}"] = result["bf16"][key] / result["gptq"][key]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--quick", action="store_true", help="default configs only (no sweep)")
    parser.add_argument("--no-e2e", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_w4a16 needs a CUDA GPU")
    import transformers
    import triton

    device = torch.device("cuda", torch.cuda.current_device())
    report = {
        "command": "python benchmarks/bench_w4a16.py" + (" --quick" if args.quick else "") + (" --no-e2e" if args.no_e2e else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "cuda": torch.version.cuda},
    }
    t0 = time.perf_counter()
    report["correctness"] = check_correctness(device)
    bad = [r for r in report["correctness"] if not r["ok"]]
    print(f"correctness: {len(report['correctness']) - len(bad)}/{len(report['correctness'])} ok ({time.perf_counter() - t0:.0f}s)", flush=True)
    for r in bad:
        print("  FAIL", r, flush=True)
    report["gemm"] = time_gemms(device, args.quick)
    if not args.no_e2e:
        try:
            report["e2e_decode_batch1"] = e2e_decode(device)
        except Exception as e:  # noqa: BLE001
            report["e2e_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print("e2e failed:", report["e2e_error"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    print("\nK x N         M   default us  best us (config)                                   bf16 us  x(default)  x(best)  target")
    for K, N in SHAPES:
        for M in MS:
            rows = [r for r in report["gemm"] if r["K"] == K and r["N"] == N and r["M"] == M and "w4a16_ms" in r]
            if not rows:
                continue
            d = next((r for r in rows if r["config"] == "default"), rows[0])
            b = min(rows, key=lambda r: r["w4a16_ms"])
            target = TARGET_SMALL_M[(K, N)] if M <= 16 else 0.8
            print(f"{K:5d}x{N:<5d} {M:4d} {d['w4a16_ms']*1e3:10.1f} {b['w4a16_ms']*1e3:8.1f} ({b['config'][:45]:45s}) "
                  f"{d['bf16_ms']*1e3:8.1f} {d['speedup']:9.2f} {b['speedup']:8.2f}  >= {target}")
    print("\nbest per algo (us):")
    algos = [a.value for a in A]
    print(f"{'K x N':11s} {'M':>4s} " + " ".join(f"{a:>14s}" for a in algos))
    for K, N in SHAPES:
        for M in MS:
            rows = [r for r in report["gemm"] if r["K"] == K and r["N"] == N and r["M"] == M and "w4a16_ms" in r]
            if not rows:
                continue
            cells = []
            for a in algos:
                t = [r["w4a16_ms"] for r in rows if r["used"].split()[0] == a]
                cells.append(f"{min(t) * 1e3:14.1f}" if t else f"{'-':>14s}")
            print(f"{K:5d}x{N:<5d} {M:4d} " + " ".join(cells))
    if "e2e_decode_batch1" in report and "gptq" in report["e2e_decode_batch1"]:
        e = report["e2e_decode_batch1"]
        print(f"e2e batch-1 decode step: bf16 {e['bf16']} | gptq {e['gptq']} | "
              f"speedup eager {e.get('speedup_eager_step_ms', float('nan')):.2f} graph {e.get('speedup_graph_step_ms', float('nan')):.2f}")


if __name__ == "__main__":
    main()
