"""``paged-transformers bench``: offline throughput of the paged engine against stock transformers.

The equivalent of ``vllm bench throughput``: N requests with prompt and output lengths drawn from
given ranges (or read from a JSONL file), EOS ignored so every engine makes the same number of
tokens, all requests arriving at once. Engines, run in one process on one workload:

- ``paged``: this package's ``LLMEngine`` (continuous batching, paged KV, Triton attention, CUDA graphs);
- ``hf_generate``: stock ``model.generate()`` in padded static batches (left padding, each batch runs
  to its longest output; only the requested tokens are counted, as vLLM's ``hf`` backend does);
- ``hf_cb``: transformers' own continuous batching (``ContinuousBatchingManager`` through
  ``model.continuous_batching_context_manager``), one request per prompt with its own ``max_new_tokens``.

Reported per engine: requests/s, output and total tokens/s, TTFT and TPOT (mean, p50, p99, seconds),
peak GPU memory; for ``paged`` also KV blocks used/total, KV capacity in tokens, prefix-cache hit rate,
and GPU-idle time per step (step wall time minus the device time between CUDA events around it).

The roofline is analytic (``workload_roofline``): every request runs concurrently; prefill is bound
by the matmul rate; decode step ``k`` reads the weights once plus each active request's KV and is
bound by the copy bandwidth (or the matmul rate, whichever is slower). Both ceilings are measured
on the device first (``measure_device_peaks``), per METHOD.md's "two numbers first".
"""

import argparse
import gc
import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .config import EngineConfig

# Named shapes (random weights) from the models' published config.json files.
MODEL_SHAPES = {
    "llama-3-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-2-7b": ("llama", dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                                 rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen2.5-7b": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # for CPU smoke runs and tests only
    "tiny-llama": ("llama", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)),
}
ENGINES = ("paged", "hf_generate", "hf_cb")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # tokens to generate (EOS ignored)


@dataclass(slots=True)
class EngineResult:
    """Raw timings of one engine on one workload (seconds since the engine's start of timing)."""

    name: str
    elapsed_s: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int  # tokens counted: the requested ones (padding waste of hf_generate excluded)
    ttft_s: list[float]
    tpot_s: list[float]  # per request with output_len > 1
    peak_memory_bytes: int | None
    output_token_ids: list[list[int]] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


# -- model and workload ------------------------------------------------------------------------------
def build_model(name: str, dtype: torch.dtype, device: str, quantization: str | None = None, bits: int = 4,
                group_size: int = 128):
    """A named shape with random weights built directly on ``device``, or a checkpoint path / hub id.

    Raises:
        ValueError: ``quantization`` given for a checkpoint path (its own config decides), or unknown.
    """
    import transformers

    if name not in MODEL_SHAPES:
        if quantization is not None:
            raise ValueError(f"--quantization applies to named shapes {sorted(MODEL_SHAPES)}, not to {name!r}")
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()
    arch, fields = MODEL_SHAPES[name]
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    config = config_cls(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    if quantization is not None:
        if quantization not in ("gptq", "awq"):
            raise ValueError(f"quantization must be 'gptq' or 'awq', got {quantization!r}")
        from .quantization import build_random_quantized_model

        return build_random_quantized_model(config, quantization, bits, group_size, dtype, device).eval()
    with torch.device(device):
        model = model_cls._from_config(config, dtype=dtype)
    return model.eval()


def synthetic_workload(num_requests: int, input_len_range: tuple[int, int], output_len_range: tuple[int, int],
                       vocab_size: int, seed: int) -> list[BenchRequest]:
    """``num_requests`` requests, lengths uniform in the inclusive ranges, token ids uniform in ``[0, vocab)``.

    Raises:
        ValueError: an empty or non-positive range.
    """
    for name, (lo, hi) in (("input_len_range", input_len_range), ("output_len_range", output_len_range)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must satisfy 1 <= low <= high, got {lo, hi}")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(num_requests):
        p, o = rng.randint(*input_len_range), rng.randint(*output_len_range)
        requests.append(BenchRequest(torch.randint(0, vocab_size, (p,), generator=gen).tolist(), o))
    return requests


def load_jsonl(path: str, tokenizer=None) -> list[BenchRequest]:
    """Requests from a JSONL file of ``{"prompt": str | list[int], "output_len": int}`` lines.

    Raises:
        ValueError: a line without those keys, a text prompt without a tokenizer, a bad ``output_len``.
    """
    requests = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" not in row or "output_len" not in row:
                raise ValueError(f"{path}:{n}: each line needs 'prompt' and 'output_len', got keys {sorted(row)}")
            prompt = row["prompt"]
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise ValueError(f"{path}:{n}: text prompt needs a tokenizer (use a model path, or token ids)")
                prompt = list(tokenizer(prompt).input_ids)
            if not isinstance(row["output_len"], int) or row["output_len"] <= 0:
                raise ValueError(f"{path}:{n}: output_len must be a positive int, got {row['output_len']!r}")
            requests.append(BenchRequest(list(prompt), row["output_len"]))
    return requests


# -- engines -------------------------------------------------------------------------------------------
def _peak_reset(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None


def run_paged(model, requests: list[BenchRequest], config: EngineConfig, batch1_context: int | None = 512,
              batch1_tokens: int = 64) -> EngineResult:
    """The paged engine on ``requests`` (greedy, EOS ignored), after a short warm-up outside the timing.

    With ``batch1_context``, afterwards one request of that many prompt tokens decodes ``batch1_tokens``
    tokens alone (the batch-1 decode target); its per-step times land in ``extra["decode_batch1"]``.
    """
    from .engine import LLMEngine
    from .sampling_params import SamplingParams

    device = next(model.parameters()).device
    _peak_reset(device)
    t_init = time.perf_counter()
    engine = LLMEngine(model, engine_config=config)
    init_s = time.perf_counter() - t_init
    try:
        warm = requests[: min(8, len(requests))]
        for i, r in enumerate(warm):  # Triton JIT of the prefill and mixed paths
            engine.add_request(f"warmup{i}", r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        engine.peak_num_used_blocks = 0
        if hasattr(engine, "reset_prefix_cache"):
            engine.reset_prefix_cache()  # the warm-up prompts are the workload's first ones: no free hits
        stats0 = engine.stats() if hasattr(engine, "stats") else None
        runner = engine.runner
        runner.record_steps = True
        runner.steps.clear()
        _peak_reset(device)

        start = time.perf_counter()
        arrival = {}
        for i, r in enumerate(requests):
            arrival[str(i)] = time.perf_counter()
            engine.add_request(str(i), r.prompt_token_ids,
                               SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
        finished, walls = {}, []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            walls.append(time.perf_counter() - t0)
            for out in outs:
                if out.finished:
                    finished[out.request_id] = out
        elapsed = time.perf_counter() - start
        peak = _peak(device)
        steps = list(runner.steps)
        stats = engine.stats() if hasattr(engine, "stats") else None

        ttft, tpot, tokens = [], [], []
        for i, r in enumerate(requests):
            out = finished[str(i)]
            m = out.metrics
            ttft.append(m.first_token_time - arrival[str(i)])
            if r.output_len > 1:
                tpot.append((m.finished_time - m.first_token_time) / (r.output_len - 1))
            tokens.append(out.outputs[0].token_ids)
            assert len(out.outputs[0].token_ids) == r.output_len, (i, len(out.outputs[0].token_ids), r.output_len)
        extra = dict(
            init_s=init_s,
            num_steps=len(walls),
            kv_blocks_used=stats.peak_num_used_blocks if stats else engine.peak_num_used_blocks,
            kv_blocks_total=engine.cache.num_blocks,
            kv_capacity_tokens=engine.cache.num_blocks * engine.cache.block_size,
            prefix_cache_hit_rate=_delta_rate(stats0, stats),
            num_preemptions=stats.num_preemptions - stats0.num_preemptions if stats else None,
            cuda_graphs=sorted(runner.graphs),
            cuda_graph_capture_error=runner.graph_capture_error,
            step_overhead=_step_overhead(walls, steps),
        )
        if batch1_context and device.type == "cuda":
            extra["decode_batch1"] = _decode_batch1(engine, batch1_context, batch1_tokens, model.config)
    finally:
        engine.close()
        del engine
        _peak_reset(device)
    return EngineResult("paged", elapsed, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                        sum(r.output_len for r in requests), ttft, tpot, peak, tokens, extra)


def _delta_rate(before, after) -> float | None:
    """Prefix-cache hit rate (cached prompt tokens / prompt tokens looked up) between two ``engine.stats()``."""
    if after is None:
        return None
    looked_up = after.num_prompt_tokens - before.num_prompt_tokens
    return (after.num_cached_tokens - before.num_cached_tokens) / looked_up if looked_up else 0.0


def _step_overhead(walls: list[float], steps) -> dict:
    """GPU-idle time per step: step wall time (host, ``engine.step()``) minus device time (CUDA events)."""
    if len(walls) != len(steps) or not steps or steps[0].start is None:
        return {"available": False}
    device = np.array([s.device_time_s() for s in steps])
    wall = np.array(walls)
    idle = np.clip(wall - device, 0.0, None)
    out = {"available": True, "wall_s_total": float(wall.sum()), "device_s_total": float(device.sum()),
           "idle_fraction": float(idle.sum() / wall.sum())}
    for kind in ("graph", "eager"):
        mask = np.array([s.kind == kind for s in steps])
        if mask.any():
            out[kind] = {"num_steps": int(mask.sum()), "wall_ms_mean": float(wall[mask].mean() * 1e3),
                         "device_ms_mean": float(device[mask].mean() * 1e3),
                         "idle_ms_mean": float(idle[mask].mean() * 1e3),
                         "idle_ms_p50": float(np.percentile(idle[mask], 50) * 1e3)}
    return out


def _decode_batch1(engine, context: int, num_tokens: int, model_config) -> dict:
    """One request alone: ``context`` prompt tokens, ``num_tokens`` decode steps; per-step wall and device time."""
    from .sampling_params import SamplingParams

    vocab = model_config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.runner.steps.clear()
    engine.add_request("batch1", prompt, SamplingParams(temperature=0, max_tokens=num_tokens + 1, ignore_eos=True))
    walls = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    decode = [(w, s) for w, s in zip(walls, engine.runner.steps) if s.num_tokens == 1]
    wall = np.array([w for w, _ in decode])
    dev = np.array([s.device_time_s() or 0.0 for _, s in decode])
    return {"context": context, "num_decode_steps": len(decode), "kinds": sorted({s.kind for _, s in decode}),
            "tpot_s_p50": float(np.median(wall)), "device_s_p50": float(np.median(dev))}


class _StepClock:
    """A logits processor that only records when ``generate`` asks for each new token (host clock)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run_hf_generate(model, requests: list[BenchRequest], batch_size: int) -> EngineResult:
    """Stock ``model.generate()`` in padded static batches of ``batch_size`` requests, in workload order.

    Each batch is left-padded to its longest prompt and generates its longest ``output_len`` (greedy, no
    EOS); a request's token ``k`` is ready when ``generate`` asks for logits of token ``k + 1``.
    """
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    _peak_reset(device)
    pad = 0
    ttft, tpot, tokens = [], [], []
    # warm-up outside the timing (cuBLAS handles, allocator)
    model.generate(torch.tensor([requests[0].prompt_token_ids[:8]], device=device), max_new_tokens=2,
                   do_sample=False, pad_token_id=pad, eos_token_id=None)
    _peak_reset(device)
    start = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        max_new = max(r.output_len for r in batch)
        clock = _StepClock()
        out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=max_new,
                             min_new_tokens=max_new, pad_token_id=pad, eos_token_id=None,
                             logits_processor=LogitsProcessorList([clock]))
        end = time.perf_counter()
        ready = clock.times[1:] + [end]  # token k ready at the (k+1)-th call
        for i, r in enumerate(batch):
            first, last = ready[0], ready[r.output_len - 1]
            ttft.append(first - start)
            if r.output_len > 1:
                tpot.append((last - first) / (r.output_len - 1))
            tokens.append(out[i, width : width + r.output_len].tolist())
    elapsed = time.perf_counter() - start
    return EngineResult("hf_generate", elapsed, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                        sum(r.output_len for r in requests), ttft, tpot, _peak(device), tokens,
                        {"batch_size": batch_size})


def run_hf_cb(model, requests: list[BenchRequest]) -> EngineResult:
    """transformers' own continuous batching: ``continuous_batching_context_manager`` (warm-up inside it,
    before the timing), one ``add_request`` per prompt with its ``max_new_tokens`` and ``eos_token_id=-1``."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    previous_attn = model.config._attn_implementation
    max_new = max(r.output_len for r in requests)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=-1, pad_token_id=0)
    kwargs = {}
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
                                                 max_generated_length=max_new, num_requests=len(requests))
    except ImportError:
        pass
    _peak_reset(device)
    results = {}
    try:
        with model.continuous_batching_context_manager(generation_config=gen_config, block=True, timeout=30,
                                                       **kwargs) as manager:
            start = time.perf_counter()
            for i, r in enumerate(requests):
                manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len,
                                    record_timestamps=True, eos_token_id=-1)
            while len(results) < len(requests):
                res = manager.get_result(timeout=1)
                if res is not None and res.is_finished():
                    results[res.request_id] = res
                elif res is None and not manager.is_running():
                    raise RuntimeError(f"transformers' continuous batching stopped after {len(results)} requests")
            elapsed = time.perf_counter() - start
    finally:
        model.set_attn_implementation(previous_attn)
    ttft, tpot, tokens, errors = [], [], [], []
    for i, r in enumerate(requests):
        res = results[f"r{i}"]
        if res.error:
            errors.append(res.error)
        stamps = res.timestamps or []
        tokens.append(list(res.generated_tokens))
        if stamps:
            ttft.append(stamps[0] - start)
            if len(stamps) > 1:
                tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    num_output = sum(len(t) for t in tokens)
    return EngineResult("hf_cb", elapsed, len(requests), sum(len(r.prompt_token_ids) for r in requests), num_output,
                        ttft, tpot, _peak(device), tokens, {"errors": errors[:3], "num_errors": len(errors)})


# -- roofline --------------------------------------------------------------------------------------
def measure_device_peaks(device) -> dict:
    """Device-to-device copy bandwidth (bytes read + written per second) and bf16 matmul rate (FLOP/s),
    medians of timed repeats on random data (CUDA events); None on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"copy_bytes_per_s": None, "matmul_flops_per_s": None}
    from triton.testing import do_bench

    n = 1 << 30  # bytes per buffer, far past the 60 MB L2
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm_ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * n / (copy_ms / 1e3), "matmul_flops_per_s": 2 * 8192**3 / (mm_ms / 1e3)}


def model_costs(model) -> dict:
    """Bytes of weights a step reads (all parameters but the input embedding table, of which a step
    reads only its rows; counted when tied to the LM head), KV bytes per token, FLOPs per token."""
    text = model.config.get_text_config()
    from .sizing import model_kv_shape

    num_layers, num_kv_heads, head_dim = model_kv_shape(model.config)
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embed
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype in (torch.int32, torch.int8, torch.uint8))
    weight_bytes = total - (0 if tied else embed.numel() * embed.element_size())
    dense_params = sum(p.numel() for p in model.parameters()) - (0 if tied else embed.numel())
    elem = embed.element_size()
    return {
        "weight_bytes_per_step": int(weight_bytes),
        "kv_bytes_per_token": 2 * num_layers * num_kv_heads * head_dim * elem,
        "linear_flops_per_token": 2 * int(dense_params),
        # QK^T and PV: 2 x 2 FLOPs per (query token, key, head, dim) per layer
        "attention_flops_per_token_key": 4 * num_layers * text.num_attention_heads * head_dim,
    }


def workload_roofline(requests: list[BenchRequest], costs: dict, copy_bytes_per_s: float,
                      matmul_flops_per_s: float) -> dict:
    """Lower bound on the time of the workload on this device (every request at once; see module doc).

    Prefill of request i: ``(linear_flops * p_i + attn * p_i^2 / 2) / matmul_rate`` (it also produces the
    first output token). Decode step k = 1 .. max(o) - 1 over the requests with ``o_i > k``:
    ``max((weights + kv_bytes * sum(p_i + k)) / copy_bw, (linear_flops * n_k + attn * sum(p_i + k)) / matmul_rate)``.
    """
    p = np.array([len(r.prompt_token_ids) for r in requests], dtype=np.float64)
    o = np.array([r.output_len for r in requests], dtype=np.float64)
    lin, attn = costs["linear_flops_per_token"], costs["attention_flops_per_token_key"]
    prefill_s = float((lin * p + attn * p * p / 2).sum() / matmul_flops_per_s)
    decode_s = 0.0
    for k in range(1, int(o.max())):
        active = o > k
        ctx = float((p[active] + k).sum())
        n = int(active.sum())
        t_bytes = (costs["weight_bytes_per_step"] + costs["kv_bytes_per_token"] * ctx) / copy_bytes_per_s
        t_flops = (lin * n + attn * ctx) / matmul_flops_per_s
        decode_s += max(t_bytes, t_flops)
    total_s = prefill_s + decode_s
    return {"time_s": total_s, "prefill_s": prefill_s, "decode_s": decode_s,
            "output_tokens_per_s": float(o.sum() / total_s), "total_tokens_per_s": float((o.sum() + p.sum()) / total_s)}


# -- report ------------------------------------------------------------------------------------------
def _dist(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.array(values)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def summarize(result: EngineResult) -> dict:
    """The JSON entry of one engine: throughputs, TTFT/TPOT distributions (s), peak memory (GiB), extras."""
    out = {
        "num_requests": result.num_requests,
        "elapsed_s": result.elapsed_s,
        "requests_per_s": result.num_requests / result.elapsed_s,
        "output_tokens": result.num_output_tokens,
        "output_tokens_per_s": result.num_output_tokens / result.elapsed_s,
        "total_tokens_per_s": (result.num_output_tokens + result.num_prompt_tokens) / result.elapsed_s,
        "ttft_s": _dist(result.ttft_s),
        "tpot_s": _dist(result.tpot_s),
        "peak_memory_gib": result.peak_memory_bytes / 2**30 if result.peak_memory_bytes is not None else None,
    }
    out.update(result.extra)
    return out


def versions() -> dict:
    import transformers

    from . import __version__

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"paged_transformers": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": triton_version, "cuda": torch.version.cuda, "python": platform.python_version()}


def device_info(device) -> dict:
    device = torch.device(device)
    if device.type != "cuda":
        return {"type": "cpu", "name": platform.processor() or platform.machine()}
    props = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": props.name, "total_memory_gib": props.total_memory / 2**30,
            "multiprocessors": props.multi_processor_count}


def ratios(engines: dict) -> dict:
    """``paged_vs_<engine>``: output tokens/s of paged over the other's, side by side (same process)."""
    base = engines.get("paged")
    if not base:
        return {}
    return {f"paged_vs_{name}": {"output_tokens_per_s": base["output_tokens_per_s"] / e["output_tokens_per_s"],
                                 "paged_num_requests": base["num_requests"], "other_num_requests": e["num_requests"]}
            for name, e in engines.items() if name != "paged" and e.get("output_tokens_per_s")}


def format_table(report: dict) -> str:
    """The short text table printed last."""
    def ms(d):
        return "-" if d["mean"] is None else f"{d['mean']*1e3:.0f}/{d['p50']*1e3:.0f}/{d['p99']*1e3:.0f}"

    lines = [f"{'engine':<12} {'reqs':>5} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
             f"{'TTFT ms mean/p50/p99':>22} {'TPOT ms mean/p50/p99':>22} {'peak GiB':>8}"]
    for name, e in report["engines"].items():
        if "error" in e:
            lines.append(f"{name:<12} error: {e['error'][:100]}")
            continue
        peak = "-" if e["peak_memory_gib"] is None else f"{e['peak_memory_gib']:.1f}"
        lines.append(f"{name:<12} {e['num_requests']:>5} {e['requests_per_s']:>7.2f} {e['output_tokens_per_s']:>10.1f} "
                     f"{e['total_tokens_per_s']:>10.1f} {ms(e['ttft_s']):>22} {ms(e['tpot_s']):>22} {peak:>8}")
    for name, r in report.get("ratios", {}).items():
        lines.append(f"{name}: {r['output_tokens_per_s']:.2f}x output tok/s "
                     f"(paged on {r['paged_num_requests']} requests, other on {r['other_num_requests']})")
    roof = report.get("roofline") or {}
    if roof.get("output_tokens_per_s"):
        lines.append(f"roofline: {roof['output_tokens_per_s']:.0f} output tok/s; paged reaches "
                     f"{roof.get('paged_fraction', 0) * 100:.1f}%")
    paged = report["engines"].get("paged", {})
    if "kv_blocks_total" in paged:
        lines.append(f"KV: {paged['kv_blocks_used']}/{paged['kv_blocks_total']} blocks used at peak, capacity "
                     f"{paged['kv_capacity_tokens']} tokens; prefix-cache hit rate {paged['prefix_cache_hit_rate']}")
    so = paged.get("step_overhead", {})
    if so.get("available"):
        lines.append(f"GPU idle: {so['idle_fraction'] * 100:.1f}% of step wall time; " + "; ".join(
            f"{k} steps {v['num_steps']}: wall {v['wall_ms_mean']:.2f} ms, device {v['device_ms_mean']:.2f} ms, "
            f"idle {v['idle_ms_mean']:.2f} ms" for k, v in so.items() if isinstance(v, dict)))
    b1 = report.get("decode_batch1")
    if b1:
        lines.append(f"batch-1 decode (context {b1['context']}): {b1['tpot_s_p50'] * 1e3:.2f} ms/token "
                     f"(device {b1['device_s_p50'] * 1e3:.2f}); bound weights/copy-bw {b1['bound_s'] * 1e3:.2f} ms "
                     f"-> {b1['ratio_to_bound']:.2f}x")
    return "\n".join(lines)


# -- command -------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options (shared by ``paged-transformers bench`` and ``python -m paged_transformers.bench``)."""
    default = EngineConfig()
    parser.add_argument("--model", default="llama-3-8b",
                        help=f"a named shape with random weights ({', '.join(MODEL_SHAPES)}) or a checkpoint path")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quantization", choices=["gptq", "awq"], default=None, help="random quantized weights")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[64, 1024], metavar=("LOW", "HIGH"))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=[16, 512], metavar=("LOW", "HIGH"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default=None, help='JSONL of {"prompt": text or ids, "output_len": n}')
    parser.add_argument("--compare", default="", help="comma list of hf-generate, hf-cb")
    parser.add_argument("--compare-num-requests", type=int, default=None,
                        help="run the compared engines on the first N requests only (default: all)")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of hf-generate")
    parser.add_argument("--block-size", type=int, default=default.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=default.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=default.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: longest request, rounded up")
    parser.add_argument("--gpu-memory-utilization", type=float, default=default.gpu_memory_utilization)
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    parser.add_argument("--attention-backend", choices=["auto", "triton", "torch"], default="auto")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--sweep", action="append", default=[], metavar="FIELD=V1,V2",
                        help="also run the paged engine for each value of an EngineConfig field (repeatable; "
                             "the product of all sweeps); results under 'sweep'")
    parser.add_argument("--skip-paged", action="store_true", help="only the compared engines")
    parser.add_argument("--no-batch1", action="store_true", help="skip the batch-1 decode measurement")
    parser.add_argument("--output-json", default=None)


def _engine_config(args, requests: list[BenchRequest], **overrides) -> EngineConfig:
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    fields = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len or -(-longest // 256) * 256,
                  gpu_memory_utilization=args.gpu_memory_utilization, num_gpu_blocks=args.num_gpu_blocks,
                  attention_backend=args.attention_backend, enforce_eager=args.enforce_eager)
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
        axes.append([(name, int(v)) for v in values.split(",")])
    return [dict(point) for point in itertools.product(*axes)] if axes else []


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
    peaks = measure_device_peaks(args.device)
    t0 = time.perf_counter()
    model = build_model(args.model, dtype, args.device, args.quantization, args.bits, args.group_size)
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
            paged_result = run_paged(model, requests, config, batch1_context=None if args.no_batch1 else 512)
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
            res = summarize(run_paged(model, requests, cfg, batch1_context=None))
            report["sweep"].append({**point, "output_tokens_per_s": res["output_tokens_per_s"],
                                    "tpot_s_p50": res["tpot_s"]["p50"], "ttft_s_p50": res["ttft_s"]["p50"],
                                    "kv_capacity_tokens": res["kv_capacity_tokens"],
                                    "step_overhead": res["step_overhead"]})
    return report


def bench_main(args) -> int:
    """``paged-transformers bench``: run, write ``--output-json``, print the table last."""
    report = run_bench(args)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    for row in report.get("sweep", []):
        print("sweep", {k: v for k, v in row.items() if k != "step_overhead"})
    print(format_table(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paged-transformers bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
