"""The server against the offline engine on one GPU (issue 20's GPU check), in one process tree:

1. a random-weight checkpoint of a model shape (``bench.MODEL_SHAPES``, bf16) with a word-level tokenizer that has a
   token for every id of the vocabulary (so any generated id decodes), saved to ``--checkpoint``;
2. the server (``python -m paged_transformers.entrypoints.openai.api_server``) on it in a subprocess; ``bench serve``
   against it at saturation (rate inf), then at half the saturation request rate;
3. the server stopped (SIGTERM), then the same workloads through the offline ``LLM`` on the same checkpoint.

Each side runs a warm-up workload (seed 0) before its timed run (the first steps of each decode bucket capture its
CUDA graph offline; the server captures them all at start-up, but its first run is reported too). The timed runs of
both sides use the prompts of seed 1, the half-rate run those of seed 2: prompts no earlier run sent, so no timed run
starts on a prefix cache that holds its prompts.

    python benchmarks/gpu_serve.py --out $OUT          # GPU; ~5 min for llama-3-8b
    python benchmarks/gpu_serve.py --shape tiny-llama --device cpu --out out      # the script itself, on CPU
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request



WARM_UP_SEED, TIMED_SEED, HALF_RATE_SEED = 0, 1, 2
INPUT_LEN_RANGE, OUTPUT_LEN_RANGE = (64, 512), (16, 128)  # tokens, uniform, both ends included


def workload_args(num_requests: int, vocab_size: int, seed: int) -> list[str]:
    """``bench serve``'s workload options: prompts of ``INPUT_LEN_RANGE`` tokens, outputs of ``OUTPUT_LEN_RANGE``,
    ids below ``vocab_size``, the synthetic workload of ``seed``."""
    return ["--num-requests", str(num_requests), "--input-len-range", *map(str, INPUT_LEN_RANGE),
            "--output-len-range", *map(str, OUTPUT_LEN_RANGE), "--vocab-size", str(vocab_size),
            "--workload-seed", str(seed)]


def make_checkpoint(shape: str, path: str, device: str) -> int:
    """A random bf16 model of ``shape`` and a word-level tokenizer covering its vocabulary, saved to ``path``;
    returns the vocabulary size."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from paged_transformers.bench import build_model

    model = build_model(shape, torch.bfloat16 if device == "cuda" else torch.float32, device)
    vocab_size = model.config.vocab_size
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1")
    model.generation_config.eos_token_id = 1
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return vocab_size


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until ``url``/health answers 200. Raises RuntimeError when the server exits or times out first."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server did not answer within {timeout_s} s")


def bench_serve(url: str, rate: str, workload: list[str], out_json: str) -> dict:
    subprocess.run([sys.executable, "-m", "paged_transformers.bench.serve", "--base-url", url, "--served-model-name", "ck",
                    "--request-rate", rate, *workload, "--output-json", out_json], check=True)
    with open(out_json) as f:
        return json.load(f)["records"][0]


def compile_counts() -> dict:
    """What this process has compiled so far: Dynamo frames, and entries of Triton's on-disk kernel cache (one per
    kernel variant compiled on this machine, Inductor's included), with the kernel name of each entry."""
    import torch._dynamo.utils

    cache = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    entries = {}
    for entry in os.listdir(cache) if os.path.isdir(cache) else []:
        names = {f.rsplit(".", 1)[0] for f in os.listdir(os.path.join(cache, entry)) if f.endswith(".cubin")}
        entries[entry] = ",".join(sorted(names)) or "?"
    return {"dynamo_frames_compiled": torch._dynamo.utils.counters["frames"]["ok"],
            "triton_cache_entries": len(entries), "entries": entries}


def new_kernels(before: dict, after: dict) -> dict:
    """Kernel name -> how many variants of it were compiled between two ``compile_counts``."""
    names = [name for entry, name in after["entries"].items() if entry not in before["entries"]]
    return {name: names.count(name) for name in sorted(set(names))}


def count_steps(engine):
    """Count ``engine.step()`` calls and their wall time (the engine process's busy-period log lines say the same of the
    server); ``.take()`` returns ``{"steps", "stepping_s"}`` since the last take."""

    class Steps:
        steps, stepping_s = 0, 0.0

        def take(self) -> dict:
            taken = {"steps": self.steps, "stepping_s": self.stepping_s}
            self.steps, self.stepping_s = 0, 0.0
            return taken

    counter, step = Steps(), engine.step

    def timed_step():
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            counter.steps += 1
            counter.stepping_s += time.perf_counter() - t0

    engine.step = timed_step
    return counter


def offline(path: str, max_model_len: int, num_requests: int, vocab_size: int) -> dict:
    """The workload through the offline ``LLM``: a first run on the warm-up prompts (every decode bucket's first step
    captures its CUDA graph), then the timed one on the timed prompts; with what each compiled (``compile_counts``
    before and after)."""
    from paged_transformers import LLM
    from paged_transformers.bench.serve import _offline
    from paged_transformers.bench.workload import synthetic_workload

    llm = LLM(path, max_model_len=max_model_len)
    warm_up, timed = (synthetic_workload(num_requests, INPUT_LEN_RANGE, OUTPUT_LEN_RANGE, vocab_size, seed)
                      for seed in (WARM_UP_SEED, TIMED_SEED))
    steps = count_steps(llm.llm_engine)
    counts = [compile_counts()]
    first = {**_offline(llm, warm_up), **steps.take()}
    counts.append(compile_counts())
    result = {**_offline(llm, timed), **steps.take()}
    counts.append(compile_counts())
    llm.close()
    compiled = {"first_run": new_kernels(counts[0], counts[1]), "second_run": new_kernels(counts[1], counts[2])}
    for c in counts:
        del c["entries"]
    return {**result, "first_run": first, "compile_counts_before_first_after_first_after_second": counts,
            "kernel_variants_compiled": compiled}


def profile(pid: int, out_path: str, duration_s: int = 20) -> subprocess.Popen | None:
    """py-spy (``--profile``), None when it is not on the PATH: ``duration_s`` seconds of the server and its engine
    process (``--subprocesses``; idle samples kept, so busy shares can be read off), as collapsed stacks to
    ``out_path``."""
    if shutil.which("py-spy") is None:
        return None
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--subprocesses", "--idle", "--nonblocking",
                             "--rate", "50", "--duration", str(duration_s), "--format", "raw", "-o", out_path],
                            stdout=subprocess.DEVNULL, stderr=open(out_path + ".err", "w"))


def server_command(checkpoint: str, port: int, max_model_len: int) -> list[str]:
    """The server's command line (vLLM's module path)."""
    return [sys.executable, "-m", "paged_transformers.entrypoints.openai.api_server", "--model", checkpoint, "--port",
            str(port), "--served-model-name", "ck", "--max-model-len", str(max_model_len), "--disable-log-requests",
            "--uvicorn-log-level", "warning"]


def serve_runs(args, vocab_size: int) -> dict:
    """The server: start-up, a first saturation run (the warm-up prompts), the timed saturation run, the half-rate run
    (each on prompts of its own), then SIGTERM."""
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(server_command(args.checkpoint, args.port, args.max_model_len),
                              stdout=open(os.path.join(args.out, "server.log"), "w"), stderr=subprocess.STDOUT)
    report = {}

    def workload(seed: int) -> list[str]:
        return workload_args(args.num_requests, vocab_size, seed)

    try:
        report["server_start_s"] = wait_healthy(url, server, 300)
        report["saturation_first"] = bench_serve(url, "inf", workload(WARM_UP_SEED),
                                                 os.path.join(args.out, "serve_inf_first.json"))
        profiler = profile(server.pid, os.path.join(args.out, "pyspy_saturation.txt")) if args.profile else None
        report["saturation"] = bench_serve(url, "inf", workload(TIMED_SEED), os.path.join(args.out, "serve_inf.json"))
        if profiler is not None:
            report["profile_exit_code"] = profiler.wait(timeout=60)
        rate = f"{report['saturation']['request_throughput'] / 2:.2f}"
        report["half_rate"] = bench_serve(url, rate, workload(HALF_RATE_SEED),
                                          os.path.join(args.out, "serve_half.json"))
    finally:
        server.send_signal(signal.SIGTERM)
        report["server_exit_code"] = server.wait(timeout=60)
    with open(os.path.join(args.out, "server.log")) as f:  # the stepping loop's line per busy period
        report["busy_periods"] = [line.split("busy for ", 1)[1].strip() for line in f if "busy for " in line]
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--checkpoint", default=None, help="folder to save the checkpoint in; default: a new temporary one")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--num-requests", type=int, default=1024, help="requests of each run (the runs of record of "
                    "2026-12-02 used 256: two-second saturation runs, where the ramp weighs)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--profile", action="store_true", help="py-spy the server during the timed saturation run (py-spy on "
                    "the PATH). Off by default: with it the timed run came to 0.60-0.79 of offline, without 0.91 (H200, "
                    "2026-12-02)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu with --shape tiny-llama to try the script")
    args = ap.parse_args()
    args.checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="pt_serve_ck_")
    t0 = time.perf_counter()
    vocab_size = min(20000, make_checkpoint(args.shape, args.checkpoint, args.device))
    report = {"checkpoint_s": time.perf_counter() - t0,
              "workload": workload_args(args.num_requests, vocab_size, TIMED_SEED)}
    os.makedirs(args.out, exist_ok=True)
    report["server"] = server = serve_runs(args, vocab_size)
    report["offline"] = offline(args.checkpoint, args.max_model_len, args.num_requests, vocab_size)
    offline_tok_s = report["offline"]["output_throughput"]
    server["saturation_over_offline"] = server["saturation"]["output_throughput"] / offline_tok_s
    with open(os.path.join(args.out, "gpu_serve.json"), "w") as f:
        json.dump(report, f, indent=2)
    ms = 1e3
    print(f"{'':28}{'out tok/s':>10}{'req/s':>8}{'TTFT p50/p99 ms':>18}{'TPOT p50 ms':>13}{'x offline':>10}")
    for name in ("saturation_first", "saturation", "half_rate"):
        r = server[name]
        print(f"{'server ' + name:<28}{r['output_throughput']:10.0f}{r['request_throughput']:8.1f}"
              f"{r['ttft_s']['p50'] * ms:9.0f}/{r['ttft_s']['p99'] * ms:<8.0f}{r['tpot_s']['p50'] * ms:13.1f}"
              f"{r['output_throughput'] / offline_tok_s:10.3f}")
    print(f"server exit code after SIGTERM: {server['server_exit_code']}")
    print("server busy periods (the engine process log; a run and its warm-up request are one when no idle wait parted them):\n  " + "\n  ".join(server["busy_periods"]))
    print(f"{'offline LLM (first run)':<28}{report['offline']['first_run']['output_throughput']:10.0f}")
    print(f"{'offline LLM':<28}{offline_tok_s:10.0f}  (target: server at saturation >= 0.90 of it)")
    o = report["offline"]
    print(f"offline steps: first run {o['first_run']['steps']} in {o['first_run']['stepping_s']:.2f} s, timed run "
          f"{o['steps']} in {o['stepping_s']:.2f} s (the server's: its busy periods above)")
    counts = report["offline"]["compile_counts_before_first_after_first_after_second"]
    print("offline Dynamo frames / Triton cache entries, before / after the first run / after the second: "
          + " -> ".join(f"{c['dynamo_frames_compiled']}/{c['triton_cache_entries']}" for c in counts))
    for run, kernels in report["offline"]["kernel_variants_compiled"].items():
        print(f"kernel variants compiled in the offline {run}: {kernels}")


if __name__ == "__main__":
    sys.exit(main())
