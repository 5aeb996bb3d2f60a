"""Host time per engine step, isolated from model compute (issue 4: the GPU idles while the host works).

A tiny random-weight Llama (hidden 64, 1 layer, vocab 32,000 so the sampler sees a realistic vocabulary)
runs ``--num-requests`` requests that all stay in the batch (fixed output length, EOS ignored), so every
measured step is a decode step of ``num_requests`` sequences. Each engine step's wall time is split
into phases (medians over the measured steps) by wrapping the engine's methods on the instance (``time.perf_counter``):

    schedule   Scheduler.schedule
    prepare    ModelRunner.prepare (metadata packing; copies are host -> host on CPU)
    forward    ModelRunner._forward (the model; device time on a GPU, not host overhead)
    execute    the rest of ModelRunner.execute (copy-on-write, bucket choice, logits .float())
    sample     SamplingBatch.prepare, Sampler.launch + collect (older trees: sample_tokens, sample): the host part (parameter lists, results) plus the vocab-wide argmax /
               softmax / multinomial, which is device work on a GPU but runs on this CPU here
    update     Scheduler.update_from_output (append tokens, prefix-cache hashing) and the OutputProcessor (stop checks,
               freeing, RequestOutputs)
    other      the rest of LLMEngine.step: metrics, sampled-token bookkeeping, building RequestOutputs

``host`` = step - forward - sample_compute, where ``sample_compute`` is the measured time of the sampler's
vocab-wide tensor ops alone on the same logits (argmax, or the probs + multinomial of the sampled rows),
i.e. the part of ``sample`` a GPU would run; what remains is Python/host work that leaves a GPU idle.

Workloads: ``greedy`` (the GPU bench of record: temperature 0, ignore_eos) and ``mixed`` (a quarter each
of greedy, temperature 0.8 / top-p 0.95, temperature 1 / top-k 50, and seeded temperature 0.7 / top-p 0.9).

``--baseline REF`` also runs the same measurement on the code of git revision REF (checked out into a
temporary ``git worktree``, imported in a subprocess instead of the installed package), so before and
after come from one command on one machine. Results: a table printed last, and JSON at ``--out``.

Example (CPU, ~2 min)::

    python benchmarks/bench_host.py --baseline bf789d1 --out benchmarks/results/bench_host_cpu.json
"""

import argparse
import cProfile
import importlib.util
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

PHASES = ("schedule", "prepare", "forward", "execute", "sample", "update", "other")


def _import_from(root: str) -> None:
    """Make ``import paged_transformers`` load the tree at ``root`` (kernels/ and patches/ mapped into it as
    the install does), ahead of the editable install's finder."""

    mapping = {"paged_transformers": os.path.join(root, "paged_transformers"),
               "paged_transformers.kernels": os.path.join(root, "kernels"),
               "paged_transformers.patches": os.path.join(root, "patches")}

    class Finder:
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            where = mapping.get(fullname)
            if where is None:
                return None
            return importlib.util.spec_from_file_location(
                fullname, os.path.join(where, "__init__.py"), submodule_search_locations=[where])

    sys.meta_path.insert(0, Finder)


def _wrap(obj, name: str, totals: dict, phase: str) -> None:
    """Replace ``obj.name`` by a wrapper that adds its wall time to ``totals[phase]``."""
    fn = getattr(obj, name)
    clock = time.perf_counter

    def timed(*args, **kwargs):
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[phase] += clock() - t0

    setattr(obj, name, timed)


def _sampling_params(workload: str, i: int, output_len: int):
    from paged_transformers import SamplingParams

    common = {"max_tokens": output_len, "ignore_eos": True}
    if workload == "greedy" or i % 4 == 0:
        return SamplingParams(temperature=0.0, **common)
    if i % 4 == 1:
        return SamplingParams(temperature=0.8, top_p=0.95, **common)
    if i % 4 == 2:
        return SamplingParams(temperature=1.0, top_k=50, **common)
    return SamplingParams(temperature=0.7, top_p=0.9, seed=i, **common)


def _sample_compute_s(sampler, logits, params, generators, repeats: int = 3) -> float:
    """Time of the sampler's vocab-wide tensor work alone on ``logits`` (rows of ``params`` with ``generators``):
    what a GPU would run."""
    import torch

    from paged_transformers.core.draw import draw

    rows = [i for i, p in enumerate(params) if not p.greedy]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits[:, : sampler.vocab_size].argmax(dim=-1)
        if rows:
            index = torch.tensor(rows)
            draw(logits[index, : sampler.vocab_size], [params[i] for i in rows], [generators[i] for i in rows])
        best = min(best, time.perf_counter() - t0)
    return best


def _generators(engine, seqs) -> list:
    """Each sequence's random stream: the sampling batch's (a ``--baseline`` may predate it: the sequence's)."""
    if hasattr(engine, "sampling_batch"):
        return [engine.sampling_batch.states[s.seq_id].generator for s in seqs]
    return [s.generator for s in seqs]


def measure(workload: str, args) -> dict:
    """Run the workload once; per-phase mean milliseconds over the measured decode steps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged_transformers import EngineConfig, LLMEngine

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=args.num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    lo, hi = args.prompt_len
    lengths = torch.randint(lo, hi + 1, (args.num_requests,), generator=gen).tolist()
    prompts = [torch.randint(0, args.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    engine_config = EngineConfig(num_gpu_blocks=args.num_requests * (-(-(hi + args.output_len) // 16)) + 16,
                                 max_num_seqs=args.num_requests, max_model_len=hi + args.output_len + 1,
                                 attention_backend="torch")
    if hasattr(engine_config, "async_scheduling"):  # the synchronous loop's phases (a --baseline may predate it)
        engine_config.async_scheduling = False
    engine = LLMEngine(model, engine_config=engine_config)
    totals = dict.fromkeys(PHASES + ("step",), 0.0)
    _wrap(engine.scheduler, "schedule", totals, "schedule")
    _wrap(engine.runner, "prepare", totals, "prepare")
    _wrap(engine.runner, "_forward", totals, "forward")
    _wrap(engine.runner, "execute", totals, "execute")
    # the engine calls launch + collect since async scheduling (before: sample_tokens, before that: sample)
    for name in ("launch", "collect") if hasattr(engine.sampler, "launch") else ("sample_tokens",):
        _wrap(engine.sampler, name, totals, "sample")
    if hasattr(engine, "sampling_batch"):  # the sampler's per-step metadata
        _wrap(engine.sampling_batch, "prepare", totals, "sample")
    _wrap(engine.scheduler, "update_from_output", totals, "update")
    for name in ("check_stops", "make_outputs"):  # the output processor's stop checks and outputs
        _wrap(engine.output_processor, name, totals, "update")

    last_logits = {}
    forward = engine.runner._forward

    def keep_logits(*a, **k):
        out = forward(*a, **k)
        last_logits["x"] = out
        return out

    engine.runner._forward = keep_logits

    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, _sampling_params(workload, i, args.output_len))
    steps, outputs = [], {}
    profiler = cProfile.Profile() if args.profile else None
    while engine.has_unfinished_requests():
        before = dict(totals)
        seqs = list(engine.scheduler.running)
        running = len(seqs)
        decode = running == args.num_requests and not engine.scheduler.waiting and all(
            s.num_computed_tokens == s.num_tokens - 1 + s.num_output_placeholders for s in engine.scheduler.running)
        measured = decode and engine.scheduler.running[0].num_output_tokens >= args.warmup
        if measured and profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        totals["step"] += time.perf_counter() - t0
        if measured and profiler is not None:
            profiler.disable()
        if measured:
            step = {k: totals[k] - before[k] for k in totals}
            step["execute"] -= step["forward"] + step["prepare"]
            step["other"] = step["step"] - sum(step[k] for k in ("schedule", "execute", "prepare", "forward",
                                                                   "sample", "update"))
            if "x" in last_logits:
                step["sample_compute"] = _sample_compute_s(engine.sampler, last_logits["x"][0].float(),
                                                           [s.sampling_params for s in seqs], _generators(engine, seqs))
            else:
                step["sample_compute"] = 0.0
            steps.append(step)
    engine.close()
    assert len(outputs) == args.num_requests and all(len(t) == args.output_len for t in outputs.values())
    if profiler is not None:
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(args.profile)
    for s in steps:
        s["host"] = s["step"] - s["forward"] - s["sample_compute"]
    keys = PHASES + ("step", "sample_compute", "host")
    # medians: a shared 2-core machine adds spikes (other processes, GC) that a mean would carry
    mean = {k: 1e3 * statistics.median(s[k] for s in steps) for k in keys}
    checksum = sum(sum(t) * (i + 1) for i, t in enumerate(outputs[str(r)] for r in range(args.num_requests)))
    return {"workload": workload, "num_steps": len(steps), "ms_per_step": mean, "token_checksum": checksum}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 1024), metavar=("LOW", "HIGH"))
    p.add_argument("--output-len", type=int, default=48, help="every request makes exactly this many tokens")
    p.add_argument("--warmup", type=int, default=8, help="decode steps per run not measured")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--workloads", default="greedy,mixed")
    p.add_argument("--baseline", metavar="REF", help="also measure git revision REF (a worktree) in a subprocess")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile the measured steps, top N to stderr")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--_code-root", dest="code_root", help=argparse.SUPPRESS)
    p.add_argument("--_json-stdout", dest="json_stdout", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.code_root:
        _import_from(args.code_root)
    import torch

    # one thread: host time is single-threaded anyway, and intra-op threads spinning against other
    # processes on a small shared machine made the forward (and so the whole run) erratic
    torch.set_num_threads(1)
    results = [measure(w, args) for w in args.workloads.split(",")]
    if args.json_stdout:
        print("JSON:" + json.dumps(results))
        return 0

    runs = {"current": results}
    if args.baseline:
        repo = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
        rev = subprocess.check_output(["git", "rev-parse", "--short", args.baseline], text=True, cwd=repo).strip()
        with tempfile.TemporaryDirectory() as tmp:
            tree = os.path.join(tmp, "tree")
            subprocess.check_call(["git", "worktree", "add", "--detach", "-q", tree, rev], cwd=repo)
            try:
                cmd = [sys.executable, os.path.abspath(__file__), "--_code-root", tree, "--_json-stdout"]
                cmd += [a for a in (argv if argv is not None else sys.argv[1:])]
                cmd = [c for c in cmd if c not in ("--baseline", args.baseline, "--out", args.out or "\0")]
                text = subprocess.check_output(cmd, text=True)
            finally:
                subprocess.check_call(["git", "worktree", "remove", "--force", tree], cwd=repo)
        runs[f"baseline {rev}"] = json.loads(text.split("JSON:", 1)[1])

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True, capture_output=True, check=False,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    report = {"command": " ".join(["python", "benchmarks/bench_host.py"] + (argv or sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d"), "head": head, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
              "config": {k: getattr(args, k) for k in ("num_requests", "prompt_len", "output_len", "warmup",
                                                       "vocab_size", "num_layers")},
              "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    cols = PHASES + ("sample_compute", "step", "host")
    print(f"\nms per decode step at {args.num_requests} sequences (medians over measured steps; host = step - forward - sample_compute)")
    print(f"{'run':<18} {'workload':<8} " + " ".join(f"{c:>9}" for c in cols) + "  checksum")
    for name, res in runs.items():
        for r in res:
            m = r["ms_per_step"]
            print(f"{name:<18} {r['workload']:<8} " + " ".join(f"{m[c]:9.3f}" for c in cols) + f"  {r['token_checksum']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
