"""Where the first engine of a process spends its time (issue 18's <= 10 s target): the phases of
``engine_for`` and of the first ``paged_generate`` call, with Dynamo's compile times and recompile reasons, and
the decode speed the engine then has (batch 1 and 64), so that a start-up saving that costs speed shows.

    TORCH_LOGS=recompiles python research/startup_profile.py --out DIR   # on the GPU machine, twice (cold, warm cache)

Each report has the construction's Inductor / AOTAutograd cache hits and misses, and how many variants of our Triton
kernels were compiled during the construction and during each call after it. ``--variant before-compile-only``
restores the warm-ups of the tree before ``kernels.compile_only`` (decode steps of 1 and 2 sequences and a 3-token
prompt, our kernels compiled one at a time in the main thread when first launched): the A/B of ``gpu_startup_ab.sh``.
``--variant compiled``: ``EngineConfig(compile_layers=True)``, the layers compiled by Inductor although the fused eager
layers (the default for Llama-family layers) could run them. ``--variant fused-eager``: ``EngineConfig(compile_layers=False)``,
the fused eager layers (``compilation/fused_layers.py``) in decode CUDA graphs, no Inductor; ``--variant eager-graphs``: also ``fuse_projections=False``, the model's own eager
layers in decode graphs: what a start without torch.compile costs in decode speed, with and without the fused layers. ``--inductor-option
NAME=VALUE`` (repeatable) adds an Inductor option to the layers' compile (``gpu_startup_inductor.sh``'s sweep).
``--specialize-one`` traces as the tree before ``compile.tracing_settings`` did (the row count 1 specialized, duck
shapes on): the comparison behind that setting. ``--cprofile`` also writes the construction's cProfile (top 60).
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
    parser.add_argument("--variant", choices=("tree", "compiled", "before-compile-only", "fused-eager", "eager-graphs"), default="tree")
    parser.add_argument("--inductor-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an Inductor option on top of compilation.layers.INDUCTOR_OPTIONS (True/False/int)")
    args = parser.parse_args()
    if args.inductor_option:
        from paged_transformers.compilation import layers as layers_mod

        for item in args.inductor_option:
            name, value = item.split("=", 1)
            layers_mod.INDUCTOR_OPTIONS = {**layers_mod.INDUCTOR_OPTIONS, name: eval(value)}
    if args.variant == "before-compile-only":
        import contextlib

        from paged_transformers.core import runner as runner_mod

        def old_warmups(self):
            warmups = [lambda n=n: self._forward(*self._dummy_step(n)) for n in (1, min(2, self.max_num_seqs))]
            return warmups + [lambda: self._forward(*self._dummy_prefill(3))]

        runner_mod.compile_only = contextlib.nullcontext
        runner_mod.ModelRunner._warmups = old_warmups
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
    from paged_transformers.kernels import _launch

    def our_variants() -> int:  # compiled variants of our Triton kernels in this process
        import sys

        device = torch.cuda.current_device()
        mods = [m for name, m in sys.modules.items() if name.startswith("paged_transformers.kernels.")
                and name.endswith("_kernels")]
        return sum(len(k.device_caches[device][0]) for m in mods for k in _launch._kernels_of(m)
                   if device in k.device_caches)

    t0 = time.perf_counter()
    model = build_model(args.model, torch.bfloat16, "cuda")
    report = {"build_model_s": time.perf_counter() - t0}
    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    config = {"fused-eager": EngineConfig(compile_layers=False), "compiled": EngineConfig(compile_layers=True),
              "before-compile-only": EngineConfig(compile_layers=True),
              "eager-graphs": EngineConfig(compile_layers=False, fuse_projections=False)}.get(args.variant, EngineConfig())
    engine = engine_for(model, engine_config=config)
    assert engine.runner.fused_layers == (args.variant in ("tree", "fused-eager")), args.variant
    report["construction_s"] = time.perf_counter() - t0
    report["variant"] = args.variant
    report["inductor_options"] = args.inductor_option
    report["our_kernel_variants"] = {"construction": our_variants()}
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
        report["our_kernel_variants"][name] = our_variants()
        report[name + "_phases"] = dict(TIMES)
        TIMES.clear()
    for batch, new in ((1, 128), (64, 64)):  # decode speed: graph steps dominate these calls
        prompts = [torch.randint(0, 1000, (128,)).tolist() for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        t0 = time.perf_counter()
        paged_generate(model, prompts, params, use_tqdm=False)  # the first call of this batch: graph captures
        torch.cuda.synchronize()
        report[f"b{batch}_first_call_s"] = time.perf_counter() - t0
        report["our_kernel_variants"][f"b{batch}_first_call"] = our_variants()
        t0 = time.perf_counter()
        paged_generate(model, prompts, params, use_tqdm=False)
        report[f"b{batch}_ms_per_step"] = (time.perf_counter() - t0) / new * 1e3
    report["compile_times_total"] = torch._dynamo.utils.compile_times(repr="str")
    with open(f"{args.out}/startup_{args.tag}.json", "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if "compile_times" not in k}, indent=1))


if __name__ == "__main__":
    main()
