"""Async scheduling on vs off (``EngineConfig.async_scheduling``, issue #4), A/B in one process (GPU).

Usage (GPU, ~2-3 min)::

    python benchmarks/bench_async.py --out benchmarks/results/async_h200.json

Llama-3-8B shape, random bf16 weights, the engine's defaults (compiled layers, CUDA graphs), one engine.

1. Correctness at real size (``check``): 8 requests (greedy with max_tokens 24..52, two seeded
   temperature / top-p rows with logprobs) run to completion with async scheduling off, then on (prefix
   cache reset in between, so both prefill the same way): token ids, finish reasons and logprobs must be
   equal (batch compositions are the same either way, so bitwise-equal logits are expected), the KV pool
   whole afterwards, and the async run must have pipelined steps.
2. Timing: for each ``--batches`` size B (default 1 and 256), B requests of ``--context`` random prompt
   tokens (greedy, EOS ignored) are prefilled, then decode runs in phases of ``--steps`` ``step()`` calls,
   alternating off / on / off / on (``engine.config.async_scheduling`` switched between phases; the first
   call after a switch drains or starts the pipeline and is not timed). Per phase: host wall time of each
   ``step()`` call (no extra syncs; p50 and mean, ms), the device time of each step's forward from the
   runner's CUDA events (``record_steps``: metadata copies to logits, p50 ms), and the device-side period
   between consecutive steps' start events (p50 ms: equals the wall per step when the host keeps up; the
   part over the device time is the GPU idling, or sampling). After each async phase, 4 more calls run
   under ``torch.cuda.set_sync_debug_mode("warn")``: the hidden host syncs per step (should be 0; the
   call sites are listed). A short table is printed last; ``--out`` gets the JSON.
"""

import argparse
import json
import statistics
import time
import warnings

import torch


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def check(engine, vocab: int) -> dict:
    """Async vs sync on the same requests at real size; raises AssertionError on any difference."""
    from paged_transformers.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(1)
    requests = []
    for i in range(8):
        prompt = torch.randint(0, vocab, (100 + 37 * i,), generator=g).tolist()
        if i < 6:
            params = SamplingParams(temperature=0, max_tokens=24 + 4 * i, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=40, ignore_eos=True, logprobs=2)
        requests.append((f"c{i}", prompt, params))
    results = {}
    for mode in (False, True):
        assert engine.reset_prefix_cache(), "requests still hold blocks"
        engine.config.async_scheduling = mode
        before = engine.num_pipelined_steps
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        got = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    c = out.outputs[0]
                    got[out.request_id] = (c.token_ids, c.finish_reason, c.logprobs)
        bm = engine.cache.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not bm.block_tables, "KV blocks leaked"
        results[mode] = (got, engine.num_pipelined_steps - before)
    (sync, sync_pipelined), (got, pipelined) = results[False], results[True]
    assert sync_pipelined == 0 and pipelined > 0, (sync_pipelined, pipelined)
    mismatched = [rid for rid in sync if sync[rid][:2] != got[rid][:2]]
    assert not mismatched, f"async != sync tokens for {mismatched}"
    for rid in sync:  # logprobs: same floats expected; allow bf16-level noise but report it
        for a, b in zip(sync[rid][2] or [], got[rid][2] or []):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-3 for k in a), (rid, a, b)
    return {"requests": len(requests), "pipelined_steps": pipelined, "tokens_equal": True}


def host_syncs(engine, num_steps: int) -> dict:
    """Synchronizing CUDA calls (stream/device syncs, blocking copies, ``.item()``) in ``num_steps``
    ``step()`` calls, by ``torch.cuda.set_sync_debug_mode("warn")``; event waits (the engine's one wait
    per step for the sampled tokens, the runner's staged copies) are not counted. Returns the count and
    the distinct Python call sites."""
    if not torch.cuda.is_available():
        return {"count": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(num_steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = sorted({f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})
    return {"count": sum("synchroniz" in str(w.message) for w in caught), "steps": num_steps, "sites": sites[:10]}


def time_batch(engine, vocab: int, batch: int, context: int, steps: int, phases: list[bool]) -> dict:
    from paged_transformers.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(batch)
    max_tokens = steps * len(phases) + 8 * len(phases) + 64
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", torch.randint(0, vocab, (context,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    engine.config.async_scheduling = False
    while True:  # prefill (chunks at large B), then every sequence decodes
        engine.step()
        seqs = engine.scheduler.running
        if len(seqs) == batch and all(s.num_computed_tokens + 1 == s.num_tokens + s.num_output_placeholders for s in seqs):
            break
    out = {"batch": batch, "context": context, "steps": steps, "phases": []}
    runner = engine.runner
    for mode in phases:
        engine.config.async_scheduling = mode
        for _ in range(4):  # warm up / drain the previous mode's pipeline
            engine.step()
        _sync()
        before = engine.num_pipelined_steps
        runner.steps.clear()
        runner.record_steps = True
        walls = []
        t_all = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = engine.step()
            walls.append(time.perf_counter() - t0)
            assert len(outs) == batch, f"{len(outs)} outputs for {batch} requests"
        total = time.perf_counter() - t_all
        runner.record_steps = False
        traces = list(runner.steps)
        _sync()
        if traces and traces[0].start is not None:
            device = [t.device_time_s() for t in traces]
            period = [a.start.elapsed_time(b.start) / 1e3 for a, b in zip(traces, traces[1:])]
        else:  # CPU smoke run: host times stand in
            device = [t.host_end - t.host_start for t in traces]
            period = [b.host_start - a.host_start for a, b in zip(traces, traces[1:])]
        kinds = sorted({t.kind for t in traces})
        out["phases"].append({
            "async_scheduling": mode, "pipelined_steps": engine.num_pipelined_steps - before,
            "wall_ms_p50": _p50(walls) * 1e3, "wall_ms_mean": total / steps * 1e3,
            "device_ms_p50": _p50(device) * 1e3, "period_ms_p50": _p50(period) * 1e3, "step_kinds": kinds,
            "host_syncs": host_syncs(engine, 4) if mode else None,
        })
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batches", default="1,256", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=60, help="timed step() calls per phase")
    parser.add_argument("--phases", default="off,on,off,on", help="order of the timed phases")
    parser.add_argument("--no-check", action="store_true", help="skip the async-vs-sync correctness check")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run with --model tiny-llama")
    parser.add_argument("--out", default=None, help="JSON results path")
    args = parser.parse_args()

    from paged_transformers.bench import build_model
    from paged_transformers.config import EngineConfig
    from paged_transformers.core.engine import LLMEngine

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(args.model, dtype, args.device)
    model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    phases = [{"on": True, "off": False}[p] for p in args.phases.split(",")]
    engine = LLMEngine(model, engine_config=EngineConfig(max_model_len=2048, max_num_seqs=max(256, *batches)))
    result = {"model": args.model, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "init_s": time.perf_counter() - t0,
              "graphs": len(engine.runner.graphs.graphs) if engine.runner.graphs is not None else 0,
              "compiled_layers": len(engine.runner.compilation.modules) if engine.runner.compilation is not None else 0}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    if not args.no_check:
        result["check"] = check(engine, vocab)
        print("check:", result["check"], flush=True)
    result["runs"] = [time_batch(engine, vocab, b, args.context, args.steps, phases) for b in batches]
    engine.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{args.model} on {result['device']}, context {args.context}, {args.steps} step() calls per phase")
    print(f"{'batch':>5} {'async':>5} {'pipelined':>9} {'wall p50':>9} {'wall mean':>9} {'device p50':>10} "
          f"{'period p50':>10} {'syncs':>5}")
    for run in result["runs"]:
        for ph in run["phases"]:
            print(f"{run['batch']:>5} {str(ph['async_scheduling']):>5} {ph['pipelined_steps']:>9} "
                  f"{ph['wall_ms_p50']:>9.3f} {ph['wall_ms_mean']:>9.3f} {ph['device_ms_p50']:>10.3f} "
                  f"{ph['period_ms_p50']:>10.3f} {str((ph['host_syncs'] or {}).get('count', '-')):>5}")


if __name__ == "__main__":
    main()
