"""``paged-transformers bench serve``: a running OpenAI-compatible server under load (vLLM's ``bench serve``).

Requests (the synthetic workload of token-id prompts, or a JSONL file) are sent to ``/v1/completions`` as
streams, ``ignore_eos`` so each makes its ``output_len`` tokens, arriving as a Poisson process at each given
request rate (``inf``: all at once), optionally under a concurrency cap. Per rate it reports requests/s, output
and total tokens/s, TTFT, TPOT (time per output token after the first) and ITL (gaps between streamed chunks) at
p50 and p99, and the errors; then a table, a JSON record (``--output-json``) and a PNG of the latencies against
the achieved request rate (``--output-png``, matplotlib).

The server is ``--base-url``, or, with ``--model``, one started in this process (``ServerThread``) with the
server's own options and, as ``serve`` runs it, its engine in a process of its own (``AsyncEngine.spawn``);
``--compare-offline`` then also runs the workload through the offline ``LLM`` on the same model (loaded here once the
server is gone) and prints its throughput beside the server's.
"""

import argparse
import asyncio
import importlib
import json
import math
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass, field

from .workload import BenchRequest, load_jsonl, synthetic_workload


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it (seconds on ``time.perf_counter``'s clock)."""

    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    accepted: float = 0.0  # from the run's start to the response's headers (the server took the request)
    itl: list[float] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..entrypoints.openai.cli_args import add_server_arguments

    parser.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000; "
                                                         "None: start one on --model in this process")  # fmt: skip
    parser.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                        help="requests/s of the Poisson arrivals, one run each; inf: all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight; None: no cap")
    parser.add_argument("--num-client-processes", type=int, default=1,
                        help="client processes sharing the requests (and the rate); more when one client's CPU "
                             "(client_cpu_s near duration_s) or its sending of a burst (accepted_s) bounds the run")
    parser.add_argument("--num-requests", type=int, default=64, help="requests of the synthetic workload, per rate")
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[64, 512], metavar=("LOW", "HIGH"),
                        help="prompt lengths, tokens")
    parser.add_argument("--output-len-range", type=int, nargs=2, default=[16, 128], metavar=("LOW", "HIGH"),
                        help="output lengths, tokens")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="synthetic token ids are drawn below this; None: the started model's vocabulary, or 20000")
    parser.add_argument("--dataset", default=None, help='JSONL of {"prompt": token ids, "output_len": n}; None: synthetic')
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the workload and the arrivals")
    parser.add_argument("--compare-offline", action="store_true",
                        help="with --model: also run the workload through the offline LLM and compare throughput")
    parser.add_argument("--output-json", default=None, help="write the record here")
    parser.add_argument("--output-png", default=None, help="plot latency against request rate here (matplotlib)")
    add_server_arguments(parser, model_positional=False)


async def _one(http, model: str, request: BenchRequest, run_start: float) -> RequestResult:
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False, prompt_tokens=len(request.prompt_token_ids))
    try:
        async with http.post("/v1/completions", json=body) as response:
            result.accepted = time.perf_counter() - run_start
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for raw in response.content:  # lines
                line = raw.rstrip(b"\r\n")
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"]["message"]
                    return result
                now = time.perf_counter()
                if event["choices"]:
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                elif event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = result.output_tokens > 0
    return result


async def _run_rate(base_url: str, model: str, requests: list[BenchRequest], rate: float, max_concurrency, seed: int,
                    api_key: str | None = None):  # fmt: skip
    import aiohttp

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    # NOTE: aiohttp, as vLLM's benchmark client. httpx's streaming client spent about 4x aiohttp's client CPU per SSE
    # event (256 streams of a tiny model on a CPU server): one client core then caps a run at about 4,000 events/s,
    # under what the server sends
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(base_url=base_url, connector=connector, headers=headers, read_bufsize=2**20,
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:  # fmt: skip

        async def send(request):
            if limit is None:
                return await _one(http, model, request, start)
            async with limit:
                return await _one(http, model, request, start)

        tasks, start, cpu_start = [], time.perf_counter(), time.process_time()
        for request in requests:
            tasks.append(asyncio.ensure_future(send(request)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start, time.process_time() - cpu_start


def run_clients(base_url: str, model: str, requests: list[BenchRequest], rate: float, max_concurrency: int | None,
                seed: int, api_key: str | None = None, num_processes: int = 1):  # fmt: skip
    """One rate's run from ``num_processes`` client processes (``multiprocessing`` spawn), each sending every
    ``num_processes``-th request as a Poisson process of ``rate / num_processes`` (together a Poisson process of
    ``rate``) under its share of ``max_concurrency``; they start together (a barrier). One asyncio client process
    sends a burst of 1,024 streamed requests over about 1.5 s and reads no response before it is done, which is then
    the ramp the server sees; several share that work.

    Returns:
        ``(results in the order of requests, duration_s from the first process's start to the last one's end,
        client CPU seconds of all the processes over the run)``.

    Raises:
        ValueError: ``num_processes`` < 1, or over the number of requests or of ``max_concurrency``.
        RuntimeError: a client process failed (its error named), or did not start within 300 s.
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
    if num_processes > max(1, len(requests)) or (max_concurrency and num_processes > max_concurrency):
        raise ValueError(f"num_processes={num_processes} is over the {len(requests)} requests or max_concurrency="
                         f"{max_concurrency}: some client processes would have nothing to do")  # fmt: skip
    if num_processes == 1:
        return asyncio.run(_run_rate(base_url, model, requests, rate, max_concurrency, seed, api_key))
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    barrier, results_queue = context.Barrier(num_processes + 1), context.Queue()
    caps = [None if not max_concurrency else max_concurrency // num_processes + (i < max_concurrency % num_processes)
            for i in range(num_processes)]  # fmt: skip
    processes = [context.Process(target=_client_process, daemon=True, name=f"bench-serve-client-{i}",
                                 args=(i, barrier, results_queue, base_url, model, requests[i::num_processes],
                                       rate / num_processes, caps[i], seed * num_processes + i, api_key))
                 for i in range(num_processes)]  # fmt: skip
    for process in processes:
        process.start()
    try:
        try:
            barrier.wait(timeout=300)
        except threading.BrokenBarrierError:  # a process failed (it aborts the barrier, then sends why) or timed out
            try:
                i, outcome = results_queue.get(timeout=5)
            except queue.Empty:
                i, outcome = "?", "did not start within 300 s"
            raise RuntimeError(f"client process {i} failed: {outcome}") from None
        results: list[RequestResult | None] = [None] * len(requests)
        start, end, cpu_s = math.inf, -math.inf, 0.0
        for _ in processes:
            i, outcome = _next_result(results_queue, processes)
            if isinstance(outcome, str):
                raise RuntimeError(f"client process {i} failed: {outcome}")
            share, share_start, share_end, share_cpu = outcome  # perf_counter: CLOCK_MONOTONIC, one clock for all
            results[i::num_processes] = share
            start, end, cpu_s = min(start, share_start), max(end, share_end), cpu_s + share_cpu
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    return results, end - start, cpu_s


def _next_result(results_queue, processes) -> tuple:
    """The next client process's message; RuntimeError when every process is gone with none left to read (a
    process killed)."""
    while True:
        try:
            return results_queue.get(timeout=1.0)
        except queue.Empty:
            if not any(process.is_alive() for process in processes) and results_queue.empty():
                raise RuntimeError("a client process exited without its results (killed?)") from None


def _client_process(i: int, barrier, results_queue, base_url: str, model: str, requests: list[BenchRequest],
                    rate: float, max_concurrency: int | None, seed: int, api_key: str | None) -> None:  # fmt: skip
    """One of ``run_clients``' processes: wait at ``barrier``, run its share, put ``(i, (results, start and end on
    perf_counter, CPU seconds))`` on ``results_queue``, or ``(i, error text)``."""
    try:
        importlib.import_module("aiohttp")  # before the barrier: not on the run's clock
        barrier.wait(timeout=300)
        start = time.perf_counter()
        results, _, cpu_s = asyncio.run(_run_rate(base_url, model, requests, rate, max_concurrency, seed, api_key))
        results_queue.put((i, (results, start, time.perf_counter(), cpu_s)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        barrier.abort()  # a parent still at the barrier does not wait for this process
        results_queue.put((i, f"{type(e).__name__}: {e}"))


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"p50": at(0.5), "p99": at(0.99), "mean": sum(ordered) / len(ordered)}


def summarize(rate: float, results: list[RequestResult], duration_s: float, client_cpu_s: float | None = None) -> dict:
    """The record of one rate's run: counts, throughput, TTFT / TPOT / ITL / e2e percentiles (seconds), when the
    server took the requests (``accepted_s``: seconds from the run's start to each response's headers; at rate inf
    its spread is how fast the server's front takes a burst in), and the client's own CPU time over the run
    (seconds; near ``duration_s``, the client's one core bounds what it measured)."""
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    return {
        "request_rate": rate if math.isfinite(rate) else "inf", "num_requests": len(results), "completed": len(ok),
        "errors": len(results) - len(ok), "error_examples": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration_s, "request_throughput": len(ok) / duration_s, "output_throughput": output / duration_s,
        "total_token_throughput": (output + sum(r.prompt_tokens for r in ok)) / duration_s,
        "ttft_s": _percentiles([r.ttft for r in ok]),
        "tpot_s": _percentiles([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_s": _percentiles([gap for r in ok for gap in r.itl]), "e2e_s": _percentiles([r.e2e for r in ok]),
        "accepted_s": {**_percentiles([r.accepted for r in ok]), "max": max((r.accepted for r in ok), default=None)},
        "client_cpu_s": client_cpu_s,
    }  # fmt: skip


def format_table(records: list[dict], offline: dict | None = None) -> str:
    def ms(stats, key):
        return "-" if stats[key] is None else f"{stats[key] * 1e3:.1f}"

    header = f"{'rate':>6} {'ok':>5} {'err':>4} {'req/s':>7} {'out tok/s':>10} {'TTFT p50/p99 ms':>17} " \
             f"{'TPOT p50/p99 ms':>17} {'ITL p50/p99 ms':>16}"  # fmt: skip
    lines = [header]
    for r in records:
        lines.append(f"{str(r['request_rate']):>6} {r['completed']:>5} {r['errors']:>4} {r['request_throughput']:>7.2f} "
                     f"{r['output_throughput']:>10.1f} {ms(r['ttft_s'], 'p50') + '/' + ms(r['ttft_s'], 'p99'):>17} "
                     f"{ms(r['tpot_s'], 'p50') + '/' + ms(r['tpot_s'], 'p99'):>17} "
                     f"{ms(r['itl_s'], 'p50') + '/' + ms(r['itl_s'], 'p99'):>16}")  # fmt: skip
    if offline is not None:
        best = max(r["output_throughput"] for r in records)
        lines.append(f"offline LLM.generate: {offline['output_throughput']:.1f} out tok/s "
                     f"({offline['num_requests']} requests in {offline['duration_s']:.2f} s); "
                     f"server at its best rate: {best / offline['output_throughput']:.2f}x of offline")  # fmt: skip
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    """TTFT and TPOT (p50, p99) against the achieved request throughput, one point per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["request_throughput"] for r in records]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for q in ("p50", "p99"):
            ax.plot(xs, [(r[key][q] or 0) * 1e3 for r in records], marker="o", label=q)
        ax.set_xlabel("requests/s (achieved)")
        ax.set_ylabel(f"{title}, ms")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _workload(args, vocab_size: int, tokenizer=None) -> list[BenchRequest]:
    if args.dataset:
        return load_jsonl(args.dataset, tokenizer)
    return synthetic_workload(args.num_requests, tuple(args.input_len_range), tuple(args.output_len_range), vocab_size,
                              args.workload_seed)  # fmt: skip


def _offline(llm, requests: list[BenchRequest]) -> dict:
    from ..sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    duration = time.perf_counter() - start
    output = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"num_requests": len(requests), "duration_s": duration, "output_throughput": output / duration}


def _warm_up(base_url: str, model: str, request: BenchRequest, api_key: str | None = None) -> None:
    """One request before the timed runs (the first steps of an engine pay one-time costs), checked to succeed.

    Raises:
        RuntimeError: it failed (wrong URL or model name, ...), with the server's answer.
    """
    (result,), *_ = asyncio.run(_run_rate(base_url, model, [request], math.inf, None, 0, api_key))
    if not result.ok:
        raise RuntimeError(f"the warm-up request to {base_url} failed: {result.error}")


def run(args) -> dict:
    """Run every rate against the server (started here without ``--base-url``); the JSON record."""
    records, offline = [], None
    if args.base_url:
        model = (args.served_model_name or [args.model])[0]
        if model is None:
            raise ValueError("with --base-url, give --served-model-name (or --model): the name the server serves")
        requests = _workload(args, args.vocab_size or 20000)
        _warm_up(args.base_url, model, requests[0], args.api_key)
        for i, rate in enumerate(args.request_rate):
            records.append(summarize(rate, *run_clients(args.base_url, model, requests, rate, args.max_concurrency,
                                                        args.workload_seed + i, args.api_key, args.num_client_processes)))  # fmt: skip
    else:
        from ..entrypoints.llm import LLM
        from ..entrypoints.openai.api_server import ServerThread, build_app, load_front, served_model
        from ..entrypoints.openai.cli_args import llm_arguments

        front, names = load_front(args)  # the server's own engine front: the engine in a process of its own
        requests = _workload(args, args.vocab_size or front.limits.vocab_size, front.tokenizer)
        with ServerThread(build_app(front, names, log_requests=False), log_level="warning") as server:
            _warm_up(server.url, names[0], requests[0])
            for i, rate in enumerate(args.request_rate):
                records.append(summarize(rate, *run_clients(server.url, names[0], requests, rate, args.max_concurrency,
                                                            args.workload_seed + i, None, args.num_client_processes)))  # fmt: skip
        if args.compare_offline:  # after the server's engine is gone: the same model loaded here
            llm = LLM(served_model(args)[0], **llm_arguments(args))
            offline = _offline(llm, requests)
            llm.close()
    return {"records": records, "offline": offline, "args": {k: v for k, v in vars(args).items() if k != "api_key"}}


def main(argv: list[str] | None = None, prog: str = "python -m paged_transformers.bench.serve") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.num_client_processes < 1:
        parser.error(f"--num-client-processes must be at least 1, got {args.num_client_processes}")
    if args.dataset is None and args.num_client_processes > args.num_requests:
        parser.error(f"--num-client-processes {args.num_client_processes} is over --num-requests {args.num_requests}")
    if args.max_concurrency and args.num_client_processes > args.max_concurrency:
        parser.error(f"--num-client-processes {args.num_client_processes} is over --max-concurrency "
                     f"{args.max_concurrency}")  # fmt: skip
    if args.compare_offline and args.base_url:
        parser.error("--compare-offline needs the server started here (--model, no --base-url)")
    report = run(args)
    print(format_table(report["records"], report["offline"]))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, default=str)
    if args.output_png:
        plot(report["records"], args.output_png)
    return 0 if all(r["errors"] == 0 for r in report["records"]) else 1


if __name__ == "__main__":
    sys.exit(main())
