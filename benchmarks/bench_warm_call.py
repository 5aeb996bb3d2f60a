"""Host overhead of one call on the warm engine, beyond the engine's own steps.

Random weights from a config (no download): ``--shape tiny`` (2 layers, hidden 64: the steps cost little, so
the overhead shows), ``smollm2`` (SmolLM2-135M: 30 layers, hidden 576) or ``llama3-8b``. Measures, as the median over ``--calls`` calls after a warm-up call:

- ``attach_detach_ms``: ``with attached_engine(model): pass`` (lock, weight snapshot and check, attach, detach);
- ``patched_generate_ms`` and ``steps_ms``: a patched ``model.generate()`` of ``--rows`` rows, and the time spent
  inside ``LLMEngine.step`` during it; ``overhead_ms`` is their difference (argument handling, request setup,
  output assembly, attach / detach).

    python benchmarks/bench_warm_call.py --shape tiny --device cpu
    python benchmarks/bench_warm_call.py --shape smollm2 --device cpu
    python benchmarks/bench_warm_call.py --shape llama3-8b --device cuda --dtype bfloat16
"""

import argparse
import json
import statistics
import time

import torch
import transformers

import paged_transformers
from paged_transformers import LLMEngine
from paged_transformers.integration.warm import attached_engine

SHAPES = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
}


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[args.shape], eos_token_id=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).to(args.device, getattr(torch, args.dtype)).eval()
    ids = torch.randint(3, config.vocab_size, (args.rows, args.prompt_len), device=args.device)
    mask = torch.ones_like(ids)

    step_time = [0.0]
    original_step = LLMEngine.step

    def timed_step(self):
        start = time.perf_counter()
        try:
            return original_step(self)
        finally:
            step_time[0] += time.perf_counter() - start

    LLMEngine.step = timed_step
    calls, steps, attaches = [], [], []
    with paged_transformers.patch():
        for i in range(args.calls + 1):
            step_time[0] = 0.0
            start = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                           do_sample=False)
            if i:  # the first call builds the engine
                calls.append(time.perf_counter() - start)
                steps.append(step_time[0])
        for _ in range(args.calls):
            start = time.perf_counter()
            with attached_engine(model):
                pass
            attaches.append(time.perf_counter() - start)
    LLMEngine.step = original_step
    overhead = [c - s for c, s in zip(calls, steps)]
    print(json.dumps({
        "shape": args.shape, "device": args.device, "dtype": args.dtype, "rows": args.rows,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "calls": args.calls,
        "attach_detach_ms": median_ms(attaches), "patched_generate_ms": median_ms(calls),
        "steps_ms": median_ms(steps), "overhead_ms": median_ms(overhead),
    }, indent=1))


if __name__ == "__main__":
    main()
