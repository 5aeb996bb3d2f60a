"""Issue 23: the workload of record with the Gluon W4A16 kernel (``research/w4a16_wgmma.py``) in the engine, before it is
part of the product: ``w4a16_matmul`` is wrapped so that, for 4-bit fp16/bf16 layers and ``M >= --min-m``, every
(shape, M) whose best Gluon config beat the product's default in a sweep (``w4a16_wgmma.py --out``) runs that config
(the sweep's M at or above the call's M), and everything else (prefill chunks above the largest swept M included) runs
the product's path. Then ``paged-transformers`` runs in this process with the remaining arguments.

    python research/w4a16_wgmma_e2e.py --table $OUT/w4a16_wgmma.json -- bench --model llama-3-8b --no-batch1 \
        --quantization gptq --output-json $OUT/workload_gptq_wgmma.json
"""

import argparse
import bisect
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build_table(sweep: list[dict]) -> dict:
    """``{(K, N): [(M, cfg or None), ...]}`` sorted by M; ``cfg`` when the best Gluon config beat the default."""
    table: dict = {}
    for row in sweep:
        best = row.get("best")
        cfg = tuple(best["cfg"]) if best and best["us"] < row["default_us"] else None
        table.setdefault((row["K"], row["N"]), []).append((row["M"], cfg))
    return {k: sorted(v) for k, v in table.items()}


def install(table: dict, min_m: int) -> dict:
    """Wrap ``paged_transformers.kernels.w4a16.matmul.w4a16_matmul`` (the custom op calls it by module global);
    returns a counter of calls per path."""
    import torch

    import paged_transformers.kernels.w4a16.matmul as mm
    from w4a16_wgmma import wgmma_matmul

    product = mm.w4a16_matmul
    counts = {"gluon": 0, "product": 0}

    def w4a16_matmul(x, qweight, scales, zeros, bits, group_size, bias=None, config=None):
        M, K = x.shape
        N = qweight.shape[1]
        rows = table.get((K, N))
        cfg = None
        if (rows and config is None and bits == 4 and M >= min_m and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
                and scales.dtype == torch.float16 and x.stride(1) == 1 and x.stride(0) == K
                and x.data_ptr() % 16 == 0):  # TMA: a 16-byte-aligned base
            i = bisect.bisect_left([m for m, _ in rows], M)
            cfg = rows[i][1] if i < len(rows) else None  # above the largest swept M (prefill chunks): the product
        if cfg is None:
            counts["product"] += 1
            return product(x, qweight, scales, zeros, bits, group_size, bias, config)
        counts["gluon"] += 1
        out = wgmma_matmul(x, qweight, scales, zeros, group_size, *cfg)
        return out + bias.to(x.dtype) if bias is not None else out

    mm.w4a16_matmul = w4a16_matmul
    return counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", required=True)
    ap.add_argument("--min-m", type=int, default=17)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    with open(args.table) as f:
        table = build_table(json.load(f)["sweep"])
    print("gluon table:", {f"{k[0]}x{k[1]}": v for k, v in table.items()}, flush=True)
    counts = install(table, args.min_m)
    from paged_transformers.cli import main as cli_main

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    rc = cli_main(rest)
    print("w4a16 calls by path (eager calls and graph captures, not replays):", counts, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
