"""The read floor of a W4A16 layer: how long a kernel takes that only *reads* the bytes a W4A16 GEMV must read
(packed weight, scales, zero points) and does nothing else, on a split-K grid like the GEMV's.

A GEMV on such a grid reads the same bytes and also dequantizes, multiplies, reduces and writes, so this is as fast as
it could be; it is the fastest read of those bytes we found, not a proven hardware bound (cuBLAS reading as many
bytes is slower: BENCHMARKS.md, issue 7, round 8). ``bench_w4a16.py --variants floor`` times it next to the GEMV and
bf16 ``torch.matmul`` to show how much of the GEMV's time is the read itself.

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

import torch
import triton
import triton.language as tl


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
