"""Where a decode step's device time goes: a kernel-by-kernel profile of the paged engine (GPU).

Usage (GPU)::

    python research/profile_decode.py --out benchmarks/results/profile_decode_h200.json

1. Llama-3-8B shape, random bf16 weights (``--quantization gptq|awq``: random 4-bit group-128 weights of that
   format), the engine's defaults (CUDA graphs on), once with the decoder
   layers compiled (``compile_layers=True``) and once uncompiled (``compile_layers=False``: with ``--fuse on`` the
   fused eager layers, the engine's default for Llama since 2026-12-06; ``--compile`` picks). For each batch
   size in ``--batches`` (default 1 and 256): that many requests of ``--context`` prompt tokens are
   prefilled, then ``--steps`` decode steps (CUDA-graph replays) run under ``torch.profiler``; kernels are
   grouped by name and reported as microseconds and launches per step, next to the step's wall time.
   Then one prefill step of ``max_num_batched_tokens`` (8 prompts of 1024 tokens) is profiled the same way.
   ``--fuse`` picks fused q|k|v and gate|up projections in the compiled layers (``fuse_projections``):
   ``on`` (the default, the engine's), ``off``, or ``both``, which profiles the compiled engine twice,
   fused and not; each run also reports the GEMM kernels' (cuBLAS/cuBLASLt) device time and launches per
   step. With ``--fuse both``, a one-layer model of each ``--check-shapes`` is first checked alone
   (``fusion_check``): compiled with and without fusion, its Inductor code must call 4 instead of 7 GEMMs per graph, and both outputs must match the
   eager layer (bf16 tolerance) at 1 and 256 tokens.
   E.g. ``python research/profile_decode.py --compile on --fuse both --out $OUT/fusion.json`` (~2 min).
   (The batch-1 GEMV against cuBLAS and Inductor's ``combo_kernels`` on and off were profiled with this script at
   commit f457c60, ``--decode-gemv`` / ``--combo-kernels``; docs/benchmark-history.md has the numbers.)
2. cuBLAS bf16 GEMV/GEMM times (``torch.matmul``, ``triton.testing.do_bench`` median, weights rotated over
   sets larger than L2) for the Llama-3-8B projections, separate and fused (q|k|v, gate|up), at M = 1
   and M = 256, as achieved bytes/s of the weight.
"""

import argparse
import collections
import gc
import json
import re
import time

import torch


def kernel_table(prof, num_steps: int, top: int = 25) -> list[dict]:
    """Device kernels of a profile grouped by name: microseconds and launches per step."""
    total = collections.defaultdict(float)
    count = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time
            count[ev.name] += 1
    rows = [{"kernel": name[:110], "us_per_step": t / num_steps, "launches_per_step": count[name] / num_steps}
            for name, t in total.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top] + [{"kernel": "ALL", "us_per_step": sum(total.values()) / num_steps,
                          "launches_per_step": sum(count.values()) / num_steps}]


GEMM_KERNEL = re.compile(r"nvjet|gemm|gemv|splitKreduce|cutlass|xmma|w4a16", re.IGNORECASE)


def gemm_summary(prof, num_steps: int) -> dict:
    """Device time (us) and launches per step of the matmul kernels (names matching ``GEMM_KERNEL``)."""
    us = launches = 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and GEMM_KERNEL.search(ev.name):
            us += ev.device_time
            launches += 1
    return {"us_per_step": us / num_steps, "launches_per_step": launches / num_steps}


def fusion_check(shape: str = "llama-3-8b", tokens: tuple[int, ...] = (1, 256), device: str = "cuda") -> dict:
    """Decoder layer 0 of a one-layer model of ``shape`` (``MODEL_SHAPES``, random bf16, stock SDPA
    attention), compiled with and without fused projections: GEMM calls in each generated graph, and max
    |difference| to the eager unfused layer over ``tokens``-token inputs."""
    import transformers
    from torch._inductor.utils import run_and_get_code

    from paged_transformers.bench import MODEL_SHAPES
    from paged_transformers.compilation.fusion import (
        COMPILE_OPTIONS,
        fuse_projections,
        unfuse_projections,
    )
    from paged_transformers.compilation.layers import INDUCTOR_OPTIONS, decoder_layers

    arch, fields = MODEL_SHAPES[shape]
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls._from_config(config_cls(**{**fields, "num_hidden_layers": 1}), dtype=torch.bfloat16).eval()
    if arch == "qwen2":  # random q/k/v biases (initialized to 0), so a bias mix-up would show
        for name in ("q_proj", "k_proj", "v_proj"):
            torch.nn.init.normal_(getattr(model.model.layers[0].self_attn, name).bias, std=0.02)
    layer = decoder_layers(model)[0]
    g = torch.Generator(device=device).manual_seed(0)
    cases = []
    for T in tokens:
        x = torch.randn(1, T, model.config.hidden_size, device=device, dtype=torch.bfloat16, generator=g)
        pos = torch.arange(T, device=device)[None]
        cases.append((x, {"position_embeddings": model.model.rotary_emb(x, pos), "attention_mask": None, "position_ids": pos}))
    out: dict = {"shape": shape, "tokens": list(tokens)}
    with torch.no_grad():
        ref = [layer(x, **kw) for x, kw in cases]
        handle = None
        for name in ("unfused", "fused"):
            if name == "fused":
                handle = fuse_projections(model)
                out["groups_fused"] = handle.num_fused
            torch._dynamo.reset()
            fn = torch.compile(layer.forward, dynamic=True,
                               options={**INDUCTOR_OPTIONS, **(COMPILE_OPTIONS if name == "fused" else {})})
            got, code = run_and_get_code(lambda fn=fn: [fn(x, **kw) for x, kw in cases])
            # one generated module per compiled graph (1 token and n tokens specialize apart)
            out[f"{name}_gemm_calls"] = [len(re.findall(r"extern_kernels\.(?:mm|addmm|bmm)\(", c)) for c in code]
            out[f"{name}_max_abs_err"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref))
        unfuse_projections(handle)
    out["ref_max_abs"] = max(float(r.float().abs().max()) for r in ref)
    # bf16: both compiled variants differ from eager by rounding only; fusion must not add more than that
    out["ok"] = set(out["unfused_gemm_calls"]) == {7} and set(out["fused_gemm_calls"]) == {4} and \
        out["fused_max_abs_err"] <= max(2 * out["unfused_max_abs_err"], 2e-2 * out["ref_max_abs"])
    del model, layer, handle
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return out


def profile_engine(batches: list[int], context: int, steps: int, compile_layers: bool, fuse: bool | None = None,
                   quantization: str | None = None) -> dict:
    from paged_transformers.bench import build_model
    from paged_transformers.config import EngineConfig
    from paged_transformers.core.engine import LLMEngine
    from paged_transformers.sampling_params import SamplingParams

    model = build_model("llama-3-8b", torch.bfloat16, "cuda", quantization, 4, 128)
    model.generation_config.eos_token_id = None
    t0 = time.perf_counter()
    torch._dynamo.utils.counters.clear()
    engine = LLMEngine(model, engine_config=EngineConfig(max_model_len=2048, compile_layers=compile_layers,
                                                         fuse_projections=fuse))
    compilation = engine.runner.compilation
    fusion = compilation.fusion if compilation is not None else None
    # graphs Dynamo made for the layers: the same with and without fusion unless the fused modules made
    # it recompile per layer (which past the recompile limit would leave layers eager)
    out = {"init_s": time.perf_counter() - t0, "compiled_layers": len(compilation.modules) if compilation else 0,
           "compile_error": compilation.compile_error if compilation else None, "fused_groups": fusion.num_fused if fusion else 0,
           "dynamo_unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    for B in batches:
        for i in range(B):
            prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
            engine.add_request(f"b{B}-{i}", prompt, SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True))
        # prefill (several chunks at large B) and a few decode steps to warm up
        while True:
            engine.step()
            seqs = engine.scheduler.running
            if len(seqs) == B and all(s.num_computed_tokens + 1 == s.num_tokens + s.num_output_placeholders for s in seqs):
                break
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        walls = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
        plain = []  # without the profiler or extra syncs (the step syncs on the sampled tokens anyway)
        for _ in range(8):
            t0 = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - t0)
        nosync_ms = sorted(plain)[len(plain) // 2] * 1e3
        while engine.has_unfinished_requests():
            engine.step()
        walls.sort()
        out[f"batch{B}"] = {"context": context, "steps": steps, "wall_ms_p50_synced": walls[len(walls) // 2] * 1e3,
                           "wall_ms_p50_plain": nosync_ms, "graphs": sorted(engine.runner.graphs.graphs) if engine.runner.graphs else [],
                           "gemm": gemm_summary(prof, steps), "kernels": kernel_table(prof, steps)}
    # one prefill step: 8 prompts of 1024 tokens = the 8192-token budget
    for i in range(8):
        engine.add_request(f"p{i}", torch.randint(0, vocab, (1024,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    out["prefill8x1024"] = {"wall_ms_p50_synced": wall * 1e3, "wall_ms_p50_plain": float("nan"),
                            "gemm": gemm_summary(prof, 1), "kernels": kernel_table(prof, 1)}
    engine.close()
    del engine, model
    gc.collect()  # the engine holds reference cycles (scheduler -> engine callbacks)
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    out["memory_left_gib"] = torch.cuda.memory_allocated() / 2**30
    return out


def gemv_table() -> list[dict]:
    from triton.testing import do_bench

    shapes = {"q": (4096, 4096), "k|v": (4096, 1024), "qkv fused": (4096, 6144), "o": (4096, 4096),
              "gate|up": (4096, 14336), "gate+up fused": (4096, 28672), "down": (14336, 4096), "lm_head": (4096, 128256)}
    rows = []
    for M in (1, 256):
        for name, (K, N) in shapes.items():
            nbytes = K * N * 2
            sets = max(2, -(-300_000_000 // nbytes))
            ws = [torch.randn(K, N, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            it = iter(range(10**9))
            ms = do_bench(lambda: x @ ws[next(it) % sets], warmup=25, rep=100, return_mode="median")
            rows.append({"M": M, "proj": name, "K": K, "N": N, "us": ms * 1e3, "weight_TBps": nbytes / (ms * 1e-3) / 1e12})
            del ws
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", choices=["on", "off", "both"], default="both")
    ap.add_argument("--fuse", choices=["on", "off", "both"], default="on",
                    help="fused q|k|v and gate|up in the compiled layers (ignored for compile off)")
    ap.add_argument("--check-shapes", nargs="*", default=["llama-3-8b"],
                    help="with --fuse both: one-layer models checked by fusion_check first (e.g. llama-3-8b qwen2.5-7b)")
    ap.add_argument("--gemv", action="store_true", help="also time the cuBLAS projections (part 2)")
    ap.add_argument("--quantization", choices=["gptq", "awq"], default=None,
                    help="random 4-bit group-128 weights of that format (build_model) instead of bf16, for the engine "
                         "profiles (part 1); --gemv and the --fuse both check stay bf16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode needs a CUDA GPU")
    import triton

    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "args": vars(args)}
    report["gemv"] = gemv_table() if args.gemv else []
    print(f"{'M':>4} {'proj':<14} {'us':>8} {'TB/s':>6}")
    for r in report["gemv"]:
        print(f"{r['M']:>4} {r['proj']:<14} {r['us']:8.1f} {r['weight_TBps']:6.2f}")
    report["fusion_check"] = []
    for shape in args.check_shapes if args.fuse == "both" and args.compile != "off" else []:
        check = fusion_check(shape)
        report["fusion_check"].append(check)
        print(f"fusion_check {shape}: GEMM calls per layer graph {check['unfused_gemm_calls']} -> {check['fused_gemm_calls']}, "
              f"max |err| vs eager {check['unfused_max_abs_err']:.3g} unfused / {check['fused_max_abs_err']:.3g} fused "
              f"(|ref| max {check['ref_max_abs']:.3g}): {'OK' if check['ok'] else 'FAILED'}")
    report["engine"] = {}
    fuses = {"on": [True], "off": [False], "both": [True, False]}[args.fuse]
    modes = [(c, f if c else False) for c in {"on": [True], "off": [False], "both": [True, False]}[args.compile]
             for f in (fuses if c else [False])]
    for m, fuse in modes:
        mode = f"compile_{'on' if m else 'off'}" + (f"_fuse_{'on' if fuse else 'off'}" if m else "")
        cases = report["engine"][mode] = profile_engine(args.batches, args.context, args.steps, m, fuse,
                                                        args.quantization)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        print(f"\n== {mode}: init {cases['init_s']:.1f} s, compiled layers {cases['compiled_layers']}, "
              f"fused groups {cases['fused_groups']}, Dynamo graphs {cases['dynamo_unique_graphs']}, error {cases['compile_error']}, memory left after close {cases['memory_left_gib']:.2f} GiB")
        for name, e in cases.items():
            if not isinstance(e, dict):
                continue
            print(f"{name}: wall p50 {e['wall_ms_p50_synced']:.2f} ms (synced), {e['wall_ms_p50_plain']:.2f} ms p50 without profiler; "
                  f"GEMM {e['gemm']['us_per_step']:.1f} us in {e['gemm']['launches_per_step']:.0f} launches per step")
            for r in e["kernels"][:12] + e["kernels"][-1:]:
                print(f"  {r['us_per_step']:9.1f} us {r['launches_per_step']:6.1f}x  {r['kernel'][:90]}")


    if len(report["engine"]) > 1:  # the short table: device time per step of each mode
        print(f"\n{'mode':<56} {'case':<14} {'device us/step':>14} {'kernels':>8} {'GEMM us':>9} {'GEMM launches':>13} "
              f"{'wall ms':>8} {'plain ms':>8}")
        for mode, cases in report["engine"].items():
            for name, e in cases.items():
                if isinstance(e, dict) and "kernels" in e:
                    print(f"{mode:<56} {name:<14} {e['kernels'][-1]['us_per_step']:14.1f} "
                          f"{e['kernels'][-1]['launches_per_step']:8.0f} {e['gemm']['us_per_step']:9.1f} "
                          f"{e['gemm']['launches_per_step']:13.0f} {e['wall_ms_p50_synced']:8.2f} {e['wall_ms_p50_plain']:8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
