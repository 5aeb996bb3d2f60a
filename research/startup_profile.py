"""Where the first engine of a process spends its time (issue 18's <= 10 s target): the phases of
``engine_for`` and of the first ``paged_generate`` call, with Dynamo's compile times and recompile reasons, and
the decode speed the engine then has (batch 1 and 64), so that a start-up saving that costs speed shows.

    TORCH_LOGS=recompiles python research/startup_profile.py --out DIR   # on the GPU machine, twice (cold, warm cache)

Each report has the construction's Inductor / AOTAutograd cache hits and misses. ``--specialize-one`` traces as the
tree before ``compile.tracing_settings`` did (the row count 1 specialized, duck shapes on): the comparison behind
that setting. ``--cprofile`` also writes the construction's cProfile (top 60).
"""

import argparse
import json
import time

import torch

TIMES: dict[str, float] = {}


def timed(owner, name: str) -> None:
    """Wrap ``owner.name`` so its wall time adds up in ``TIMES[name]`` (seconds)."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] = TIMES.get(name, 0.0) + time.perf_counter() - t0

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--out", default=".")
    parser.add_argument("--tag", default="run")
    parser.add_argument("--specialize-one", action="store_true")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    if args.specialize_one:
        import torch.fx.experimental._config as fx_config

        from paged_transformers.compilation import layers as compile_mod

        def old_settings():
            return torch._dynamo.config.patch(recompile_limit=64)

        compile_mod.tracing_settings = old_settings
        assert not fx_config.backed_size_oblivious
    import torch._dynamo.utils

    from paged_transformers import EngineConfig, SamplingParams, paged_generate
    from paged_transformers.core import runner as runner_mod
    from paged_transformers.core import sizing
    from paged_transformers.integration import cache as cache_mod
    from paged_transformers.compilation import cuda_graphs as cuda_graphs_mod
    from paged_transformers.bench.workload import build_model
    from paged_transformers.integration.warm import engine_for

    timed(sizing, "profile_activation_bytes")
    timed(cache_mod.PagedCache, "__init__")
    timed(runner_mod.ModelRunner, "_compile")
    timed(cuda_graphs_mod.DecodeGraphs, "record")
    timed(runner_mod.ModelRunner, "_forward")
    t0 = time.perf_counter()
    model = build_model(args.model, torch.bfloat16, "cuda")
    report = {"build_model_s": time.perf_counter() - t0}
    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    engine_for(model, engine_config=EngineConfig())
    report["construction_s"] = time.perf_counter() - t0
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
        with open(f"{args.out}/startup_{args.tag}_cprofile.txt", "w") as f:
            f.write(text.getvalue())
    report["construction_phases"] = dict(TIMES)
    report["compile_times_construction"] = torch._dynamo.utils.compile_times(repr="str")
    report["cache_counters_construction"] = {  # the Inductor / AOTAutograd cache hits and misses, PGO's reads
        group: {k: v for k, v in torch._dynamo.utils.counters[group].items() if "cache" in k or "pgo" in k}
        for group in ("inductor", "aot_autograd", "dynamo")}
    TIMES.clear()
    prompt = torch.randint(0, 1000, (128,)).tolist()
    for name in ("first_call", "second_call"):
        t0 = time.perf_counter()
        paged_generate(model, [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        report[name + "_s"] = time.perf_counter() - t0
        report[name + "_phases"] = dict(TIMES)
        TIMES.clear()
    for batch, new in ((1, 128), (64, 64)):  # decode speed: graph steps dominate these calls
        prompts = [torch.randint(0, 1000, (128,)).tolist() for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        paged_generate(model, prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        paged_generate(model, prompts, params, use_tqdm=False)
        report[f"b{batch}_ms_per_step"] = (time.perf_counter() - t0) / new * 1e3
    report["compile_times_total"] = torch._dynamo.utils.compile_times(repr="str")
    with open(f"{args.out}/startup_{args.tag}.json", "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if "compile_times" not in k}, indent=1))


if __name__ == "__main__":
    main()
