"""The oneDNN route of the fp32 CPU projections (``core/cpu_linear.py``) against ``F.linear`` (MKL), per product, on
the embedded SmolLM2-135M's own weights: layer 0's q, k, gate and down projections and the LM head, at a few row
counts (the oneDNN products padded to ``cpu_linear.rows_bucket`` as the route pads them; above the largest bucket the
route is ``F.linear`` itself). Weights hot in cache; one thread; the best of ``--reps`` interleaved runs, so a
machine shared with other work still gives its quiet times.

    python research/cpu_linear_route.py [--rows 1 4 8 9 16 37 64 100 256] [--reps 30] [--out route.json]

Prints microseconds: F.linear / oneDNN (plain weight) / oneDNN (packed weight).
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F
import transformers

from paged_transformers.core import cpu_linear
from paged_transformers.default_model import default_model_path


def best_us(fn, reps: int) -> float:
    """The fastest of ``reps`` runs of ``fn`` (after two warm-ups), microseconds."""
    fn(), fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 9, 16, 37, 64, 100, 256])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    layer = model.model.layers[0]
    linears = {"q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj, "gate_proj": layer.mlp.gate_proj,
               "down_proj": layer.mlp.down_proj, "lm_head": model.lm_head}
    rows_out = []
    with torch.no_grad():
        for name, linear in linears.items():
            weight = linear.weight.detach()
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            for rows in args.rows:
                x = torch.randn(rows, weight.shape[1])
                times = {"F.linear": best_us(lambda: F.linear(x, weight), args.reps),
                         "onednn": best_us(lambda: cpu_linear._onednn(x, weight, None), args.reps),
                         "onednn_packed": best_us(lambda: cpu_linear._onednn(x, packed, None), args.reps)}
                if cpu_linear.rows_bucket(rows) is None:
                    times["onednn"] = times["onednn_packed"] = None  # the route takes F.linear there
                row = {"linear": name, "shape": list(weight.shape), "rows": rows,
                       "bucket": cpu_linear.rows_bucket(rows), **times}
                rows_out.append(row)
                fmt = lambda v: "   -" if v is None else f"{v:8.0f}"
                print(f"{name:9s} {tuple(weight.shape)!s:14s} rows {rows:4d} (bucket {row['bucket']}): "
                      f"F.linear {fmt(times['F.linear'])}  oneDNN {fmt(times['onednn'])}  packed {fmt(times['onednn_packed'])} us",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "threads": 1, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
