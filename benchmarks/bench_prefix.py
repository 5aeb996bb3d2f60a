"""Prefix caching and n > 1 forks: what sharing KV blocks buys, measured in one process.

Part A (prefix caching): ``--num-requests`` requests share a ``--system-len``-token system prompt,
each followed by its own user suffix (``--suffix-len-range``), and generate ``--output-len`` tokens
(greedy, EOS ignored). All are queued at t = 0; the same workload runs with prefix caching off, then
on. Reported: TTFT p50/p90 (first token time - queue time), output and total throughput, hit rate.

Part B (n > 1 forks): ``--n-requests`` prompts of ``--n-prompt-len`` tokens, ``--n`` samples each,
``--n-output-len`` tokens. Three ways: one request with ``n`` (forked, caching off), ``n`` independent
requests per prompt with caching off, and the same with caching on. Reported: peak KV blocks held
and their bytes, blocks shared, throughput.

NOTE(prefix-cache): all runs use ONE engine (one KV pool, one set of CUDA graphs) and switch
``engine.config.enable_prefix_caching`` between runs, with ``reset_prefix_cache()`` before each: the
scheduler reads the flag at every step. Building an engine per run would re-profile memory and
re-capture graphs (tens of seconds each on an 8B model) and could size the pools differently.

Usage (GPU; random weights in a real shape, see ``paged_transformers.bench.MODEL_SHAPES``)::

    python benchmarks/bench_prefix.py --model llama-3-8b --output-json prefix_h200.json
    python benchmarks/bench_prefix.py --model tiny-llama --device cpu --num-requests 8 --system-len 100 \\
        --output-len 4 --n-requests 4 --n-prompt-len 40 --n-output-len 4     # CPU smoke run
"""

import argparse
import json
import statistics
import sys
import time

import torch

from paged_transformers import EngineConfig, LLMEngine, SamplingParams
from paged_transformers.bench import MODEL_SHAPES, build_model, device_info, versions


def run_workload(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], caching: bool) -> dict:
    """Queue ``requests`` at once and step until all finish. Returns timings and KV counters (bytes:
    all layers, K and V)."""
    engine.config.enable_prefix_caching = caching
    assert engine.reset_prefix_cache(), "a request still holds blocks"
    bm = engine.cache.block_manager
    engine.peak_num_used_blocks = 0
    bm.peak_num_shared_blocks = bm.num_shared_blocks
    before = engine.stats()
    device = engine.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    outputs, num_steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        num_steps += 1
    elapsed = time.perf_counter() - start
    after = engine.stats()
    ttft = sorted(o.metrics.ttft for o in outputs.values())
    num_out = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
    num_prompt = sum(len(p) for p, _ in requests)
    looked_up = after.num_prompt_tokens - before.num_prompt_tokens
    return dict(
        prefix_caching=caching,
        num_requests=len(requests),
        num_sequences=sum(p.n for _, p in requests),
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_out,
        elapsed_s=elapsed,
        num_steps=num_steps,
        ttft_p50_s=statistics.median(ttft),
        ttft_p90_s=ttft[int(0.9 * (len(ttft) - 1))],
        output_tok_per_s=num_out / elapsed,
        total_tok_per_s=(num_prompt + num_out) / elapsed,
        prefix_cache_hit_rate=(after.num_cached_tokens - before.num_cached_tokens) / looked_up if looked_up else 0.0,
        peak_kv_blocks=after.peak_num_used_blocks,
        peak_kv_bytes=after.peak_num_used_blocks * kv_block_bytes(engine),
        peak_shared_blocks=after.peak_num_shared_blocks,
        num_preemptions=after.num_preemptions - before.num_preemptions,
    )


def kv_block_bytes(engine: LLMEngine) -> int:
    """Bytes of one KV block across all layers, K and V."""
    return 2 * sum(k[0].nbytes for k in engine.cache.key_cache)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--suffix-len-range", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--n-requests", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--n-prompt-len", type=int, default=512)
    parser.add_argument("--n-output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = build_model(args.model, dtype, args.device)
    build_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    system = tokens(args.system_len)
    lo, hi = args.suffix_len_range
    part_a = [(system + tokens(int(torch.randint(lo, hi + 1, (1,), generator=g))),
               SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True))
              for _ in range(args.num_requests)]
    n_prompts = [tokens(args.n_prompt_len) for _ in range(args.n_requests)]
    sample = dict(temperature=1.0, max_tokens=args.n_output_len, ignore_eos=True)
    forked = [(p, SamplingParams(n=args.n, seed=i, **sample)) for i, p in enumerate(n_prompts)]
    independent = [(p, SamplingParams(seed=i * args.n + k, **sample)) for i, p in enumerate(n_prompts) for k in range(args.n)]

    config = EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                          attention_backend=args.attention_backend)
    t0 = time.perf_counter()
    engine = LLMEngine(model, engine_config=config)
    init_s = time.perf_counter() - t0
    report = dict(command=" ".join(sys.argv), model=args.model, dtype=args.dtype, args=vars(args),
                  device=device_info(args.device),
                  versions=versions(), kv_blocks_total=engine.cache.num_blocks,
                  bytes_per_kv_block=kv_block_bytes(engine), model_build_s=build_s, engine_init_s=init_s,
                  cuda_graphs=sorted(getattr(engine.runner, "graphs", {})), runs={})

    def save():
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(report, f, indent=1)

    try:
        # warm-up outside the timing (Triton JIT of prefill / mixed / decode paths, chunked prefill)
        run_workload(engine, part_a[:4] + independent[:4], caching=False)
        run_workload(engine, part_a[:4], caching=True)
        for name, reqs, caching in (("A_caching_off", part_a, False), ("A_caching_on", part_a, True),
                                    ("B_n_forked", forked, False), ("B_independent_caching_off", independent, False),
                                    ("B_independent_caching_on", independent, True)):
            report["runs"][name] = run_workload(engine, reqs, caching)
            save()
            r = report["runs"][name]
            print(f"{name:27s} ttft_p50 {r['ttft_p50_s']*1e3:8.1f} ms  out {r['output_tok_per_s']:8.0f} tok/s  "
                  f"total {r['total_tok_per_s']:8.0f} tok/s  hit {r['prefix_cache_hit_rate']:.3f}  "
                  f"peak_kv {r['peak_kv_bytes']/2**30:6.2f} GiB ({r['peak_kv_blocks']} blk, shared {r['peak_shared_blocks']})  "
                  f"preempt {r['num_preemptions']}  {r['elapsed_s']:.1f}s", flush=True)
    finally:
        engine.close()
    runs = report["runs"]
    report["summary"] = dict(
        A_ttft_p50_speedup=runs["A_caching_off"]["ttft_p50_s"] / runs["A_caching_on"]["ttft_p50_s"],
        A_total_throughput_ratio=runs["A_caching_on"]["total_tok_per_s"] / runs["A_caching_off"]["total_tok_per_s"],
        A_output_throughput_ratio=runs["A_caching_on"]["output_tok_per_s"] / runs["A_caching_off"]["output_tok_per_s"],
        B_kv_ratio_independent_off_over_forked=runs["B_independent_caching_off"]["peak_kv_blocks"] / runs["B_n_forked"]["peak_kv_blocks"],
        B_kv_ratio_independent_on_over_forked=runs["B_independent_caching_on"]["peak_kv_blocks"] / runs["B_n_forked"]["peak_kv_blocks"],
    )
    save()
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
