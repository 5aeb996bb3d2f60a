"""The server against the offline engine on one GPU (issue 20's GPU check), in one process tree:

1. a random-weight checkpoint of a model shape (``bench.MODEL_SHAPES``, bf16) with a word-level tokenizer that has a
   token for every id of the vocabulary (so any generated id decodes), saved to ``--checkpoint``;
2. the server (``python -m paged_transformers.entrypoints.openai.api_server``) on it in a subprocess, and the offline
   ``LLM`` on the same checkpoint in this process, both alive to the end, each with a KV pool of ``--num-gpu-blocks``
   (the same for both, and both fit in one H200 for Llama-3-8B); only one of them runs at a time;
3. a warm-up run of each (seed 0), then the timed saturation runs in ABBA order: ``bench serve`` at rate inf on the
   prompts of seed 1, the offline engine on the same prompts, the offline engine on those of seed 3, the server on
   those of seed 3; the ratio of record is the server's mean over the offline engine's mean. Alternating the two on a
   machine whose speed drifts (the offline engine has run the same workload at 3,965-12,376 tok/s on different
   calls, and at +-10% between runs) leaves the ratio to the two sides rather than to the order;
4. the server at half its mean saturation request rate (seed 2), then SIGTERM.

Each side's warm-up pays its one-time costs (offline, the first step of each decode bucket captures its CUDA graph;
the server captures them all at start-up). Every run has prompts of its own, so none starts on a prefix cache that
holds its prompts.

    python benchmarks/gpu_serve.py --out $OUT          # GPU; ~6 min for llama-3-8b
    python benchmarks/gpu_serve.py --shape tiny-llama --device cpu --num-requests 64 --out out   # the script, on CPU
"""

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request



WARM_UP_SEED, HALF_RATE_SEED = 0, 2
TIMED_SEEDS = (1, 3)  # the prompts of the two timed saturation runs of each side (ABBA: server, offline, offline, server)
INPUT_LEN_RANGE, OUTPUT_LEN_RANGE = (64, 512), (16, 128)  # tokens, uniform, both ends included
# bench serve's client processes: one took ~1.5 s to send the 1,024-request burst (reading no response meanwhile),
# which the server then saw as its ramp (2026-12-03)
NUM_CLIENT_PROCESSES = 4


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
                    "--request-rate", rate, "--num-client-processes", str(NUM_CLIENT_PROCESSES), *workload,
                    "--output-json", out_json], check=True)
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


def cpu_facts() -> dict:
    """The CPU this run has: cores the OS reports and this process may use, torch's intra-op threads, the cgroup's
    CPU limit (``cpu.max``, cgroup v2, or v1's quota and period), when there is one."""
    import torch

    facts = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "torch_num_threads": torch.get_num_threads()}
    for name, path in (("cgroup_cpu_max", "/sys/fs/cgroup/cpu.max"), ("cgroup_v1_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
                       ("cgroup_v1_period_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):  # fmt: skip
        if os.path.exists(path):
            with open(path) as f:
                facts[name] = f.read().strip()
    return facts


def cpu_counters() -> dict:
    """Counters read before and after each run (``cpu_delta``): the machine's busy and total CPU time (``/proc/stat``,
    clock ticks), the cgroup's throttling (``cpu.stat``), the wall clock. (Each process's CPU time is its threads':
    ``thread_counters``.)"""
    counters = {"wall_s": time.perf_counter()}
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:8]]  # user nice system idle iowait irq softirq
    counters["busy_ticks"], counters["total_ticks"] = sum(ticks) - ticks[3] - ticks[4], sum(ticks)
    for path in ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat"):
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    key, value = line.split()
                    if key in ("nr_periods", "nr_throttled", "throttled_usec", "throttled_time"):
                        counters[key] = int(value)
            break
    return counters


def cpu_delta(before: dict, after: dict) -> dict:
    """What a run used between two ``cpu_counters``: the machine's busy cores on average (busy share of all CPUs'
    time x the CPUs ``/proc/stat`` counts), and the cgroup's throttled periods and seconds where the cgroup reports
    them."""
    delta = {k: after[k] - before[k] for k in after if k in before}
    wall, total = delta.pop("wall_s"), delta.pop("total_ticks")
    busy = delta.pop("busy_ticks")
    out = {"machine_busy_cores": round(busy / total * os.cpu_count(), 2) if total else None,
           "wall_s": round(wall, 2)}
    if "nr_throttled" in delta:
        out["cgroup_throttled_periods"] = delta["nr_throttled"]
        out["cgroup_periods"] = delta.get("nr_periods")
        usec = delta.get("throttled_usec", delta.get("throttled_time", 0) / 1e3)
        out["cgroup_throttled_s"] = round(usec / 1e6, 3)
    return out


def _stat_fields(path: str) -> list[str]:
    """The fields of a ``/proc`` ``stat`` file after the command name (which may hold spaces): state, ppid, ..."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def thread_counters(pid: int) -> dict:
    """Per thread of process ``pid``: CPU seconds (user + system) and involuntary context switches (times the OS took
    the CPU from it), from ``/proc/<pid>/task``; ``{}`` when the process is gone."""
    ticks, threads = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                preempted = next(int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue
        threads[int(tid)] = ((int(fields[11]) + int(fields[12])) / ticks, preempted)
    return threads


def threads_delta(pid: int, before: dict, after: dict, top: int = 6) -> dict:
    """The ``top`` threads of ``pid`` by CPU seconds between two ``thread_counters`` ("main" is the process's first
    thread): ``{label: [cpu_s, involuntary switches]}``, and the process's total CPU seconds."""
    rows = [("main" if tid == pid else str(tid), cpu - before.get(tid, (0.0, 0))[0], n - before.get(tid, (0.0, 0))[1])
            for tid, (cpu, n) in after.items()]  # fmt: skip
    rows.sort(key=lambda r: -r[1])
    return {"total_cpu_s": round(sum(r[1] for r in rows), 2), **{label: [round(cpu, 2), n] for label, cpu, n in rows[:top]}}


def engine_pid(server_pid: int) -> int | None:
    """The server's engine process (its ``multiprocessing`` spawn child), or None."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(_stat_fields(f"/proc/{entry}/stat")[1])
                with open(f"/proc/{entry}/cmdline") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if ppid == server_pid and "spawn_main" in cmdline:
                return int(entry)
    return None


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


def profile(pid: int, out_path: str, duration_s: int = 20) -> subprocess.Popen | None:
    """py-spy (``--profile``), None when it is not on the PATH: ``duration_s`` seconds of the server and its engine
    process (``--subprocesses``; idle samples kept, so busy shares can be read off), as collapsed stacks to
    ``out_path``."""
    if shutil.which("py-spy") is None:
        return None
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--subprocesses", "--idle", "--nonblocking",
                             "--rate", "50", "--duration", str(duration_s), "--format", "raw", "-o", out_path],
                            stdout=subprocess.DEVNULL, stderr=open(out_path + ".err", "w"))


def server_command(checkpoint: str, port: int, max_model_len: int, num_gpu_blocks: int) -> list[str]:
    """The server's command line (vLLM's module path)."""
    return [sys.executable, "-m", "paged_transformers.entrypoints.openai.api_server", "--model", checkpoint, "--port",
            str(port), "--served-model-name", "ck", "--max-model-len", str(max_model_len), "--num-gpu-blocks-override",
            str(num_gpu_blocks), "--disable-log-requests", "--uvicorn-log-level", "warning"]


def interleaved_runs(args, vocab_size: int) -> dict:
    """The server and the offline ``LLM``, both alive: warm-ups, the ABBA timed saturation runs, the server's half-rate
    run (the module docstring), then SIGTERM; with what the offline side compiled in each of its runs."""
    from paged_transformers import LLM
    from paged_transformers.bench.serve import _offline
    from paged_transformers.bench.workload import synthetic_workload

    url = f"http://127.0.0.1:{args.port}"
    server_proc = subprocess.Popen(server_command(args.checkpoint, args.port, args.max_model_len, args.num_gpu_blocks),
                                   stdout=open(os.path.join(args.out, "server.log"), "w"), stderr=subprocess.STDOUT)
    server, offline, llm = {}, {"runs": {}}, None

    def serve(name: str, seed: int, rate: str = "inf") -> None:
        pids = {"engine_process": engine_pid(server_proc.pid), "api_server": server_proc.pid}
        counters, threads = cpu_counters(), {k: thread_counters(pid) for k, pid in pids.items() if pid}
        client_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        server[name] = bench_serve(url, rate, workload_args(args.num_requests, vocab_size, seed),
                                   os.path.join(args.out, f"serve_{name}.json"))
        client = resource.getrusage(resource.RUSAGE_CHILDREN)
        server[name]["cpu"] = {**cpu_delta(counters, cpu_counters()), "client_cpu_s": round(
            client.ru_utime + client.ru_stime - client_cpu.ru_utime - client_cpu.ru_stime, 2),
            **{k: threads_delta(pids[k], before, thread_counters(pids[k])) for k, before in threads.items()}}

    def run_offline(name: str, seed: int) -> None:
        requests = synthetic_workload(args.num_requests, INPUT_LEN_RANGE, OUTPUT_LEN_RANGE, vocab_size, seed)
        before, counters, threads = compile_counts(), cpu_counters(), thread_counters(os.getpid())
        result = _offline(llm, requests)
        cpu = {**cpu_delta(counters, cpu_counters()), "this_process": threads_delta(os.getpid(), threads, thread_counters(os.getpid()))}
        offline["runs"][name] = {**result, **steps.take(), "cpu": cpu,
                                 "kernel_variants_compiled": new_kernels(before, compile_counts())}
        # now, not only in the last table: a call cut off by its time limit still shows the runs it finished
        print(f"offline {name}: {result['output_throughput']:.1f} out tok/s", flush=True)

    try:
        server["server_start_s"] = wait_healthy(url, server_proc, 300)
        t0 = time.perf_counter()
        llm = LLM(args.checkpoint, max_model_len=args.max_model_len, num_gpu_blocks=args.num_gpu_blocks,
                  device=args.device)
        offline["start_s"] = time.perf_counter() - t0
        steps = count_steps(llm.llm_engine)
        serve("warm_up", WARM_UP_SEED)
        run_offline("warm_up", WARM_UP_SEED)
        profiler = profile(server_proc.pid, os.path.join(args.out, "pyspy_saturation.txt")) if args.profile else None
        serve("timed_1", TIMED_SEEDS[0])
        if profiler is not None:
            server["profile_exit_code"] = profiler.wait(timeout=60)
        run_offline("timed_1", TIMED_SEEDS[0])
        run_offline("timed_2", TIMED_SEEDS[1])
        serve("timed_2", TIMED_SEEDS[1])
        rate = sum(server[f"timed_{i}"]["request_throughput"] for i in (1, 2)) / 4  # half the mean
        serve("half_rate", HALF_RATE_SEED, f"{rate:.2f}")
    finally:
        server_proc.send_signal(signal.SIGTERM)
        server["server_exit_code"] = server_proc.wait(timeout=60)
        if llm is not None:
            llm.close()
    with open(os.path.join(args.out, "server.log")) as f:  # the stepping loop's line per busy period
        server["busy_periods"] = [line.split("busy for ", 1)[1].strip() for line in f if "busy for " in line]
    return {"server": server, "offline": offline}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--checkpoint", default=None, help="folder to save the checkpoint in; default: a new temporary one")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-gpu-blocks", type=int, default=16384, help="KV blocks of each side (block size 16; "
                    "Llama-3-8B: 16384 are 34 GB, so both sides' weights and pools fit in one H200)")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--num-requests", type=int, default=1024, help="requests of each run")
    ap.add_argument("--out", default=".")
    ap.add_argument("--profile", action="store_true", help="py-spy the server during its first timed run (py-spy on "
                    "the PATH). Off by default: with it the timed run came to 0.60-0.79 of offline, without 0.91 (H200, "
                    "2026-12-02)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu with --shape tiny-llama to try the script")
    args = ap.parse_args()
    args.checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="pt_serve_ck_")
    t0 = time.perf_counter()
    vocab_size = min(20000, make_checkpoint(args.shape, args.checkpoint, args.device))
    os.makedirs(args.out, exist_ok=True)
    report = {"checkpoint_s": time.perf_counter() - t0, "num_gpu_blocks": args.num_gpu_blocks, "cpu_facts": cpu_facts(),
              "workloads": {seed: workload_args(args.num_requests, vocab_size, seed) for seed in TIMED_SEEDS},
              **interleaved_runs(args, vocab_size)}
    server, offline = report["server"], report["offline"]["runs"]
    timed = [(server[f"timed_{i}"]["output_throughput"], offline[f"timed_{i}"]["output_throughput"]) for i in (1, 2)]
    report["saturation_over_offline"] = sum(a for a, _ in timed) / sum(b for _, b in timed)  # mean over mean
    report["saturation_over_offline_per_seed"] = [a / b for a, b in timed]
    with open(os.path.join(args.out, "gpu_serve.json"), "w") as f:
        json.dump(report, f, indent=2)
    ms = 1e3
    print(f"{'run (in order)':<26}{'out tok/s':>10}{'req/s':>8}{'TTFT p50/p99 ms':>18}{'TPOT p50 ms':>13}{'steps':>7}"
          f"{'accepted p50/max s':>20}")
    for name in ("warm_up", "timed_1", "timed_2", "half_rate"):
        r = server[name]
        print(f"{'server ' + name:<26}{r['output_throughput']:10.0f}{r['request_throughput']:8.1f}"
              f"{r['ttft_s']['p50'] * ms:9.0f}/{r['ttft_s']['p99'] * ms:<8.0f}{r['tpot_s']['p50'] * ms:13.1f}{'':7}"
              f"{r['accepted_s']['p50']:13.2f}/{r['accepted_s']['max']:.2f}")
    for name, r in offline.items():
        print(f"{'offline ' + name:<26}{r['output_throughput']:10.0f}{'':39}{r['steps']:7d}"
              f"  compiled: {r['kernel_variants_compiled'] or 'nothing'}")
    print("server busy periods (its engine process's log):\n  " + "\n  ".join(server["busy_periods"]))
    print(f"CPU: {report['cpu_facts']}")
    for name in ("warm_up", "timed_1", "timed_2", "half_rate"):
        cpu = server[name]["cpu"]
        print(f"  server {name}: wall {cpu['wall_s']} s, busy cores {cpu['machine_busy_cores']}, CPU s: client "
              f"{server[name]['client_cpu_s']:.1f} in the run, API server {cpu['api_server']['total_cpu_s']} (main thread "
              f"{cpu['api_server']['main'][0]}), engine process {cpu['engine_process']['total_cpu_s']}")
    for name, r in offline.items():
        print(f"  offline {name}: {r['cpu']}")
    print(f"server exit code after SIGTERM: {server['server_exit_code']}")
    print("server / offline at saturation, per seed (ABBA): "
          + ", ".join(f"{x:.3f}" for x in report["saturation_over_offline_per_seed"])
          + f"; mean over mean: {report['saturation_over_offline']:.3f} (target >= 0.90)")


if __name__ == "__main__":
    sys.exit(main())
