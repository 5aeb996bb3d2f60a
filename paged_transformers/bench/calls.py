"""``paged-transformers bench --entry-points``: the public entry points timed the way user code calls them, each
side by side with stock transformers in one process.

A benchmark that holds one warm engine hides what a user pays per call, so every scenario here goes through a
public entry point on one model, in this order (the first one is the first engine of the process):

- ``first_engine``: the first engine of the process (``engine_for``: what the first call of any entry point
  builds), the first ``paged_generate`` calls on it, and the host time a call adds over the engine's own steps
  (call wall time minus the time spent inside ``LLMEngine.step``);
- ``generate``: patched ``model.generate()`` per call against stock ``generate()`` (two shapes: batch 1 with
  128 prompt / 32 new tokens, batch 8 with 512 / 128), after one warm-up call of each;
- ``eval_loop``: eight ``paged_generate`` calls of 8 prompts x 32 new tokens, against eight stock ``generate()``
  calls on the same batches;
- ``pipeline``: ``pipeline("text-generation", batch_size=8)`` on 64 text prompts, patched against stock;
- ``workload``: the throughput workload (``--num-requests`` requests, ``--input-len-range`` /
  ``--output-len-range``) through ``paged_generate`` (its second and third calls in the process) against the warm
  engine stepped by the caller (twice, in an ABBA order after the first call), the prefix cache emptied before each
  run.

Greedy everywhere, EOS ignored (``generation_config.eos_token_id = None``), so each side makes the same number of
tokens. Times are host wall clock around the whole call (the call returns host tensors or lists, so the device
has finished), in seconds; a scenario's time is the median of ``--repeats`` calls. Token agreement with stock is
reported (bf16 greedy decoding diverges after near-ties, so it is not asserted here; the CPU tests assert it in
fp32).
"""

import statistics
import time

import torch

from ..config import EngineConfig
from ..sampling_params import SamplingParams
from .workload import BenchRequest


def _median_time(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of ``repeats`` calls of ``fn()`` (seconds) and the last call's result."""
    times, result = [], None
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        result = fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _random_batch(vocab: int, num_rows: int, prompt_len: int, seed: int, device) -> torch.Tensor:
    """``[num_rows, prompt_len]`` int64 token ids, uniform in ``[1, vocab)`` (no padding: every row is full)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (num_rows, prompt_len), generator=gen).to(device)


def _agreement(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> dict:
    """How far two ``[rows, prompt_len + new]`` outputs agree: rows identical, and the mean length of the common
    prefix of the new tokens (tokens)."""
    new_a, new_b = a[:, prompt_len:].cpu(), b[:, prompt_len:].cpu()
    n = min(new_a.shape[1], new_b.shape[1])
    same = (new_a[:, :n] == new_b[:, :n]).int()
    prefix = same.cumprod(dim=1).sum(dim=1).float()
    return {"rows_identical": int((prefix == n).sum()), "rows": int(a.shape[0]), "mean_common_prefix": float(prefix.mean())}


class _StepTimer:
    """Accumulates the wall time spent inside ``engine.step`` (seconds) and the number of steps, by wrapping it on the
    instance."""

    def __init__(self, engine):
        self.engine, self.total, self.steps, self._step = engine, 0.0, 0, engine.step

        def step():
            t0 = time.perf_counter()
            try:
                return self._step()
            finally:
                self.total += time.perf_counter() - t0
                self.steps += 1

        engine.step = step

    def remove(self) -> None:
        del self.engine.step


def first_engine(model, config: EngineConfig, repeats: int) -> dict:
    """The process's first engine: its construction (``engine_for``, what the first call of any entry point builds),
    the first ``paged_generate`` call on it (decode graphs are captured at their first step), the second, and the
    host time per call over the engine's own step time (1 prompt of 128 tokens, 16 new tokens)."""
    from ..integration.generate import paged_generate
    from ..integration.warm import engine_for

    vocab = model.config.get_text_config().vocab_size
    prompt = _random_batch(vocab, 1, 128, 1, "cpu")[0].tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def call():
        return paged_generate(model, [prompt], params, engine_config=config, use_tqdm=False)

    t0 = time.perf_counter()
    engine = engine_for(model, engine_config=config)  # what the first call builds: pool, fused layers, kernels
    construction_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    call()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    call()
    second_s = time.perf_counter() - t0
    overheads, walls = [], []
    for _ in range(repeats):
        timer = _StepTimer(engine)
        try:
            t0 = time.perf_counter()
            call()
            wall = time.perf_counter() - t0
        finally:
            timer.remove()
        walls.append(wall)
        overheads.append(wall - timer.total)
    return {"engine_construction_s": construction_s, "engine_startup_times": engine.startup_times,
            "first_call_s": first_s, "second_call_s": second_s,
            "call_s_p50": statistics.median(walls), "host_overhead_per_call_s_p50": statistics.median(overheads),
            "engine_step_s_p50": statistics.median(w - o for w, o in zip(walls, overheads))}


def stock_and_patched(model, fn, repeats: int) -> dict:
    """``fn()`` (a ``generate`` or ``pipeline`` call) timed unpatched, then patched (after one untimed call
    each: stock's warm-up, and the patched path's first call, whose time is reported too). Returns the times
    (seconds), the speed-up and both last results."""
    from ..patches.generate import patch

    fn()
    stock_s, stock_out = _median_time(fn, repeats)
    with patch():
        t0 = time.perf_counter()
        fn()
        first_s = time.perf_counter() - t0
        patched_s, patched_out = _median_time(fn, repeats)
    return {"stock_s": stock_s, "patched_s": patched_s, "first_patched_call_s": first_s,
            "speedup": stock_s / patched_s, "_stock": stock_out, "_patched": patched_out}


def generate_calls(model, shapes: list[tuple[int, int, int]], repeats: int) -> list[dict]:
    """Patched ``model.generate()`` against stock, per call, for each ``(batch, prompt_len, new_tokens)``
    (random prompt ids, no padding)."""
    vocab = model.config.get_text_config().vocab_size
    device = next(model.parameters()).device
    rows = []
    for batch, prompt_len, new in shapes:
        ids = _random_batch(vocab, batch, prompt_len, 2, device)
        mask = torch.ones_like(ids)
        row = stock_and_patched(model, lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                                              do_sample=False, pad_token_id=0), repeats)
        row["agreement"] = _agreement(row.pop("_patched"), row.pop("_stock"), prompt_len)
        rows.append({"batch": batch, "prompt_len": prompt_len, "new_tokens": new, **row})
    return rows


def eval_loop(model, config: EngineConfig, num_calls: int = 8, batch: int = 8, prompt_len: int = 128,
              new: int = 32) -> dict:
    """``num_calls`` ``paged_generate`` calls of ``batch`` prompts x ``new`` tokens (an evaluation loop) against
    as many stock ``generate()`` calls on the same batches; total seconds of each loop, and per paged call its wall
    time and the time inside ``LLMEngine.step`` (seconds; the rest is the call's host work)."""
    from ..integration.generate import paged_generate
    from ..integration.warm import engine_for

    vocab = model.config.get_text_config().vocab_size
    device = next(model.parameters()).device
    batches = [_random_batch(vocab, batch, prompt_len, 100 + i, device) for i in range(num_calls)]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    model.generate(batches[0], attention_mask=torch.ones_like(batches[0]), max_new_tokens=2, do_sample=False,
                   pad_token_id=0)  # stock's warm-up
    _sync()
    t0 = time.perf_counter()
    stock = [model.generate(b, attention_mask=torch.ones_like(b), max_new_tokens=new, do_sample=False, pad_token_id=0)
             for b in batches]
    _sync()
    stock_s = time.perf_counter() - t0
    prompts = [b.tolist() for b in batches]
    engine = engine_for(model, engine_config=config)
    timer = _StepTimer(engine)
    paged, call_s, in_step_s = [], [], []
    try:
        t0 = time.perf_counter()
        for p in prompts:
            t_call, step_before = time.perf_counter(), timer.total
            paged.append(paged_generate(model, p, params, engine_config=config, use_tqdm=False))
            call_s.append(time.perf_counter() - t_call)
            in_step_s.append(timer.total - step_before)
        paged_s = time.perf_counter() - t0
    finally:
        timer.remove()
    paged_t = torch.stack([torch.cat([b[i].cpu(), torch.tensor(o.outputs[0].token_ids)])
                           for b, outs in zip(batches, paged) for i, o in enumerate(outs)])
    return {"num_calls": num_calls, "batch": batch, "prompt_len": prompt_len, "new_tokens": new,
            "stock_s": stock_s, "paged_generate_s": paged_s, "speedup": stock_s / paged_s,
            "paged_call_s": call_s, "paged_in_step_s": in_step_s, "paged_steps": timer.steps,
            "agreement": _agreement(paged_t, torch.cat(stock).cpu(), prompt_len)}


def synthetic_tokenizer(vocab_size: int = 4096, seed: int = 0):
    """A byte-level BPE tokenizer (``vocab_size`` tokens at most) trained in-process on random words, left padding; for pipelines
    on random-weight models, where no tokenizer can be downloaded. Returns ``(tokenizer, prompts)``: 64 text
    prompts of 40-120 words."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", padding_side="left")
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 120))) for _ in range(64)]
    return tokenizer, prompts


def pipeline_calls(model, repeats: int, batch_size: int = 8, new: int = 32) -> dict:
    """``pipeline("text-generation", batch_size=8)`` on 64 text prompts, patched against stock."""
    from transformers import pipeline

    tokenizer, prompts = synthetic_tokenizer(min(4096, model.config.get_text_config().vocab_size))
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, batch_size=batch_size)
    row = stock_and_patched(model, lambda: pipe(prompts, max_new_tokens=new, do_sample=False, return_full_text=False),
                            repeats)
    stock, patched = row.pop("_stock"), row.pop("_patched")
    row["texts_identical"] = sum(a[0]["generated_text"] == b[0]["generated_text"] for a, b in zip(stock, patched))
    return {"num_prompts": len(prompts), "batch_size": batch_size, "new_tokens": new, **row}


def workload(model, requests: list[BenchRequest], config: EngineConfig) -> dict:
    """The throughput workload through ``paged_generate`` against the warm engine stepped by the caller
    (``run_to_completion`` inside ``attached_engine``), output tokens/s: the first ``paged_generate`` call, then
    held / paged / paged / held (an ABBA order: a drift between runs, such as decode graphs captured on first use,
    weighs on both sides alike); the ratio is of the two sides' mean times."""
    from ..integration.generate import paged_generate, run_to_completion
    from ..integration.warm import attached_engine, engine_for

    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    num_output = sum(r.output_len for r in requests)
    out = {"num_requests": len(requests), "output_tokens": num_output, "order": ["paged_generate", "held", "paged_generate",
                                                                               "paged_generate", "held"]}
    times = {"paged_generate": [], "held": []}
    for name in out["order"]:
        engine_for(model, engine_config=config).reset_prefix_cache()  # no hits from the run before
        _sync()
        t0 = time.perf_counter()
        if name == "held":
            with attached_engine(model, engine_config=config) as engine:
                run_to_completion(engine, prompts, params, use_tqdm=False)
        else:
            paged_generate(model, prompts, params, engine_config=config, use_tqdm=False)
        times[name].append(time.perf_counter() - t0)
    out["paged_generate_first_tok_s"] = num_output / times["paged_generate"][0]
    out["paged_generate_later_tok_s"] = [num_output / t for t in times["paged_generate"][1:]]
    out["held_engine_tok_s"] = [num_output / t for t in times["held"]]
    later, held = times["paged_generate"][1:], times["held"]
    out["paged_generate_later_mean_tok_s"] = num_output / (sum(later) / len(later))
    out["held_engine_mean_tok_s"] = num_output / (sum(held) / len(held))
    out["later_calls_over_held"] = out["paged_generate_later_mean_tok_s"] / out["held_engine_mean_tok_s"]
    return out


def run_entry_points(args) -> dict:
    """All scenarios on one model (``--model``, ``--dtype``, ``--device``), in the order of the module docstring;
    returns the report dict (``bench_main`` writes and prints it)."""
    from .command import compile_layers_arg
    from .report import device_info, versions
    from .workload import build_model, synthetic_workload

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    model = build_model(args.model, dtype, args.device, args.quantization, args.bits, args.group_size)
    model.generation_config.eos_token_id = None  # EOS ignored on both sides
    config = EngineConfig(gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                          compile_layers=compile_layers_arg(args))
    requests = synthetic_workload(args.num_requests, tuple(args.input_len_range), tuple(args.output_len_range),
                                  model.config.get_text_config().vocab_size, args.seed)
    repeats = args.repeats
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(), "device": device_info(args.device),
              "model": {"name": args.model, "dtype": args.dtype, "quantization": args.quantization},
              "engine_config": {k: getattr(config, k) for k in ("gpu_memory_utilization", "block_size", "max_num_seqs",
                                                                "max_num_batched_tokens", "max_model_len",
                                                                "enforce_eager", "compile_layers")},
              "repeats": repeats}
    steps = [("first_engine", lambda: first_engine(model, config, repeats)),
             ("generate", lambda: generate_calls(model, [(1, 128, 32), (8, 512, 128)], repeats)),
             ("eval_loop", lambda: eval_loop(model, config)),
             ("pipeline", lambda: pipeline_calls(model, repeats)),
             ("workload", lambda: workload(model, requests, config))]
    for name, fn in steps:
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # keep the other scenarios' numbers
            report[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[bench --entry-points] {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return report


def format_entry_points(report: dict) -> str:
    """The short table printed last: each scenario's stock and paged times and the ratio."""
    lines = [f"{'scenario':<34} {'stock':>10} {'paged':>10} {'ratio':>8}"]

    def row(name, stock, paged, ratio):
        fmt = lambda v: f"{v:10.3f}" if isinstance(v, (int, float)) else f"{'-':>10}"
        lines.append(f"{name:<34} {fmt(stock)} {fmt(paged)} {ratio:8.2f}x" if ratio else f"{name:<34} {fmt(stock)} {fmt(paged)}")

    fe = report.get("first_engine", {})
    if "error" not in fe and fe:
        row("first engine construction (s)", None, fe["engine_construction_s"], None)
        row("first paged_generate call (s)", None, fe["first_call_s"], None)
        row("second paged_generate call (s)", None, fe["second_call_s"], None)
        row("host overhead per call (s)", None, fe["host_overhead_per_call_s_p50"], None)
    for r in report.get("generate", []) if isinstance(report.get("generate"), list) else []:
        row(f"generate() b{r['batch']} {r['prompt_len']}/{r['new_tokens']} (s)", r["stock_s"], r["patched_s"], r["speedup"])
    for key, label, paged_key in (("eval_loop", "8 x paged_generate 8x32 (s)", "paged_generate_s"),
                                  ("pipeline", "pipeline b8, 64 prompts (s)", "patched_s")):
        r = report.get(key, {})
        if r and "error" not in r:
            row(label, r["stock_s"], r[paged_key], r["speedup"])
    w = report.get("workload", {})
    if w and "error" not in w:
        row("workload: held engine (tok/s)", None, w["held_engine_mean_tok_s"], None)
        row("workload: paged_generate (tok/s)", None, w["paged_generate_later_mean_tok_s"],
            w["later_calls_over_held"])
    for name, value in report.items():
        if isinstance(value, dict) and "error" in value:
            lines.append(f"{name}: {value['error']}")
    return "\n".join(lines)
