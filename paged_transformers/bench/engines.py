"""The engines ``paged-transformers bench`` times on one workload: the paged engine (``run_paged``), stock
``model.generate()`` in static batches (``run_hf_generate``) and transformers' continuous batching
(``run_hf_cb``), each returning the raw timings as an ``EngineResult``."""

import gc
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..compat import attn_implementation, workload_hints
from ..config import EngineConfig
from .workload import BenchRequest

ENGINES = ("paged", "hf_generate", "hf_cb")


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


def _peak_reset(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None


def run_paged(model, requests: list[BenchRequest], config: EngineConfig, batch1_context: int | None = 512,
              batch1_tokens: int = 64, make_engine=None) -> EngineResult:
    """The paged engine on ``requests`` (greedy, EOS ignored), after a short warm-up outside the timing.

    Every decode bucket's CUDA graph is captured after the warm-up, outside the timing too
    (``LLMEngine.capture_cudagraphs``), as the API server does before it takes requests and vLLM's ``LLM`` does at
    start-up: the timed run is the engine's serving throughput. Lazily, each bucket's first step would capture it
    inside the timing: host-bound time (three dummy forwards per bucket) that varies from run to run. The capture's
    seconds and count land in ``extra["graph_capture_s"]`` and ``extra["graphs_captured"]``.

    ``make_engine``: returns the attached engine to run (closed at the end); default ``LLMEngine(model, config)``.

    With ``batch1_context``, afterwards one request of that many prompt tokens decodes ``batch1_tokens``
    tokens alone (the batch-1 decode target); its per-step times land in ``extra["decode_batch1"]``.
    """
    from ..core.engine import LLMEngine

    device = next(model.parameters()).device
    _peak_reset(device)
    t_init = time.perf_counter()
    engine = make_engine() if make_engine is not None else LLMEngine(model, engine_config=config)
    init_s = time.perf_counter() - t_init
    try:
        graphs_captured, graph_capture_s = _warm_up(engine, requests)
        stats0 = engine.stats() if hasattr(engine, "stats") else None
        runner = engine.runner
        runner.record_steps = True
        runner.steps.clear()
        _peak_reset(device)

        arrival, finished, walls, elapsed = _timed_run(engine, requests)
        peak = _peak(device)
        steps = list(runner.steps)
        stats = engine.stats() if hasattr(engine, "stats") else None
        ttft, tpot, tokens = _latencies(requests, arrival, finished)
        extra = dict(
            init_s=init_s,
            graph_capture_s=graph_capture_s,
            graphs_captured=graphs_captured,
            num_steps=len(walls),
            kv_blocks_used=stats.peak_num_used_blocks if stats else engine.peak_num_used_blocks,
            kv_blocks_total=engine.cache.num_blocks,
            kv_capacity_tokens=engine.cache.num_blocks * engine.cache.block_size,
            # the step limits the engine runs with (those the config left None picked for the device)
            engine_limits={k: getattr(engine.config, k) for k in ("max_num_seqs", "max_num_batched_tokens",
                                                                 "max_cudagraph_capture_size")},
            prefix_cache_hit_rate=_delta_rate(stats0, stats),
            num_preemptions=stats.num_preemptions - stats0.num_preemptions if stats else None,
            cuda_graphs=sorted(runner.graphs.graphs) if runner.graphs is not None else [],
            cuda_graph_capture_error=runner.graphs.capture_error if runner.graphs is not None else None,
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


def _warm_up(engine, requests: list[BenchRequest]) -> tuple[int, float]:
    """Run the workload's first (up to) 32 requests for 8 tokens each, then capture every decode bucket's CUDA graph;
    the peak block count and the prefix cache are reset afterwards. Returns (graphs captured, capture seconds)."""
    from ..sampling_params import SamplingParams

    # NOTE: Triton compiles a kernel variant on first use of each specialization (e.g. sizes divisible by 16 or
    # not), seconds in all: 32 requests of 8 tokens give prefill, chunked-prefill and mixed steps of the
    # workload's own shapes. With 8 requests of 4 tokens the first engine of a process ran ~12% slower than
    # the later ones (docs/benchmark-history.md).
    warm = requests[: min(32, len(requests))]
    for i, r in enumerate(warm):
        engine.add_request(f"warmup{i}", r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    t_capture = time.perf_counter()
    graphs_captured = engine.capture_cudagraphs()
    graph_capture_s = time.perf_counter() - t_capture
    engine.peak_num_used_blocks = 0
    if hasattr(engine, "reset_prefix_cache"):
        engine.reset_prefix_cache()  # the warm-up prompts are the workload's first ones: no free hits
    return graphs_captured, graph_capture_s


def _timed_run(engine, requests: list[BenchRequest]) -> tuple[dict, dict, list[float], float]:
    """Add every request at once (greedy, EOS ignored) and step until all finish. Returns (arrival time per request
    id, finished ``RequestOutput`` per request id, wall seconds per ``engine.step()``, elapsed seconds)."""
    from ..sampling_params import SamplingParams

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
    return arrival, finished, walls, time.perf_counter() - start


def _latencies(requests: list[BenchRequest], arrival: dict, finished: dict) -> tuple[list, list, list]:
    """(TTFT seconds per request, TPOT seconds per request of more than one output token, output token ids per
    request), in request order; asserts each request made exactly its ``output_len`` tokens."""
    ttft, tpot, tokens = [], [], []
    for i, r in enumerate(requests):
        out = finished[str(i)]
        m = out.metrics
        ttft.append(m.first_token_time - arrival[str(i)])
        if r.output_len > 1:
            tpot.append((m.finished_time - m.first_token_time) / (r.output_len - 1))
        tokens.append(out.outputs[0].token_ids)
        assert len(out.outputs[0].token_ids) == r.output_len, (i, len(out.outputs[0].token_ids), r.output_len)
    return ttft, tpot, tokens



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
    from ..sampling_params import SamplingParams

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
    previous_attn = attn_implementation(model.config)
    max_new = max(r.output_len for r in requests)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=-1, pad_token_id=0)
    hints = workload_hints(max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
                           max_generated_length=max_new, num_requests=len(requests))
    kwargs = {} if hints is None else {"workload_hints": hints}
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
