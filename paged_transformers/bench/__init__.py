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
on the device first (``measure_device_peaks``), so the bound is what this device reaches, not its datasheet.
"""


from .command import add_arguments, bench_main, main, run_bench
from .engines import ENGINES, EngineResult, run_hf_cb, run_hf_generate, run_paged
from .report import device_info, format_table, ratios, summarize, versions
from .roofline import measure_device_peaks, model_costs, workload_roofline
from .workload import MODEL_SHAPES, BenchRequest, build_model, load_jsonl, synthetic_workload

__all__ = [
    "MODEL_SHAPES", "BenchRequest", "build_model", "synthetic_workload", "load_jsonl",
    "ENGINES", "EngineResult", "run_paged", "run_hf_generate", "run_hf_cb",
    "measure_device_peaks", "model_costs", "workload_roofline",
    "summarize", "versions", "device_info", "ratios", "format_table",
    "add_arguments", "run_bench", "bench_main", "main",
]
