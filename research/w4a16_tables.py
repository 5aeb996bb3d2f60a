"""Writes and checks the W4A16 tuning tables (``kernels/w4a16/configs/<device>.json``, format in
``kernels/w4a16/tables.py``).

    # a table from a sweep's results (research/w4a16_wgmma.py --out): each swept (shape, M) gets its fastest config
    # first, for the rows from the previous swept M of that shape up to M; the base table's candidates stay behind it
    python research/w4a16_tables.py from-sweep SWEEP.json --base kernels/w4a16/configs/NVIDIA_H100_80GB_HBM3.json \\
        --out kernels/w4a16/configs/NVIDIA_H100_80GB_HBM3.json

    # a table from a dispatch.py that kept its tuning as an ordered list of rules (RULES), e.g. the last one:
    git show e3bd65f:kernels/w4a16/dispatch.py > research/dispatch_rules.py
    python research/w4a16_tables.py from-rules research/dispatch_rules.py --device-name "NVIDIA H100 80GB HBM3" --out ...

    # the configs that rules-based dispatch.py and the shipped table pick, compared on a described Hopper of 132 SMs
    python research/w4a16_tables.py check research/dispatch_rules.py --device-name "NVIDIA H100 80GB HBM3"

No GPU is needed: ``default_config`` chooses without launching.
"""

import argparse
import importlib.util
import itertools
import json
import re
import sys

import torch

from paged_transformers.kernels.w4a16 import dispatch
from paged_transformers.kernels.w4a16.tables import Bucket, Candidate, Table, file_name, table_named

MAX_M = 256  # the rows a table covers (decode batches); past them dispatch uses its fallback (DEQUANT_MATMUL)
# the weight shapes (K, N) the rules were tuned on: Llama-3-8B's q|k|v, o, gate|up fused and not, down
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (4096, 14336), (14336, 4096)]


def load_rules(path: str):
    """A copy of a rules-based ``dispatch.py`` as a module inside the package (its relative imports resolve)."""
    spec = importlib.util.spec_from_file_location("paged_transformers.kernels.w4a16._dispatch_rules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compress(per_m: dict[str, list[tuple]]) -> tuple[Bucket, ...]:
    """``shape -> [candidates at M = 1, 2, ...]`` as buckets: runs of equal candidate lists."""
    buckets = []
    for shape, lists in per_m.items():
        m = 1
        for cands, run in itertools.groupby(lists):
            n = len(list(run))
            buckets.append(Bucket(shape, m, m + n - 1, tuple(cands)))
            m += n
    return tuple(buckets)


def from_rules(rules) -> tuple[Bucket, ...]:
    """The buckets that reproduce ``rules.RULES`` (first matching rule whose kernel applies): at each M and shape,
    every matching rule in order, ``programs_per_sm == 0`` written as the ``fixed`` split rule."""
    def candidate(rule) -> Candidate:
        c = rule.config
        split = dict(split_k_rule="programs_per_sm", programs_per_sm=rule.programs_per_sm) if rule.programs_per_sm \
            else dict(split_k_rule="fixed", split_k=c.split_k)
        return Candidate(c.algo.value, c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, **split,
                         one_wave=rule.one_wave)

    return compress({shape: [tuple(candidate(r) for r in rules.RULES if r.min_m <= M <= r.max_m and shape in r.shapes)
                              for M in range(1, MAX_M + 1)] for shape in ("square", "wide", "tall")})


_CFG = re.compile(r"(\w+) (\d+)x(\d+)x(\d+) split(\d+) w(\d+) s(\d+)")


def from_sweep(sweep: dict, base: Table) -> tuple[Bucket, ...]:
    """``base``'s buckets with each swept (shape, M)'s fastest config put first for the rows from the previous swept
    M of that shape (+1) up to M (``fixed`` split: the count the sweep timed)."""
    per_m = {shape: [base.candidates(shape, M) for M in range(1, MAX_M + 1)] for shape in ("square", "wide", "tall")}
    rows = sorted((r for r in sweep["sweep"] if r.get("best")), key=lambda r: r["M"])
    done: dict[str, int] = {}
    for row in rows:
        algo, bm, bn, bk, split, warps, stages = _CFG.fullmatch(row["best"]["cfg"]).groups()
        best = Candidate(algo, int(bm), int(bn), int(bk), int(warps), int(stages), "fixed", split_k=int(split))
        shape = dispatch.weight_shape(row["N"], row["K"])
        for M in range(done.get(shape, 0) + 1, min(row["M"], MAX_M) + 1):
            per_m[shape][M - 1] = (best,) + tuple(c for c in per_m[shape][M - 1] if c != best)
        done[shape] = row["M"]
    return compress(per_m)


def check(rules, table: Table) -> tuple[int, list]:
    """Compare ``rules.default_config`` with ``dispatch.default_config(table=table)`` on a Hopper of 132 SMs, with and
    without Gluon, over M = 1..300 and some prefill sizes, ``SHAPES``, groups 32 / 64 / 128 / per-channel, 4 and 8
    bits, bf16 / fp16 / fp32 x, TMA-aligned or not. Returns (cases compared, the differing ones)."""
    device = torch.device("cuda")
    for module in (rules, dispatch):
        module.cuda_capability = lambda device, stand_in: (9, 0)
        module.num_sms = lambda device, stand_in: 132
    cases, diffs = 0, []
    for gluon in (True, False):
        rules.has_gluon = dispatch.has_gluon = lambda: gluon
        for (K, N), group, bits, dtype, aligned in itertools.product(
                SHAPES, (32, 64, 128, None), (4, 8), (torch.bfloat16, torch.float16, torch.float32), (True, False)):
            g = group or K
            for M in [*range(1, 301), 512, 2048, 8192]:
                old = rules.default_config(M, N, K, g, device, bits, dtype, aligned)
                new = dispatch.default_config(M, N, K, g, device, bits, dtype, aligned, table=table)
                cases += 1
                if str(old) != str(new):
                    diffs.append((K, N, M, g, bits, str(dtype), aligned, gluon, str(old), str(new)))
    return cases, diffs


def dumps(table: Table) -> str:
    """The table's JSON, a bucket's candidates one a line."""
    data = table.to_json()
    buckets = data.pop("buckets")
    head = "{\n" + ",\n".join(f" {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items())
    lines = []
    for b in buckets:
        cands = ",\n".join("    " + json.dumps(c) for c in b.pop("candidates"))
        lines.append(f'  {json.dumps(b)[:-1]}, "candidates": [\n{cands}]}}')
    return head + ',\n "buckets": [\n' + ",\n".join(lines) + "\n ]\n}\n"


def versions() -> dict:
    """The versions a table is measured with."""
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("from-rules")
    r.add_argument("rules")
    r.add_argument("--device-name", required=True)
    r.add_argument("--num-sms", type=int, default=132)
    r.add_argument("--measured-on", default="")
    r.add_argument("--versions", default="{}", help="JSON: the versions the rules were measured with")
    r.add_argument("--out", required=True)
    s = sub.add_parser("from-sweep")
    s.add_argument("sweep")
    s.add_argument("--base", required=True)
    s.add_argument("--out", required=True)
    c = sub.add_parser("check")
    c.add_argument("rules")
    c.add_argument("--device-name", required=True)
    args = ap.parse_args()
    if args.cmd == "check":
        cases, diffs = check(load_rules(args.rules), table_named(args.device_name))
        print(f"{cases} cases compared, {len(diffs)} differ")
        for d in diffs[:20]:
            print("  ", d)
        sys.exit(1 if diffs else 0)
    if args.cmd == "from-rules":
        header = {"num_sms": args.num_sms, "compute_capability": [9, 0], "measured_on": args.measured_on,
                  "versions": json.loads(args.versions), "generated_by": "research/w4a16_tables.py from-rules"}
        table = Table(args.device_name, from_rules(load_rules(args.rules)), header)
    else:
        sweep = json.load(open(args.sweep))
        base = Table.from_json(json.load(open(args.base)))
        header = {**base.header, "num_sms": sweep.get("num_sms", base.header.get("num_sms")),
                  "measured_on": f"{sweep['device']} (research/w4a16_wgmma.py; the rest as in the base table)",
                  "versions": sweep.get("versions", {}), "generated_by": "research/w4a16_tables.py from-sweep"}
        table = Table(sweep["device"], from_sweep(sweep, base), header)
    if not args.out.endswith(file_name(table.device_name)):
        print(f"note: dispatch looks for {file_name(table.device_name)}", file=sys.stderr)
    with open(args.out, "w") as f:
        f.write(dumps(table))
    print(f"{args.out}: {len(table.buckets)} buckets")


if __name__ == "__main__":
    main()
