"""``/metrics``: Prometheus metrics under vLLM's names, in a registry of the server's own.

The engine's state (requests running and waiting, KV usage, prefix-cache and preemption counters) is read at
scrape time from the stepping thread's latest ``EngineSnapshot``; the request metrics are recorded by the request
handlers as a request finishes. Each histogram gets one observation per finished request, so after N requests
every histogram's ``_count`` is N:

- ``vllm:time_to_first_token_seconds``: from the request's arrival at the server to its first output;
- ``vllm:inter_token_latency_seconds``: the request's mean gap between output tokens, (e2e - TTFT) /
  (output tokens - 1) over its longest sequence (0 for one token). vLLM observes every gap; here a request is
  one observation;
- ``vllm:e2e_request_latency_seconds``: arrival to the last output;
- ``vllm:request_queue_time_seconds``: arrival to its first scheduled step.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ...outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py), seconds
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]  # fmt: skip


class _EngineCollector:
    """The engine's gauges and counters, from the front's latest snapshot at every scrape."""

    def __init__(self, front, model_name: str):
        self.front = front
        self.model_name = model_name

    def collect(self):
        snap = self.front.snapshot
        labels = ["model_name"]
        values = [
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.", snap.num_running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.",
             self.front.num_waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage, 1 = all blocks held.", snap.kv_cache_usage),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             snap.prefix_cache_queries),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", snap.prefix_cache_hits),
            (CounterMetricFamily, "vllm:num_preemptions", "Sequences preempted.", snap.num_preemptions),
        ]  # fmt: skip
        for family, name, doc, value in values:
            metric = family(name, doc, labels=labels)
            metric.add_metric([self.model_name], value)
            yield metric


class ServerMetrics:
    """The server's metrics registry (one per server, never the process-global one, so that one process can run
    several servers) and the request-level recorders.

    Args:
        front: the ``AsyncEngine`` whose snapshot the engine metrics read.
        model_name: the ``model_name`` label (the first served model name).
    """

    def __init__(self, front, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(front, model_name))
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.").labels(model_name)
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.").labels(model_name)
        self.request_success = counter("vllm:request_success", "Requests finished.", ["finished_reason"])
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token, seconds.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Mean inter-token latency of a request, seconds.",
                             _ITL_BUCKETS)  # fmt: skip
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency, seconds.", _LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time waiting before the first step, seconds.",
                                    _LATENCY_BUCKETS)  # fmt: skip

    def record_tokens(self, num_prompt_tokens: int, num_generated_tokens: int) -> None:
        """Count a request's tokens as its outputs come: its prompt with the first output, then the new tokens of each."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated_tokens)

    def record_finished(self, output: RequestOutput, arrival: float, first_output: float, finished: float) -> None:
        """Observe a finished request (times in seconds on ``time.perf_counter``'s clock)."""
        self.request_success.labels(self.model_name, output.outputs[0].finish_reason or "abort").inc()
        num_tokens = max(len(c.token_ids) for c in output.outputs)
        self.ttft.observe(first_output - arrival)
        self.itl.observe((finished - first_output) / (num_tokens - 1) if num_tokens > 1 else 0.0)
        self.e2e.observe(finished - arrival)
        scheduled = output.metrics.first_scheduled_time if output.metrics is not None else None
        self.queue_time.observe(max(0.0, scheduled - arrival) if scheduled is not None else 0.0)

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)
