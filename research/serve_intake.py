"""When does the API server take each request of a burst in? The server of ``benchmarks/gpu_serve.py`` (same
checkpoint, options and workload) with its per-request log lines on, three bursts of 1,024 streamed requests (the
warm-up's seed, then the two timed seeds), and per burst: when the API server logged its first, 256th and last
request (the handler's hand-over to the engine), against the engine process's own busy-period line.

    python research/serve_intake.py --out $OUT        # GPU, ~5 min
"""

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import gpu_serve  # noqa: E402

STAMP = re.compile(r"^INFO (\S+ \S+) paged_transformers\.serve: request cmpl-")


def stamps(lines: list[str]) -> list[float]:
    out = []
    for line in lines:
        m = STAMP.match(line)
        if m:
            out.append(datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--out", default=".")
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--device", default="cuda", help="cuda; cpu with --shape tiny-llama to try the script")
    args = ap.parse_args()
    checkpoint = tempfile.mkdtemp()
    vocab_size = min(20000, gpu_serve.make_checkpoint(args.shape, checkpoint, args.device))
    command = [c for c in gpu_serve.server_command(checkpoint, args.port, 2048, 16384) if c != "--disable-log-requests"]
    if args.device != "cuda":
        command += ["--enforce-eager"]
    log_path = os.path.join(args.out, "server.log")
    proc = subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    rows = []
    try:
        gpu_serve.wait_healthy(url, proc, 600)
        for name, seed in (("warm_up", 0), ("timed_1", 1), ("timed_3", 3)):
            before = len(open(log_path).read().splitlines())
            record = gpu_serve.bench_serve(url, "inf", gpu_serve.workload_args(args.num_requests, vocab_size, seed),
                                           os.path.join(args.out, f"serve_{name}.json"))
            lines = open(log_path).read().splitlines()[before:]
            t = sorted(stamps(lines))[1:]  # the first line is bench serve's one warm-up request
            busy = [line.split(": ", 2)[-1] for line in lines if "busy for" in line][-1:]
            rows.append((name, record["output_throughput"], record["accepted_s"]["p50"], record["accepted_s"]["max"],
                         t[min(255, len(t) - 1)] - t[0], t[-1] - t[0], busy))
    finally:
        proc.terminate()
        proc.wait(60)
    print("burst     out tok/s  accepted p50/max s  API server: min(256th, last) / last after first s  engine busy line")
    for name, tok_s, p50, mx, k, last, busy in rows:
        print(f"{name:8s} {tok_s:10.0f}  {p50:6.2f} / {mx:5.2f}       {k:6.2f} / {last:5.2f}                  {busy}")


if __name__ == "__main__":
    main()
