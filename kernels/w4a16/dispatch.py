"""Launch configurations of ``w4a16_matmul``: ``W4A16Config``, whether a kernel can run a layer, and
``default_config``, which takes the first candidate that can from the device's tuning table (``tables.py``)."""

import dataclasses
import enum
import functools
import importlib.util
import math
from dataclasses import dataclass

import torch

from .._launch import cuda_capability, num_sms
from .tables import Candidate, Table, fallback_candidates, table_for

STAND_IN_NUM_SMS = 132  # off CUDA (the Triton interpreter), the SM count split-K is computed for
STAND_IN_CAPABILITY = (9, 0)  # and the compute capability (only CUDA devices reach the capability checks)


class W4A16Algo(enum.Enum):
    """Which kernel a ``W4A16Config`` launches (the package docstring describes each).

    * ``GEMV``: the ``M = 1`` kernel (``gemv_kernel``), a 1-D fp32 accumulator; ``block_m`` must be 1;
    * ``DOT`` / ``DOT_SWAP``: per-field unpack and one ``tl.dot`` per field (``dot_kernels``), the weight as the right
      operand (``DOT``) or, transposed, as the left one (``DOT_SWAP``: ``BLOCK_M`` is then the MMA's small N);
    * ``TC``: swap AB with the whole ``[BLOCK_N, BLOCK_K]`` tile dequantized to exact integers ``q - z`` and one
      ``tl.dot`` per K step (``tc_kernel``; 4-bit, each K step in one group);
    * ``WGMMA``: Hopper only (sm_90), 4 bits, fp16/bf16 x; a Gluon kernel (``wgmma_kernels``) that tiles M and N,
      copies its inputs with TMA ``num_stages`` deep and dequantizes each K step's weight tile straight into the
      registers wgmma reads (swap AB: ``block_n`` is wgmma's M, ``block_m`` its N) while the tensor cores run the
      previous step's wgmma; ``num_warps`` 4 or 8, each warp taking 16-row slices of the weight tile, except 8 warps
      on a 64-column tile: two warpgroups that take alternate K steps (``wgmma_consumers``);
    * ``DEQUANT_MATMUL``: a Triton pass writes the weight in ``x.dtype`` to a scratch ``[K, N]`` buffer, then
      ``torch.matmul`` (cuBLAS), as exllama does for large batches.
    """

    GEMV = "gemv"
    DOT = "dot"
    DOT_SWAP = "dot_swap"
    TC = "tc"
    WGMMA = "wgmma"
    DEQUANT_MATMUL = "dequant_matmul"


@dataclass(frozen=True, slots=True)
class W4A16Config:
    """Launch configuration of ``w4a16_matmul``: a ``[block_m, block_n]`` output tile per program, K steps of
    ``block_k`` rows, ``split_k`` programs sharing each output tile (split-K), ``num_warps`` and ``num_stages`` as
    Triton takes them (``WGMMA`` with two consumers launches ``num_warps // 2`` a partition, ``wgmma_consumers``), and
    the ``algo``, which may be given as its string value.

    ``block_k`` must be a multiple of ``32 // bits`` (checked at launch, with the other per-algo limits).

    Raises:
        ValueError: an unknown ``algo``, a non-positive size, or a block size or ``num_warps`` that is not a power of
            two (``tl.arange`` and Triton's warp count need one).
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    algo: W4A16Algo = W4A16Algo.DOT

    def __post_init__(self):
        if not isinstance(self.algo, W4A16Algo):
            try:
                object.__setattr__(self, "algo", W4A16Algo(self.algo))
            except ValueError:
                raise ValueError(f"unknown W4A16 algo {self.algo!r}; allowed: {[a.value for a in W4A16Algo]}") from None
        for name in ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"W4A16Config.{name} must be a positive int, got {value!r}")
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"W4A16Config.{name} must be a power of two, got {value!r}")

    def __str__(self) -> str:
        return (f"{self.algo.value} {self.block_m}x{self.block_n}x{self.block_k} split{self.split_k} "
                f"w{self.num_warps} s{self.num_stages}")


def split_k_for(num_tiles: int, k_iters: int, num_sms: int, programs_per_sm: int = 4) -> int:
    """Split-K count that gives about ``programs_per_sm`` programs per SM (each SM streams weights from
    several programs at once), at most one K step per program.

    Args: output tiles of the grid, K steps (``ceil(K / BLOCK_K)``), SMs of the device.
    Returns: an int in ``[1, k_iters]``.
    """
    return max(1, min(k_iters, -(-programs_per_sm * num_sms // num_tiles)))


SQUARE, WIDE, TALL = "square", "wide", "tall"


@functools.lru_cache(maxsize=None)
def has_gluon() -> bool:
    """Whether this Triton has the Gluon API ``WGMMA`` is written against (``triton.experimental.gluon``; Triton >= 3.6:
    tested on 3.6 and 3.9)."""
    try:
        if importlib.util.find_spec("triton.experimental.gluon") is None:
            return False
    except ImportError:  # no triton at all
        return False
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 6)


_HOPPER_SMEM_BYTES = 227 * 1024  # shared memory a block may use on sm_90


def wgmma_consumers(config: W4A16Config) -> int:
    """Consumer warpgroups of the WGMMA kernel that take alternate K steps of a program: 2 for 8 warps on a 64-column
    tile (a warpgroup's wgmma covers 64 weight columns, so two cannot split them), else 1 (8 warps on a wider tile
    split its columns). Each consumer gets ``num_warps // consumers`` warps."""
    return 2 if config.num_warps == 8 and config.block_n == 64 else 1


def _wgmma_smem_bytes(config: W4A16Config) -> int:
    """Shared memory of the WGMMA kernel (bytes): per stage of its ring the x tile ``[block_m, block_k]`` (16-bit),
    the packed words ``[block_k // 8, block_n]`` (int32), a row of scales (at most fp32) and of zero points (int16);
    with two consumers the second's fp32 tile ``[block_n, block_m]``."""
    per_stage = config.block_m * config.block_k * 2 + config.block_k // 8 * config.block_n * 4 + config.block_n * 6
    second = config.block_n * config.block_m * 4 if wgmma_consumers(config) == 2 else 0
    return config.num_stages * (per_stage + 16) + second  # + each stage's "ready" and "empty" mbarriers


def wgmma_maxnreg(config: W4A16Config) -> int:
    """Registers a thread (``maxnreg``) the WGMMA kernel launches with: its ``num_warps`` consumer warps and the
    producer's warpgroup (4 warps, of which one runs; the rest keep 24 registers a thread) share the 65,536 registers
    of an SM, or half of them where 4 warps' ring fits twice in shared memory (two programs an SM). At most 256, in
    steps of 8; ``warp_specialize`` then gives the default partition what the other partitions leave."""
    registers = 32768 if config.num_warps == 4 and 2 * _wgmma_smem_bytes(config) <= _HOPPER_SMEM_BYTES else 65536
    return min(256, registers // (32 * (config.num_warps + 4)) // 8 * 8)


def wgmma_fits(config: W4A16Config, N: int, K: int, group_size: int, device: torch.device, bits: int,
               dtype: torch.dtype) -> str | None:
    """Why ``W4A16Algo.WGMMA`` with ``config`` cannot run this layer (a sentence), or ``None`` when it can: a
    Hopper GPU (sm_90: wgmma) and Gluon; 4 bits and fp16/bf16 x; block_m 16-256 (wgmma's N; at most 128 with two
    consumers, whose second partition's registers hold a 128-row tile), block_n a multiple of 16 * (a consumer's
    warps) up to 256 (wgmma's M), block_k 64 or 128, 4 or 8 warps, at least 3 stages (4 with two consumers: see the
    kernel's docstring), shared memory that fits (``_wgmma_smem_bytes``); every K step in one group and the K slices
    whole, of at least 2 steps a consumer (``K % (block_k * split_k) == 0``); ``N % 8 == 0`` (TMA: 16-byte row
    strides of the scales and zero points)."""
    if device.type != "cuda" or cuda_capability(device, STAND_IN_CAPABILITY)[0] != 9:
        return f"WGMMA needs a Hopper (sm_90) GPU, got {device}"
    if not has_gluon():
        return "WGMMA needs Gluon (triton >= 3.6)"
    if bits != 4 or dtype not in (torch.float16, torch.bfloat16):
        return f"WGMMA takes 4-bit weights and fp16/bf16 x, got bits={bits}, {dtype}"
    # (W4A16Config's block sizes are powers of two)
    if not 16 <= config.block_m <= 256:
        return f"WGMMA needs block_m 16-256 (wgmma's N), got {config.block_m}"
    if config.num_warps not in (4, 8):
        return f"WGMMA needs 4 or 8 warps, got {config.num_warps}"
    consumers = wgmma_consumers(config)
    if consumers == 2 and config.block_m > 128:
        return (f"WGMMA with two consumers (8 warps on 64 columns) needs block_m <= 128, got {config.block_m}: the "
                "second consumer's 160 registers a thread hold a 128-row fp32 tile")
    if config.block_n % (16 * config.num_warps // consumers) or config.block_n > 256:
        return (f"WGMMA needs block_n a multiple of 16 * num_warps up to 256 (64 on 8 warps), got {config.block_n} on "
                f"{config.num_warps} warps")
    if config.block_k not in (64, 128) or config.num_stages < 2 + consumers:
        return (f"WGMMA needs block_k 64 or 128 and num_stages >= {2 + consumers} ({consumers} consumer warpgroups), "
                f"got {config.block_k} and {config.num_stages}")
    smem = _wgmma_smem_bytes(config)
    if smem > _HOPPER_SMEM_BYTES:
        return (f"WGMMA with {config.num_stages} stages needs {smem} bytes of shared memory, over "
                f"{_HOPPER_SMEM_BYTES}")
    if group_size % config.block_k and group_size != K:
        return f"WGMMA needs group_size ({group_size}) a multiple of block_k or K ({K})"
    if K % (config.block_k * config.split_k) or K // (config.block_k * config.split_k) < 2 * consumers or N % 8:
        return (f"WGMMA needs K ({K}) a multiple of block_k * split_k, at least {2 * consumers} K steps per slice, "
                f"and N ({N}) a multiple of 8")
    return None


def _applies(config: W4A16Config, N: int, K: int, group_size: int, device: torch.device, bits: int,
             dtype: torch.dtype, tma_aligned: bool) -> bool:
    """Whether ``config``'s kernel can run this layer: the GEMV needs groups of whole int32 words (for 4 and 8 bits);
    TC is inline PTX on CUDA for 4 bits and fp16/bf16 x, with every K step inside one group; WGMMA as ``wgmma_fits``
    says, with TMA-aligned weight tensors."""
    if config.algo == W4A16Algo.GEMV:
        return group_size % 8 == 0
    if config.algo == W4A16Algo.TC:
        return (device.type == "cuda" and bits == 4 and dtype in (torch.float16, torch.bfloat16)
                and (group_size % config.block_k == 0 or group_size == K))
    if config.algo == W4A16Algo.WGMMA:
        return tma_aligned and wgmma_fits(config, N, K, group_size, device, bits, dtype) is None
    return True


def weight_shape(N: int, K: int) -> str:
    """``"wide"`` when ``N >= 2K`` (gate/up projections, 4096 x 14336), ``"tall"`` when ``K >= 2N`` (down projection,
    14336 x 4096), else ``"square"`` (4096 x 4096)."""
    return WIDE if N >= 2 * K else TALL if K >= 2 * N else SQUARE


def default_config(M: int, N: int, K: int, group_size: int, device: torch.device, bits: int = 4,
                   dtype: torch.dtype = torch.bfloat16, tma_aligned: bool = True,
                   table: Table | None = None) -> W4A16Config:
    """The launch configuration used when none is given: the first candidate for ``M`` and the weight's shape
    (``weight_shape``) in the device's tuning table (``tables.table_for``; ``tables.fallback_candidates`` on a
    device without one, and past the table's rows) whose kernel applies (``_applies``; for a ``one_wave`` candidate,
    whose grid is at most one program an SM), with its split-K count (``_config``).

    Args: the GEMM sizes (``x [M, K] @ W [K, N]``), the group size, the device, the weight's bits and x's dtype;
        ``tma_aligned``: whether qweight, scales and zeros have 16-byte aligned base addresses (False leaves out
        WGMMA, whose TMA copies need them); ``table``: the table to read instead of the device's.
    Returns: a ``W4A16Config``.
    Raises: ValueError: ``M < 1`` (``w4a16_matmul`` launches nothing for an empty batch).
    """
    if M < 1:
        raise ValueError(f"default_config needs M >= 1, got {M}")
    table = table if table is not None else table_for(device)
    found = table.candidates(weight_shape(N, K), M) if table is not None else ()
    sms = num_sms(device, STAND_IN_NUM_SMS)
    for candidate in found + fallback_candidates(M):
        cfg = _config(candidate, N, K, sms)
        if _applies(cfg, N, K, group_size, device, bits, dtype, tma_aligned) and not (
                candidate.one_wave and _num_programs(M, N, cfg) > sms):
            return cfg
    raise AssertionError(f"no W4A16 candidate for M={M}: the fallback's last candidate runs any layer")


def _num_programs(M: int, N: int, cfg: W4A16Config) -> int:
    """Programs of ``cfg``'s grid: output tiles times ``split_k``."""
    return -(-M // cfg.block_m) * -(-N // cfg.block_n) * cfg.split_k


def _config(candidate: Candidate, N: int, K: int, sms: int) -> W4A16Config:
    """``candidate`` as a ``W4A16Config`` for an ``N``-column, ``K``-row weight on ``sms`` SMs, with the split-K count
    its ``split_k_rule`` gives: ``programs_per_sm``, ``split_k_for`` over one row of output tiles; ``fixed``, its count
    lowered to the largest power of two dividing the K steps (equal slices) that leaves at least 2 K steps a slice
    and WGMMA consumer."""
    cfg = W4A16Config(candidate.block_m, candidate.block_n, candidate.block_k, 1, candidate.num_warps,
                      candidate.num_stages, W4A16Algo(candidate.algo))
    k_iters = -(-K // cfg.block_k)
    if candidate.split_k_rule == "programs_per_sm":
        split = split_k_for(-(-N // cfg.block_n), k_iters, sms, candidate.programs_per_sm)
    else:
        split = math.gcd(candidate.split_k, k_iters)
        least = 2 * wgmma_consumers(cfg) if cfg.algo == W4A16Algo.WGMMA else 2
        while split > 1 and k_iters // split < least:
            split //= 2
    return dataclasses.replace(cfg, split_k=split)
