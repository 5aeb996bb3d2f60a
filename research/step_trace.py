"""Per-step device timeline of the workload of record, bf16 and a quantized model taking turns in one process (GPU).

Why: the same code's decode graph steps took 13-19% longer in some runs of ``paged-transformers bench`` than in
others, minutes apart on one machine, while the prefill chunks stayed within 1%. The bench reports means only.
This runs the bench's paged engine on the bench's synthetic workload (same requests, same ``EngineConfig``, every
decode graph captured before the timed run), the models alternating ``--rounds`` times in one process, and keeps
every step:

- kind (graph/eager), rows, KV tokens read, host start/end (``time.perf_counter``, seconds from the run's start);
- its device start and end on the GPU's own timeline (the runner's CUDA events, ms from the first step's start),
  so that a gap between steps (the GPU waiting for the host) and a step's own length can be told apart;
- the GPU's SM and memory clocks, power, temperature and clock-event reasons, sampled by ``nvidia-smi -lms 100``
  alongside and stamped on arrival with the same host clock;
- before the engine closes, a probe: each of the buckets ``--probe`` (64, 128, 256 rows) replayed 20 times back to
  back from its captured decode graph (the last step's buffers), median ms by CUDA events: the GPU's speed at that
  moment with no host in the loop.

Both models stay resident, so the KV pool is smaller than the bench's; the workload uses at most ~10k of its
blocks and does not preempt either way.

Usage (GPU, ~45 s per run): ``python research/step_trace.py --rounds 3 --models bf16 gptq --out $OUT/trace.json``
"""

import argparse
import json
import subprocess
import threading
import time

import numpy as np
import torch

SMI_FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"


class SmiLog:
    """``nvidia-smi`` sampled every ``ms`` in a thread; each line stamped with ``time.perf_counter()`` on arrival."""

    def __init__(self, ms: int = 100):
        self.rows: list[tuple[float, str]] = []
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits",
                                          f"-lms={ms}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.rows.append((time.perf_counter(), line.strip()))

    def between(self, t0: float, t1: float) -> list[tuple[float, str]]:
        return [(t - t0, s) for t, s in self.rows if t0 <= t <= t1]

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()


def probe_graphs(runner, sizes, reps: int = 20) -> dict:
    """Median ms of ``reps`` back-to-back replays of each captured bucket in ``sizes`` (CUDA events)."""
    out = {}
    graphs = runner.graphs
    for size in sizes:
        if graphs is None or size not in graphs.graphs:
            continue
        g = graphs.graphs[size]
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            times.append((a, b))
        torch.cuda.synchronize()
        out[size] = float(np.median([a.elapsed_time(b) for a, b in times]))
    return out


def run_once(model, requests, config, smi: SmiLog, probe_sizes) -> dict:
    """One timed run of the workload (``bench.engines.run_paged``'s warm-up and loop), every step kept."""
    from paged_transformers.core.engine import LLMEngine
    from paged_transformers.sampling_params import SamplingParams

    engine = LLMEngine(model, engine_config=config)
    try:
        for i, r in enumerate(requests[:32]):
            engine.add_request(f"warmup{i}", r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        engine.reset_prefix_cache()
        capture_s = time.perf_counter()
        engine.capture_cudagraphs()  # as the bench does: every bucket's graph before the timed run
        capture_s = time.perf_counter() - capture_s
        runner = engine.runner
        runner.record_steps = True
        runner.steps.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            engine.add_request(str(i), r.prompt_token_ids,
                               SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        steps = list(runner.steps)
        runner.record_steps = False
        first = steps[0].start
        rows = [dict(kind=s.kind, rows=s.num_seqs, tokens=s.num_tokens, context=s.num_context_tokens,
                     host_start=s.host_start - t0, host_end=s.host_end - t0,
                     dev_start=first.elapsed_time(s.start), dev_end=first.elapsed_time(s.end)) for s in steps]
        probe = probe_graphs(runner, probe_sizes)
        t2 = time.perf_counter()
    finally:
        engine.close()
    return dict(capture_s=capture_s, elapsed_s=t1 - t0, output_tokens=sum(r.output_len for r in requests), steps=rows, probe_ms=probe,
                smi=smi.between(t0, t2))


def summary(run: dict) -> str:
    """Mean device ms per decode step by rows (1-64, 65-128, 129-192, 193-256), gaps, clocks, probe."""
    st = run["steps"]
    dev = np.array([s["dev_end"] - s["dev_start"] for s in st])
    gap = np.array([0.0] + [st[i]["dev_start"] - st[i - 1]["dev_end"] for i in range(1, len(st))])
    graph = np.array([s["kind"] == "graph" for s in st])
    rows = np.array([s["rows"] for s in st])
    parts = []
    for lo, hi in ((1, 64), (65, 128), (129, 192), (193, 256)):
        m = graph & (rows >= lo) & (rows <= hi)
        if m.any():
            parts.append(f"{lo}-{hi}:{dev[m].mean():.2f}({m.sum()})")
    sm = [float(x.split(",")[0]) for _, x in run["smi"] if x.split(",")[0].strip().isdigit()]
    sm_dec = sm[len(sm) // 3:]  # the later two thirds: decode only (prefill chunks come first)
    return (f"tok/s {run['output_tokens'] / run['elapsed_s']:.0f}  graph dev {dev[graph].mean():.2f} ms, gap "
            f"{gap[graph].mean():.2f}, eager dev {dev[~graph].mean():.1f}  by rows {' '.join(parts)}  probe "
            f"{' '.join(f'{k}:{v:.2f}' for k, v in run['probe_ms'].items())}  SM MHz median {np.median(sm) if sm else 0:.0f}"
            f" (decode part {np.median(sm_dec) if sm_dec else 0:.0f}, min {min(sm) if sm else 0:.0f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["bf16", "gptq"], choices=["bf16", "gptq", "awq"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probe", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from paged_transformers.bench.command import _engine_config, add_arguments
    from paged_transformers.bench.workload import build_model, synthetic_workload

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "llama-3-8b"])
    models = {}
    for name in a.models:
        models[name] = build_model("llama-3-8b", torch.bfloat16, "cuda", None if name == "bf16" else name)
        models[name].generation_config.eos_token_id = None
    vocab = models[a.models[0]].config.vocab_size
    requests = synthetic_workload(args.num_requests, tuple(args.input_len_range), tuple(args.output_len_range),
                                  vocab, args.seed)
    config = _engine_config(args, requests)
    smi = SmiLog()
    report = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, smi_fields=SMI_FIELDS, runs=[])
    try:
        for r in range(a.rounds):
            for name in a.models:
                run = run_once(models[name], requests, config, smi, a.probe)
                run.update(model=name, round=r)
                report["runs"].append(run)
                print(f"round {r} {name:5s} {summary(run)}", flush=True)
                with open(a.out, "w") as f:
                    json.dump(report, f)
    finally:
        smi.stop()


if __name__ == "__main__":
    main()
