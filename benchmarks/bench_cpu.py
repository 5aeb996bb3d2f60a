"""CPU throughput: 32 SmolLM2 prompts through paged_generate vs stock ``model.generate()``, one process.

Stock generate runs (a) one prompt at a time and (b) in left-padded batches. Greedy decoding, same
``max_new_tokens`` for every engine; EOS is masked until then (``min_tokens`` / ``min_new_tokens``), so every
engine makes the same number of tokens and the greedy tokens can be compared.
Prints a table and writes JSON (``--output-json``).

    python benchmarks/bench_cpu.py --output-json benchmarks/results/cpu_smollm2.json
"""

import argparse
import json
import platform
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from paged_transformers import EngineConfig, SamplingParams, paged_generate
from paged_transformers.default_model import default_model_path

SUBJECTS = [
    "The capital of France is", "Once upon a time, there was a little", "def fibonacci(n):",
    "The three primary colors are", "Water boils at", "The largest planet in our solar system is",
    "In 1969, humans first", "A good breakfast includes", "The theory of relativity says",
    "To make a cup of tea, first", "The best way to learn a language is", "Photosynthesis is the process",
    "My favourite book is", "The Great Wall of China", "import numpy as np\n", "The ocean is home to",
]


def make_prompts(n: int) -> list[str]:
    return [SUBJECTS[i % len(SUBJECTS)] + ("" if i < len(SUBJECTS) else " Indeed,") for i in range(n)]


def stock_generate(model, tokenizer, prompts, max_new_tokens, batch_size):
    outs = []
    tokenizer.padding_side = "left"
    for i in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True)
        seqs = model.generate(
            **batch, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        outs += seqs[:, batch.input_ids.shape[1] :].tolist()
    return outs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="padded batch size for stock generate")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(args.num_prompts)
    num_out = args.num_prompts * args.max_tokens

    results = {}
    # min_tokens masks EOS like stock's min_new_tokens (ignore_eos would let EOS be sampled and continue)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    paged_generate(model, prompts[:2], params, tokenizer=tokenizer, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    paged = paged_generate(model, prompts, params, tokenizer=tokenizer, engine_config=EngineConfig(), use_tqdm=False)
    results["paged"] = time.perf_counter() - t
    with torch.inference_mode():
        t = time.perf_counter()
        one = stock_generate(model, tokenizer, prompts, args.max_tokens, batch_size=1)
        results["hf_generate_bs1"] = time.perf_counter() - t
        t = time.perf_counter()
        stock_generate(model, tokenizer, prompts, args.max_tokens, batch_size=args.batch_size)
        results[f"hf_generate_bs{args.batch_size}"] = time.perf_counter() - t
    same = sum(p.outputs[0].token_ids == o for p, o in zip(paged, one))

    rows = {name: {"seconds": s, "output_tokens_per_s": num_out / s} for name, s in results.items()}
    for name in rows:
        rows[name]["paged_speedup"] = results[name] / results["paged"]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "workload": {"model": "SmolLM2-135M-Instruct (fp32)", "num_prompts": args.num_prompts,
                     "max_tokens": args.max_tokens, "min_tokens": args.max_tokens, "greedy": True},
        "engines": rows,
        "paged_equal_to_stock_bs1": f"{same}/{len(prompts)} prompts token-identical",
    }
    print(f"{'engine':<18}{'seconds':>10}{'out tok/s':>12}{'paged is x faster':>20}")
    for name, row in rows.items():
        print(f"{name:<18}{row['seconds']:>10.2f}{row['output_tokens_per_s']:>12.1f}{row['paged_speedup']:>20.2f}")
    print(report["paged_equal_to_stock_bs1"])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
