"""The read floor of a W4A16 layer: how long a kernel takes that only *reads* the bytes a W4A16 GEMV must read
(packed weight, scales, zero points) and does nothing else, on a split-K grid like the GEMV's.

A GEMV on such a grid reads the same bytes and also dequantizes, multiplies, reduces and writes, so this is as fast as
it could be; it is the fastest read of those bytes we found, not a proven hardware bound (cuBLAS reading as many
bytes is slower: docs/benchmark-history.md, issue 7, round 8). Run as a script (GPU), it times it next to the
product's GEMV and bf16 ``torch.matmul`` to show how much of the GEMV's time is the read itself::

    python research/read_floor.py --out $OUT/w4a16_floor.json      # about 2 minutes on an H200

(The run of record, 2026-11-30, was ``python3 benchmarks/bench_w4a16.py --variants floor`` at tree feed998, the same
code then: ``benchmarks/results/w4a16_h200_round8_floor3.{json,log}``.)

The kernel: program ``(pid_n, pid_k)`` reads packed rows ``[pid_k * rows_per_split, ...)`` of columns
``pid_n * BLOCK_N + [0, BLOCK_N)`` in steps of ``BKP`` rows (16-byte loads along N), then the scale and zero-point
rows of the groups those packed rows touch, sums every word it read (int32, wrapping), and stores one int32: its
checksum. ``checksum_ref`` is the sum of all those words, which the sum of the program checksums must equal (mod
2**32), so a floor that skipped bytes would be caught.

``empty_launch`` is the fixed cost under that floor: programs that read nothing and store their index.

Layout (as ``paged_transformers.kernels.w4a16``, 4-bit)::

    qweight  int32 [K // 8, N]
    scales   fp16  [G, N]   (read as int16 bits)
    zeros    int16 [G, N]
"""

import argparse
import datetime
import json
import math
import pathlib
import platform
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))  # bench_w4a16's clock and layers


@triton.jit
def _read_floor_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, KP, G, ROWS_PER_SPLIT, PACKED_PER_GROUP,
                       BLOCK_N: tl.constexpr, BKP: tl.constexpr):
    """One program: the checksum of its packed rows and their group rows, stored at ``out_ptr[pid_k, pid_n]``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    mask_n = offs_n < N
    row0 = pid_k * ROWS_PER_SPLIT
    row1 = tl.minimum(row0 + ROWS_PER_SPLIT, KP)
    acc = tl.zeros([BKP, BLOCK_N], dtype=tl.int32)
    for r in range(row0, row1, BKP):
        rows = r + tl.arange(0, BKP)
        acc += tl.load(qw_ptr + rows[:, None] * N + offs_n[None, :], mask=(rows[:, None] < row1) & mask_n[None, :], other=0)
    gacc = tl.zeros([BLOCK_N], dtype=tl.int32)
    g0 = row0 // PACKED_PER_GROUP
    g1 = tl.minimum(tl.cdiv(row1, PACKED_PER_GROUP), G)
    for g in range(g0, g1):
        # a group that straddles two splits is read by both, as the GEMV reads it
        gacc += tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.int32)
        gacc += tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.int32)
    total = tl.sum(tl.sum(acc, axis=0), axis=0) + tl.sum(gacc, axis=0)
    tl.store(out_ptr + pid_k * tl.num_programs(0) + pid_n, total)


def _rows_per_split(kp: int, split_k: int, bkp: int) -> int:
    """Packed rows each split reads: ``ceil(kp / split_k)`` rounded up to a whole number of ``bkp``-row steps."""
    rows = -(-kp // split_k)
    return -(-rows // bkp) * bkp


def read_floor(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, block_n: int,
               bkp: int, split_k: int, num_warps: int) -> torch.Tensor:
    """Launch the read-only kernel on a 4-bit layer (module docstring) and return the per-program checksums.

    Args:
        qweight: int32 ``[K // 8, N]``; scales: fp16 ``[G, N]``; zeros: int16 ``[G, N]``; group_size: input rows per
            group (a multiple of 8); block_n: columns per program; bkp: packed rows per load step (a power of two);
            split_k: programs along K (each reads ``ceil(K // 8 / split_k)`` packed rows, a multiple of ``bkp``);
            num_warps: warps per program.
    Returns: int32 ``[split_k, ceil(N / block_n)]``.
    Raises: ValueError: a group size that is not whole int32 words or does not divide K, a block_n or bkp that is
        not a power of two, or split_k < 1.
    """
    kp, n = qweight.shape
    if group_size <= 0 or group_size % 8 or (kp * 8) % group_size:
        raise ValueError(f"group_size must be a positive multiple of 8 dividing K={kp * 8}, got {group_size}")
    for name, v in (("block_n", block_n), ("bkp", bkp)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    rows = _rows_per_split(kp, split_k, bkp)
    grid_n = -(-n // block_n)
    out = torch.empty((split_k, grid_n), dtype=torch.int32, device=qweight.device)
    _read_floor_kernel[(grid_n, split_k)](qweight, scales.view(torch.int16), zeros, out, n, kp, scales.shape[0], rows,
                                          group_size // 8, BLOCK_N=block_n, BKP=bkp, num_warps=num_warps)
    return out


def checksum_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 split_k: int, bkp: int) -> int:
    """The sum mod ``2**32`` that ``read_floor``'s checksums must add up to: every packed word once, and the
    scale / zero rows of each group once per split that touches it (as int16 bit patterns, sign-extended)."""
    kp = qweight.shape[0]
    rows = _rows_per_split(kp, split_k, bkp)
    total = int(qweight.to(torch.int64).sum())
    sz = scales.view(torch.int16).to(torch.int64).sum(dim=1) + zeros.to(torch.int64).sum(dim=1)  # per group
    per_group = group_size // 8
    for s in range(split_k):
        r0, r1 = s * rows, min(s * rows + rows, kp)
        if r0 >= r1:
            continue
        total += int(sz[r0 // per_group: min(-(-r1 // per_group), scales.shape[0])].sum())
    return total % 2**32


@triton.jit
def _empty_kernel(out_ptr):
    """One program: stores its index (nothing read)."""
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, pid)


def empty_launch(num_programs: int, num_warps: int, device: torch.device) -> torch.Tensor:
    """Launch ``num_programs`` programs of ``num_warps`` warps that only store their index: the launch and
    completion cost of a grid of that size, with no memory traffic to speak of.

    Returns: int32 ``[num_programs]``, ``0 .. num_programs - 1``.
    """
    out = torch.empty(num_programs, dtype=torch.int32, device=device)
    _empty_kernel[(num_programs,)](out, num_warps=num_warps)
    return out


# -- the timed comparison (GPU) ----------------------------------------------------------------------


def floor_candidates(N: int, K: int, sms: int) -> list[tuple[int, int, int, int]]:
    """Grids of the read-only kernel as ``(block_n, bkp, split_k, num_warps)``: 512-2048 columns, 8 or 16 packed rows
    per load, 1-8 programs per SM, 4 or 8 warps."""
    from paged_transformers.kernels.w4a16 import split_k_for

    out = []
    for bn in (512, 1024, 2048):
        for bkp in (8, 16):
            for per_sm in (1, 2, 4, 8):
                split = split_k_for(-(-N // bn), -(-K // (8 * bkp)), sms, per_sm)
                for w in (4, 8):
                    out.append((bn, bkp, split, w))
    return list(dict.fromkeys(out))


def library_reads(nbytes: int, N: int, device, l2_bytes: int = 50 * 2**20) -> dict[str, float]:
    """The same byte count read by PyTorch's own kernels, us per call on the graph clock with buffers rotating over
    >= 4x L2: cuBLAS's bf16 GEMV ``[1, R] @ [R, N]`` with ``R = ceil(nbytes / 2N)`` rows, and ``torch.sum`` of an int32
    buffer of ``nbytes / 4`` elements. A check that ``read_floor``'s kernel is not a slow way to read those bytes."""
    from bench_w4a16 import graph_time_ms

    r = -(-nbytes // (2 * N))
    n_sets = max(2, math.ceil(4 * l2_bytes / nbytes))
    ws = [torch.randn(r, N, device=device, dtype=torch.bfloat16) for _ in range(n_sets)]
    x = torch.randn(1, r, device=device, dtype=torch.bfloat16)
    bufs = [torch.randint(-(2**31), 2**31, (nbytes // 4,), dtype=torch.int32, device=device) for _ in range(n_sets)]
    return {f"cuBLAS bf16 [1, {r}] @ [{r}, {N}]": graph_time_ms(lambda i: torch.matmul(x, ws[i % n_sets])) * 1e3,
            f"torch.sum int32 [{nbytes // 4}]": graph_time_ms(lambda i: bufs[i % n_sets].sum()) * 1e3}


# the shapes, then the engine's other two projections
FLOOR_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 6144), (4096, 28672)]
ENGINE_PROJECTIONS = {"q|k|v": (4096, 6144), "o": (4096, 4096), "gate|up": (4096, 28672), "down": (14336, 4096)}


def time_floor(device, report: dict, out_path: str | None) -> list[dict]:
    """At M = 1 on ``FLOOR_SHAPES``: bf16 ``torch.matmul``, the default W4A16 config (checked against
    ``w4a16_matmul_ref``) and the read-only kernel on every ``floor_candidates`` grid and on the default GEMV's own
    grid (each checked by its checksum first), all on the graph clock with rotating weights; then ``library_reads``
    of the same byte count; last, ``empty_launch`` grids (the launch cost under the floor). ``report["floor"]`` is
    written to ``out_path`` after each shape."""
    from bench_w4a16 import GROUP, graph_time_ms, rel_err, rotating_sets

    from paged_transformers.kernels import w4a16 as k

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = report["floor"] = []
    t0 = time.perf_counter()
    for K, N in FLOOR_SHAPES:
        int4_bytes, n_q, n_b, qsets, bsets = rotating_sets(K, N, device)
        xs = [torch.randn(1, K, device=device, dtype=torch.bfloat16) for _ in range(max(n_q, n_b))]
        bf16_us = graph_time_ms(lambda i: torch.matmul(xs[i % len(xs)], bsets[i % n_b])) * 1e3
        default = k.default_config(1, N, K, GROUP, device)
        err = rel_err(k.w4a16_matmul(xs[0], *qsets[0], 4, GROUP), k.w4a16_matmul_ref(xs[0].float(), *qsets[0], 4, GROUP))
        if not err < 1e-2:
            raise AssertionError(f"default config rel_err {err:.3g} on {K}x{N}")
        gemv_us = graph_time_ms(lambda i: k.w4a16_matmul(xs[i % len(xs)], *qsets[i % n_q], 4, GROUP)) * 1e3
        base = dict(K=K, N=N, M=1, bf16_graph_us=bf16_us, int4_bytes=int4_bytes)
        rows.append(dict(base, kind="gemv default", used=str(default), graph_us=gemv_us, rel_err=err))
        own = (default.block_n, default.block_k // 8, default.split_k, default.num_warps)
        for grid in [own] + [g for g in floor_candidates(N, K, sms) if g != own]:
            bn, bkp, split, w = grid
            label = f"floor {bn}x{bkp * 8} split{split} w{w}"
            try:
                q, s, z = qsets[0]
                got = int(read_floor(q, s, z, GROUP, bn, bkp, split, w).to(torch.int64).sum()) % 2**32
                if got != checksum_ref(q, s, z, GROUP, split, bkp):
                    raise AssertionError("checksum mismatch: the kernel skipped or repeated bytes")
                g_us = graph_time_ms(lambda i: read_floor(*qsets[i % n_q], GROUP, bn, bkp, split, w)) * 1e3
            except Exception as e:  # noqa: BLE001 (record and go on: one call of device time)
                rows.append(dict(base, kind="floor", used=label, error=f"{type(e).__name__}: {str(e)[:300]}"))
                print("  floor failed", label, rows[-1]["error"], flush=True)
                continue
            rows.append(dict(base, kind="floor (default grid)" if grid == own else "floor", used=label, graph_us=g_us,
                             int4_tb_s=int4_bytes / g_us / 1e6))
            print(f"  K={K:5d} N={N:5d} {label:32s} {g_us:6.1f} us  {int4_bytes / g_us / 1e6:4.2f} TB/s  "
                  f"(gemv {gemv_us:.1f}, bf16 {bf16_us:.1f}; {time.perf_counter() - t0:.0f} s)", flush=True)
        for label, us in library_reads(int4_bytes, N, device).items():
            rows.append(dict(base, kind="library read", used=label, graph_us=us, int4_tb_s=int4_bytes / us / 1e6))
            print(f"  K={K:5d} N={N:5d} {label:44s} {us:6.1f} us  {int4_bytes / us / 1e6:4.2f} TB/s", flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(report, f, indent=1)
    for programs, w in ((1, 4), (264, 8), (1064, 4), (8 * sms, 2)):  # one program, 2 and 8 per SM
        us = graph_time_ms(lambda i: empty_launch(programs, w, device)) * 1e3
        rows.append(dict(kind="empty launch", programs=programs, num_warps=w, graph_us=us))
        print(f"  empty launch: {programs} programs of {w} warps {us:.2f} us", flush=True)
    return rows


def print_floor_table(rows: list[dict]) -> None:
    """Per shape: bf16, the time the issue's target allows, the best read-only time, the read-only time on the
    GEMV's own grid, the GEMV; then the engine's four projections summed over 32 layers."""
    from bench_w4a16 import TARGET_SMALL_M

    print("K x N        bf16 us  target us  read floor us (grid)                  floor, GEMV grid  library read  GEMV us  GEMV/floor")
    best = {}
    for K, N in FLOOR_SHAPES:
        rs = [r for r in rows if r.get("K") == K and r.get("N") == N and "graph_us" in r]
        gemv = next((r for r in rs if r["kind"] == "gemv default"), None)
        floors = [r for r in rs if r["kind"].startswith("floor")]
        lib = min((r["graph_us"] for r in rs if r["kind"] == "library read"), default=float("nan"))
        if not gemv or not floors:
            continue
        b = min(floors, key=lambda r: r["graph_us"])
        own = next((r["graph_us"] for r in floors if r["kind"] == "floor (default grid)"), float("nan"))
        best[(K, N)] = (b["graph_us"], gemv["graph_us"])
        target = TARGET_SMALL_M.get((K, N))
        ttxt = f"{gemv['bf16_graph_us'] / target:9.1f}" if target else f"{'-':>9s}"
        print(f"{K:5d}x{N:<5d} {gemv['bf16_graph_us']:8.1f} {ttxt}  {b['graph_us']:6.1f} ({b['used'][6:]:28s})  "
              f"{own:10.1f}  {lib:12.1f}  {gemv['graph_us']:8.1f}  {gemv['graph_us'] / b['graph_us']:6.2f}")
    if all(s in best for s in ENGINE_PROJECTIONS.values()):
        f = sum(best[s][0] for s in ENGINE_PROJECTIONS.values()) * 32
        g = sum(best[s][1] for s in ENGINE_PROJECTIONS.values()) * 32
        print(f"engine projections x 32 layers (batch-1 decode step): GEMVs {g:.0f} us, read floor {f:.0f} us, "
              f"at most {g - f:.0f} us to gain")
    for r in rows:
        if r["kind"] == "empty launch":
            print(f"empty launch, {r['programs']} programs of {r['num_warps']} warps: {r['graph_us']:.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("read_floor needs a CUDA GPU")
    import transformers

    device = torch.device("cuda", torch.cuda.current_device())
    report = {"command": "python research/read_floor.py",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device),
              "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version(), "cuda": torch.version.cuda}}
    t0 = time.perf_counter()
    rows = time_floor(device, report, args.out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print("\nM = 1, us per call (CUDA-graph clock, rotating weights); target us = bf16 us / the issue's ratio")
    print_floor_table(rows)
    print(f"failed: {sum('error' in r for r in rows)}; total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
