"""CPU per-call latency of the entry points, in one process: stock ``model.generate()`` against patched
``model.generate()`` (with and without packed weights) and against ``paged_generate``'s loop on a warm ``LLMEngine``
held across calls.

SmolLM2-135M-Instruct in fp32 (the embedded default), greedy, ``--max-new-tokens`` (16) per row, left-padded
real prompts, at each ``--batch-sizes`` (1 and 8). Every entry point gets one warm-up call, then the calls
are interleaved (stock, patched, warm engine; the order rotated every round) so that load from other
processes falls on all of them alike; the median per call is reported, with stock / it as the speedup
(> 1: faster than stock). The greedy tokens of every entry point are checked equal to stock's.

Each entry point has its own copy of the weights (same values): patched ``generate()`` and an open engine
switch their model's attention implementation, and stock runs ``transformers.GenerationMixin.generate`` as
it was before ``patch()``. Patched ``generate()`` runs on its model's warm engine (``warm.py``), which attaches
and detaches at every call: ``patched`` has the default ``EngineConfig.cpu_prepack_weights`` (packed weights from
the second call on: the first timed call packs, the warm-up call does not), ``patched_no_prepack`` has
``cpu_prepack_weights=False`` (the plain oneDNN route, as before packing existed). The warm engine is
``run_to_completion(engine, prompts, params)`` on an engine built once and never detached, so it never packs
(``--compile-layers`` builds it with ``EngineConfig(compile_layers=True)``).

    python benchmarks/bench_cpu_entrypoints.py --output-json benchmarks/results/cpu_entrypoints.json
"""

import argparse
import json
import platform
import statistics
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationMixin

import paged_transformers
from bench_cpu import make_prompts
from paged_transformers import EngineConfig, LLMEngine, SamplingParams
from paged_transformers.default_model import default_model_path
from paged_transformers.integration.generate import run_to_completion
from paged_transformers.integration.warm import engine_for

STOCK_GENERATE = GenerationMixin.generate  # captured before patch(): stock generate() while patched


def new_tokens(sequences: torch.Tensor, prompt_len: int, eos: int) -> list[list[int]]:
    """Each row's generated tokens, cut after its first EOS (stock pads finished rows with EOS)."""
    rows = []
    for row in sequences[:, prompt_len:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


def time_calls(calls: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each entry point: one warm-up call each, then ``rounds`` interleaved rounds."""
    for call in calls.values():
        call()
    names = list(calls)
    seconds = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            calls[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def bench_batch(models: dict, engine: LLMEngine, tokenizer, batch_size: int, max_new_tokens: int, rounds: int) -> dict:
    """Time the three entry points on ``batch_size`` prompts; returns the JSON row of this batch size."""
    prompts = make_prompts(batch_size)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    prompt_len, eos = batch.input_ids.shape[1], tokenizer.eos_token_id
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    params = [SamplingParams(temperature=0.0, max_tokens=max_new_tokens)] * batch_size
    token_ids = [tokenizer(p).input_ids for p in prompts]
    results = {}

    def stock():
        with torch.inference_mode():
            results["stock"] = new_tokens(STOCK_GENERATE(models["stock"], **batch, **kwargs), prompt_len, eos)

    def patched():
        results["patched"] = new_tokens(models["patched"].generate(**batch, **kwargs), prompt_len, eos)

    def patched_no_prepack():
        out = models["patched_no_prepack"].generate(**batch, **kwargs)
        results["patched_no_prepack"] = new_tokens(out, prompt_len, eos)

    def warm_engine():
        outs = run_to_completion(engine, token_ids, params, use_tqdm=False)
        results["warm_engine"] = [o.outputs[0].token_ids for o in outs]

    seconds = time_calls({"stock": stock, "patched": patched, "patched_no_prepack": patched_no_prepack,
                          "warm_engine": warm_engine}, rounds)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    entry_points = [name for name in seconds if name != "stock"]
    return {
        "batch_size": batch_size,
        "prompt_tokens": [len(t) for t in token_ids],
        "new_tokens": [len(t) for t in results["stock"]],
        "seconds_per_call": {name: {"median": median[name], "min": min(s), "all": s} for name, s in seconds.items()},
        "speedup_vs_stock": {name: median["stock"] / median[name] for name in entry_points},
        "tokens_equal_to_stock": {name: results[name] == results["stock"] for name in entry_points},
        "patched_products_on_packed_weights": engine_for(models["patched"]).runner.cpu_linears.num_packed_products,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="rows per generate() call")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="new tokens per row (greedy; EOS stops a row)")
    parser.add_argument("--rounds", type=int, default=5, help="timed calls per entry point, after one warm-up call")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--compile-layers", action="store_true", help="the warm engine compiles its decoder layers")
    parser.add_argument("--output-json", help="write the report here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    models = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
              for name in ("stock", "patched", "patched_no_prepack", "warm_engine")}
    longest = 64 + max(args.max_new_tokens, 1)
    config = EngineConfig(max_model_len=longest, max_num_seqs=max(args.batch_sizes),
                          compile_layers=True if args.compile_layers else None)
    engine_for(models["patched_no_prepack"], tokenizer=tokenizer, engine_config=EngineConfig(cpu_prepack_weights=False))
    rows = []
    with paged_transformers.patch(), LLMEngine(models["warm_engine"], tokenizer, config) as engine:
        for batch_size in args.batch_sizes:
            rows.append(bench_batch(models, engine, tokenizer, batch_size, args.max_new_tokens, args.rounds))
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "workload": {"model": "SmolLM2-135M-Instruct (fp32)", "max_new_tokens": args.max_new_tokens, "greedy": True,
                     "rounds": args.rounds, "warm_engine_compile_layers": args.compile_layers},
        "batches": rows,
    }
    print(f"{'batch':>5}{'stock s/call':>14}{'patched':>10}{'no prepack':>12}{'warm engine':>13}"
          f"{'patched x':>11}{'no prepack x':>14}{'warm x':>9}  tokens equal")
    for row in rows:
        s, x = row["seconds_per_call"], row["speedup_vs_stock"]
        print(f"{row['batch_size']:>5}{s['stock']['median']:>14.3f}{s['patched']['median']:>10.3f}"
              f"{s['patched_no_prepack']['median']:>12.3f}{s['warm_engine']['median']:>13.3f}{x['patched']:>11.2f}"
              f"{x['patched_no_prepack']:>14.2f}{x['warm_engine']:>9.2f}  {row['tokens_equal_to_stock']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
