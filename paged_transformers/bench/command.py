"""``paged-transformers bench``: offline throughput of the paged engine against stock transformers.

The command: its options (``add_arguments``), the run (``run_bench``), the report file and the table
(``bench_main``), shared by ``paged-transformers bench`` and ``python -m paged_transformers.bench``.
"""

import argparse
import functools
import json
import sys
import time
from dataclasses import asdict

import torch

from ..config import EngineConfig
from .engines import ENGINES, _peak_reset, run_hf_cb, run_hf_generate, run_paged
from .report import device_info, format_table, ratios, summarize, versions
from .roofline import measure_device_peaks, model_costs, workload_roofline
from .workload import MODEL_SHAPES, BenchRequest, build_model, load_jsonl, synthetic_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options (shared by ``paged-transformers bench`` and ``python -m paged_transformers.bench``)."""
    default = EngineConfig()
    parser.add_argument("--model", default="llama-3-8b",
                        help=f"a named shape with random weights ({', '.join(MODEL_SHAPES)}) or a checkpoint path")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="activation and (non-quantized) weight dtype")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda when present, else cpu")
    parser.add_argument("--quantization", choices=["gptq", "awq"], default=None,
                        help="random quantized weights of a named shape; None: plain weights")
    parser.add_argument("--bits", type=int, default=4, help="bits per quantized weight (with --quantization)")
    parser.add_argument("--group-size", type=int, default=128,
                        help="weights per quantization group (with --quantization)")
    parser.add_argument("--num-requests", type=int, default=256, help="requests of the synthetic workload")
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[64, 1024], metavar=("LOW", "HIGH"),
                        help="prompt lengths, tokens, drawn uniformly (both ends included)")
    parser.add_argument("--output-len-range", type=int, nargs=2, default=[16, 512], metavar=("LOW", "HIGH"),
                        help="output lengths, tokens, drawn uniformly (both ends included)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the random weights")
    parser.add_argument("--dataset", default=None,
                        help='JSONL of {"prompt": text or ids, "output_len": n}; None: the synthetic workload')
    parser.add_argument("--compare", default="", help="comma list of hf-generate, hf-cb; empty: the paged engine only")
    parser.add_argument("--compare-num-requests", type=int, default=None,
                        help="run the compared engines on the first N requests only; None: all")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of hf-generate")
    parser.add_argument("--block-size", type=int, default=default.block_size, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="most sequences in one step; None: by device, as vLLM's LLM (EngineConfig)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="most tokens in one step; None: by device, as vLLM's LLM (EngineConfig)")
    parser.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                        help="largest decode step replayed from a CUDA graph; None: min(2 * max_num_seqs, 512)")
    parser.add_argument("--max-model-len", type=int, default=None, help="tokens; None: the longest request, rounded up")
    parser.add_argument("--gpu-memory-utilization", type=float, default=default.gpu_memory_utilization,
                        help="share of the device memory for weights, activations and the KV pool")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="KV pool size, blocks; None: from the memory")
    parser.add_argument("--attention-backend", choices=["auto", "triton", "torch"], default="auto",
                        help="auto: Triton on CUDA, PyTorch on CPU")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (and, without --compile, no compiled layers)")
    compile_group = parser.add_mutually_exclusive_group()
    compile_group.add_argument("--compile", action="store_true",
                               help="torch.compile the decoder layers (compile_layers=True) even where the fused eager "
                                    "layers apply; neither flag: compile_layers=None, the fused eager layers on CUDA "
                                    "where they apply, else compiled layers with CUDA graphs")
    compile_group.add_argument("--no-compile", action="store_true",
                               help="never torch.compile the decoder layers (compile_layers=False: the fused eager "
                                    "layers where they apply, else the model's own)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="enable_prefix_caching=False")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks the model is split over (one process each; --model must be a checkpoint path)")
    parser.add_argument("--sweep", action="append", default=[], metavar="FIELD=V1,V2",
                        help="also run the paged engine for each value of an EngineConfig field (repeatable; "
                             "the product of all sweeps: single values give one point, e.g. a set of limits), each "
                             "with the batch-1 decode unless --no-batch1; results under 'sweep'")
    parser.add_argument("--skip-paged", action="store_true", help="only the compared engines")
    parser.add_argument("--no-batch1", action="store_true", help="skip the batch-1 decode measurement")
    parser.add_argument("--entry-points", action="store_true",
                        help="instead of the throughput run: time the public entry points (patched generate(), "
                             "pipeline, paged_generate) per call the way user code calls them, side by side with "
                             "stock (paged_transformers.bench.calls)")
    parser.add_argument("--repeats", type=int, default=3, help="with --entry-points: timed calls per scenario (median)")
    parser.add_argument("--output-json", default=None, help="write the report here; None: the table only")


def compile_layers_arg(args) -> bool | None:
    """``EngineConfig.compile_layers`` from ``--compile`` / ``--no-compile``: True / False, None when neither is given."""
    return True if args.compile else False if args.no_compile else None


def _engine_config(args, requests: list[BenchRequest], **overrides) -> EngineConfig:
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    fields = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_cudagraph_capture_size=args.max_cudagraph_capture_size,
                  max_model_len=args.max_model_len or -(-longest // 256) * 256,
                  gpu_memory_utilization=args.gpu_memory_utilization, num_gpu_blocks=args.num_gpu_blocks,
                  attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                  compile_layers=compile_layers_arg(args), tensor_parallel_size=args.tensor_parallel_size)
    if args.no_prefix_caching and "enable_prefix_caching" in EngineConfig.__dataclass_fields__:
        fields["enable_prefix_caching"] = False
    fields.update(overrides)
    return EngineConfig(**fields)


def _config_dict(config: EngineConfig) -> dict:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in asdict(config).items()}


def _sweep_points(sweeps: list[str]) -> list[dict]:
    import itertools

    axes = []
    for spec in sweeps:
        name, _, values = spec.partition("=")
        if name not in EngineConfig.__dataclass_fields__ or not values:
            raise ValueError(f"--sweep wants FIELD=V1,V2 with an EngineConfig field, got {spec!r}")
        axes.append([(name, _sweep_value(v)) for v in values.split(",")])
    return [dict(point) for point in itertools.product(*axes)] if axes else []


def _sweep_value(text: str) -> int | bool:
    """A sweep value: ``true``/``false`` for bool fields, else an integer."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return int(text)


def _save_partial(report: dict, args) -> None:
    """Write what is measured so far (a long run killed later still leaves its first engines' numbers)."""
    print(f"[bench] done: {', '.join(report['engines'])}", file=sys.stderr, flush=True)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


def run_bench(args) -> dict:
    """Run the benchmark described by ``args`` (see ``add_arguments``); returns the report dict."""
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    compare = [c.strip().replace("-", "_") for c in args.compare.split(",") if c.strip()]
    for c in compare:
        if c not in ENGINES[1:]:
            raise ValueError(f"--compare takes hf-generate and/or hf-cb, got {c!r}")
    if args.compare_num_requests is not None and args.compare_num_requests <= 0:
        raise ValueError(f"--compare-num-requests must be positive (leave it out for all requests), got {args.compare_num_requests}")
    peaks = measure_device_peaks(args.device)
    t0 = time.perf_counter()
    engines = _ParallelEngines(args, dtype) if args.tensor_parallel_size > 1 else None
    model = engines.model if engines else build_model(args.model, dtype, args.device, args.quantization, args.bits,
                                                      args.group_size)
    model.generation_config.eos_token_id = None  # EOS ignored by every engine
    build_s = time.perf_counter() - t0
    vocab = model.config.get_text_config().vocab_size
    if args.dataset:
        tokenizer = None
        if args.model not in MODEL_SHAPES:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.model)
        requests = load_jsonl(args.dataset, tokenizer)
    else:
        requests = synthetic_workload(args.num_requests, tuple(args.input_len_range), tuple(args.output_len_range),
                                      vocab, args.seed)
    config = _engine_config(args, requests)
    costs = model_costs(model)
    report = {
        "command": "paged-transformers bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": versions(),
        "device": {**device_info(args.device), **peaks},
        "model": {"name": args.model, "dtype": args.dtype, "quantization": args.quantization, "build_s": build_s,
                  **costs},
        "workload": {"num_requests": len(requests), "dataset": args.dataset,
                     "input_len_range": None if args.dataset else list(args.input_len_range),
                     "output_len_range": None if args.dataset else list(args.output_len_range),
                     "seed": args.seed, "ignore_eos": True,
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                     "output_tokens": sum(r.output_len for r in requests)},
        "engine_config": _config_dict(config),
        "engines": {},
    }
    paged_result = None
    if not args.skip_paged:
        try:
            paged_result = run_paged(model, requests, config, batch1_context=None if args.no_batch1 else 512,
                                     make_engine=engines and functools.partial(engines.make, config))
            report["engines"]["paged"] = summarize(paged_result)
        except Exception as e:  # keep the compared engines' numbers
            report["engines"]["paged"] = {"error": f"{type(e).__name__}: {e}"}
        _save_partial(report, args)
    subset = requests[: args.compare_num_requests] if args.compare_num_requests else requests
    runners = {"hf_generate": lambda: run_hf_generate(model, subset, args.hf_batch_size),
               "hf_cb": lambda: run_hf_cb(model, subset)}
    for name in compare:
        try:
            result = runners[name]()
            entry = summarize(result)
            if len(subset) < len(requests):
                entry["subset"] = f"first {len(subset)} of the {len(requests)} requests"
            if paged_result is not None:
                n = len(subset)
                same = sum(a[:1] == b[:1] for a, b in zip(paged_result.output_token_ids[:n], result.output_token_ids))
                entry["first_token_agreement_with_paged"] = same / n
            report["engines"][name] = entry
        except Exception as e:  # keep the other engines' numbers
            report["engines"][name] = {"error": f"{type(e).__name__}: {e}"}
        _peak_reset(args.device)
        _save_partial(report, args)
    report["ratios"] = ratios({k: v for k, v in report["engines"].items() if "error" not in v})
    if peaks["copy_bytes_per_s"]:
        roof = workload_roofline(requests, costs, peaks["copy_bytes_per_s"], peaks["matmul_flops_per_s"])
        if "output_tokens_per_s" in report["engines"].get("paged", {}):
            roof["paged_fraction"] = report["engines"]["paged"]["output_tokens_per_s"] / roof["output_tokens_per_s"]
        report["roofline"] = roof
        b1 = report["engines"].get("paged", {}).get("decode_batch1")
        if b1:
            bound = costs["weight_bytes_per_step"] / peaks["copy_bytes_per_s"]
            report["decode_batch1"] = {**b1, "bound_s": bound, "ratio_to_bound": b1["tpot_s_p50"] / bound}
    else:
        report["roofline"] = {"output_tokens_per_s": None, "note": "no CUDA device: ceilings not measured"}
    if args.sweep and not args.skip_paged:
        report["sweep"] = []
        for point in _sweep_points(args.sweep):
            cfg = _engine_config(args, requests, **point)
            res = summarize(run_paged(model, requests, cfg, batch1_context=None if args.no_batch1 else 512,
                                      make_engine=engines and functools.partial(engines.make, cfg)))
            report["sweep"].append({**point, "output_tokens_per_s": res["output_tokens_per_s"],
                                    "tpot_s_p50": res["tpot_s"]["p50"], "ttft_s_p50": res["ttft_s"]["p50"],
                                    "kv_capacity_tokens": res["kv_capacity_tokens"], "engine_limits": res["engine_limits"],
                                    "decode_batch1_s_p50": (res.get("decode_batch1") or {}).get("tpot_s_p50"),
                                    "step_overhead": res["step_overhead"]})
            _save_partial(report, args)
    return report


class _ParallelEngines:
    """``--tensor-parallel-size N``: each run's engine is rank 0's ``DriverEngine`` (``distributed.start_engine``,
    which starts the other ranks), closed after the run. ``model`` is a meta-device skeleton of the checkpoint (the
    vocabulary and the report's model costs: the whole model's, not a rank's).

    Raises:
        ValueError: a named shape (each rank loads a checkpoint), ``--compare`` (stock engines do not split) or
            ``--quantization``.
    """

    def __init__(self, args, dtype: torch.dtype):
        if args.model in MODEL_SHAPES or args.compare or args.quantization:
            raise ValueError("--tensor-parallel-size > 1 needs --model as a checkpoint path, without --compare or --quantization")
        from transformers import AutoConfig

        from ..hub import resolve_model_path
        from ..quantization.loader import build_skeleton

        self.args, self.dtype, self.folder = args, dtype, resolve_model_path(args.model)
        self.model = build_skeleton(AutoConfig.from_pretrained(self.folder), dtype)

    def make(self, config: EngineConfig):
        from ..distributed import start_engine

        engine = start_engine(self.folder, tokenizer=None, skip_tokenizer_init=True, trust_remote_code=False,
                              dtype=self.dtype, quantization=None, device=torch.device(self.args.device), engine_config=config)
        engine.attach()
        return engine


def _refuse_large_shape_on_cpu(args) -> None:
    """A named shape other than ``tiny-llama`` on a CPU device (the default device without CUDA) would build a random
    7-8B model (14-16 GB in bfloat16) and run it for hours: refuse it before anything is built. With
    ``--tensor-parallel-size`` > 1 the parallel engines refuse every named shape themselves, with their own message.

    Raises:
        ValueError: naming the shape, its size (GB, from its parameter count) and ``--model tiny-llama``.
    """
    if (args.model not in MODEL_SHAPES or args.model == "tiny-llama" or args.tensor_parallel_size > 1
            or torch.device(args.device).type != "cpu"):
        return
    shape = MODEL_SHAPES[args.model][1]
    hidden, layers, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hidden // heads
    params = (2 * shape["vocab_size"] * hidden
              + layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * shape["intermediate_size"]))
    raise ValueError(
        f"--model {args.model} on {args.device} would build a random {params / 1e9:.1f}B-parameter model "
        f"({params * torch.finfo(getattr(torch, args.dtype)).bits / 8e9:.0f} GB in {args.dtype}) and run it on the CPU "
        "for hours; for a CPU smoke run give --model tiny-llama (e.g. paged-transformers bench --model tiny-llama "
        "--num-requests 8), or a checkpoint path, or run on a CUDA device")


def bench_main(args) -> int:
    """``paged-transformers bench``: run, write ``--output-json``, print the table last.

    Raises:
        ValueError: a large named shape on a CPU device (``_refuse_large_shape_on_cpu``), or a bad option.
    """
    _refuse_large_shape_on_cpu(args)
    if args.entry_points:
        from .calls import format_entry_points, run_entry_points

        report = run_entry_points(args)
        report["command"] = "paged-transformers bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
        if args.output_json:
            with open(args.output_json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)
        print(format_entry_points(report))
        return 0
    report = run_bench(args)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    for row in report.get("sweep", []):
        print("sweep", {k: v for k, v in row.items() if k != "step_overhead"})
    print(format_table(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paged-transformers bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return bench_main(parser.parse_args(argv))
