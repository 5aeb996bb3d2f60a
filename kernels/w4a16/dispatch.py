"""Launch configurations of ``w4a16_matmul``: ``W4A16Config``, and ``default_config``, a table of rules on the shape."""

import dataclasses
import enum
import functools
import importlib.util
import math
from dataclasses import dataclass

import torch

from .._launch import cuda_capability, num_sms

TUNED_NUM_SMS = 132  # the H200 the rules were tuned on: off CUDA, default_config picks the split-K it gets
TUNED_CAPABILITY = (9, 0)  # and its compute capability (Hopper: WGMMA applies)


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
ANY_SHAPE = (SQUARE, WIDE, TALL)


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of ``RULES``: for ``min_m <= M <= max_m`` and a weight of one of ``shapes``, launch ``config``: its
    ``split_k`` replaced by ``split_k_for`` at ``programs_per_sm`` (which counts one row of output tiles: ``max_m <=
    config.block_m`` in those rows), or, when that is 0, kept as the rule gives it (the sweep's, for 132 SMs) but
    lowered to the largest power of two dividing the K steps (equal K slices) that leaves at least 2 K steps a slice
    (a WGMMA consumer).
    With ``one_wave``, the row applies only where its grid (output tiles x split_k) is at most one program per SM:
    where two programs share some SMs and not others, those SMs set the time, and the next row's fewer programs (no
    split, or taller tiles) win (the WGMMA kernel's dequantization keeps an SM's CUDA cores busy with one program)."""

    min_m: int
    max_m: int
    shapes: tuple[str, ...]
    config: W4A16Config
    programs_per_sm: int
    one_wave: bool = False


def _tile(algo: str, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
          split_k: int = 1) -> W4A16Config:
    return W4A16Config(block_m, block_n, block_k, split_k, num_warps, num_stages, W4A16Algo(algo))


# The first row that matches and whose kernel applies (``_applies``) wins. H200 device time per call, bf16 x, group
# 128, next to bf16 torch.matmul of the shape (BENCHMARKS.md, the W4A16 run of record, unless said otherwise):
RULES = (
    # 4096 x 14336: 13.7 us vs bf16 30.4 (2.22x); 0.8 us faster than 2048-column tiles on q|k|v (7.8 vs 8.7)
    Rule(1, 1, ANY_SHAPE, _tile("gemv", 1, 512, 64, 2, 1), 8),
    # 4096 x 4096 at M = 16: 9.6 us vs bf16 13.2 (1.38x); DOT_SWAP took 16.9 there (round 3)
    Rule(1, 16, ANY_SHAPE, _tile("tc", 16, 64, 128, 4, 3), 4),
    # WGMMA rows: H100 device time, bf16 x, group 128, on the engine's fused shapes, next to bf16 torch.matmul and the
    # kernel these rows replaced, whose weight tile went through shared memory (BENCHMARKS.md, issue 23, 2026-12-06,
    # third session: `research/w4a16_wgmma_rs.py` at commit 2e5ed42)
    # (the times are of the config each row launches; rows with block_k = 128 are followed by rows of block_k = 64 for
    # groups of 64)
    # 4096 x 28672 (gate|up) at M = 32 / 64: 45.9 / 53.5 us vs bf16 84.0 / 81.1, the previous kernel 51.1 / 52.8
    Rule(17, 32, (WIDE,), _tile("wgmma", 32, 128, 64, 4, 4), 0),
    Rule(33, 64, (WIDE,), _tile("wgmma", 64, 128, 64, 4, 4), 0),
    # at M = 128: 67.6 us vs bf16 85.4, previous 71.6
    Rule(65, 128, (WIDE,), _tile("wgmma", 128, 128, 64, 4, 4), 0),
    # at M = 192 / 256: 114.2 / 118.5 us vs bf16 92.9 / 99.2, previous 133.4 / 138.7; 111.3 vs bf16 98.8 at M = 256 with
    # the 16-byte epilogue and the split-scale dequantization (issue 23, 2026-12-07)
    Rule(129, 256, (WIDE,), _tile("wgmma", 256, 128, 64, 8, 4), 0),
    # 14336 x 4096 (down) at M = 32 / 64: 21.2 / 25.2 us vs bf16 43.7 / 45.1 (split 8 at M = 32: 24.6); block_k = 64
    # at M = 64, split 4: 27.9 (split 8: 32.0); at M = 32 split 4 as block_k = 128 (untimed) (issue 23, 2026-12-07,
    # third session, the kernel with a producer warp)
    Rule(17, 32, (TALL,), _tile("wgmma", 32, 64, 128, 4, 4, split_k=4), 0),
    Rule(17, 32, (TALL,), _tile("wgmma", 32, 64, 64, 4, 4, split_k=4), 0),
    Rule(33, 64, (TALL,), _tile("wgmma", 64, 64, 128, 4, 4, split_k=4), 0),
    Rule(33, 64, (TALL,), _tile("wgmma", 64, 64, 64, 4, 4, split_k=4), 0),
    # at M = 128: 46.3 us vs bf16 52.3, previous 48.1; 43.4 vs bf16 53.2 on 2026-12-07
    Rule(65, 128, (TALL,), _tile("wgmma", 128, 64, 64, 4, 4, split_k=4), 0),
    # at M = 192 / 256, two consumers on 128-row tiles (8 warps on 64 columns), 8 stages, no split (128 programs):
    # 56.8 / 57.9 us vs bf16 76.5 / 58.5; 256-row tiles, one consumer, split 2 (the rule before, timed twice in the
    # row) 56.5-56.9 / 62.5-66.2; two consumers with split 2: 70.2 / 78.2 (H100, issue 23, 2026-12-07, sixth session)
    Rule(129, 256, (TALL,), _tile("wgmma", 128, 64, 64, 8, 8), 0),
    # 4096 x 6144 (q|k|v) / 4096 x 4096 (o), issue 23, 2026-12-07, third session (the kernel with a producer warp):
    # one program per SM at most (one_wave) where the grid allows, else fewer programs. At M = 32, o: split 2,
    # 11.6 us vs bf16 14.3 (split 4: 11.5); q|k|v: split 1, 14.4 vs bf16 20.3 (split 2: 14.9, split 4: 18.2); block_k
    # = 64 as block_k = 128 (untimed)
    Rule(17, 32, (SQUARE,), _tile("wgmma", 32, 64, 128, 4, 4, split_k=2), 0, one_wave=True),
    Rule(17, 32, (SQUARE,), _tile("wgmma", 32, 64, 128, 4, 4), 0),
    Rule(17, 32, (SQUARE,), _tile("wgmma", 32, 64, 64, 4, 4, split_k=2), 0, one_wave=True),
    Rule(17, 32, (SQUARE,), _tile("wgmma", 32, 64, 64, 4, 4), 0),
    # at M = 64, o: split 2, 13.3 us vs bf16 14.4; q|k|v: split 1, 14.8 vs bf16 20.4 (split 2: 18.0); block_k = 64,
    # split 2: 15.9 / 19.5 (split 4: 15.1 / 23.8)
    Rule(33, 64, (SQUARE,), _tile("wgmma", 64, 64, 128, 4, 4, split_k=2), 0, one_wave=True),
    Rule(33, 64, (SQUARE,), _tile("wgmma", 64, 64, 128, 4, 4), 0),
    Rule(33, 64, (SQUARE,), _tile("wgmma", 64, 64, 64, 4, 4, split_k=2), 0),
    # at M = 96 / 128, o: 64-row tiles, 15.4 / 14.5 us vs bf16 14.5 / 15.0 (128-row: 21.4 / 21.4; block_k = 64,
    # 128-row split 2: 19.2 / 19.5); q|k|v: 128-row tiles, 22.9 / 22.0 vs bf16 19.7 / 20.3 (64-row at M = 96: 24.2)
    Rule(65, 128, (SQUARE,), _tile("wgmma", 64, 64, 128, 4, 4), 0, one_wave=True),
    Rule(65, 128, (SQUARE,), _tile("wgmma", 128, 64, 64, 4, 4, split_k=2), 0, one_wave=True),
    Rule(65, 128, (SQUARE,), _tile("wgmma", 128, 64, 64, 4, 4), 0),
    # at M = 192 / 256, o: 128-row tiles, 25.7 / 21.8 us vs bf16 16.6 / 17.3 (256-row: 26.6 / 26.5); q|k|v:
    # 256-row tiles, 33.7 / 27.1 vs bf16 28.3 / 24.1 (128-row: 39.0 / 31.7)
    # o at M = 192 / 256 with two consumers on 128-row tiles (8 warps on 64 columns), 8 stages: 19.3 / 19.5 us vs bf16
    # 16.5 / 18.9, one consumer 22.0 / 22.4 (4 stages; 8 stages: 21.0 / 21.5) (issue 23, 2026-12-07, fifth session)
    Rule(129, 256, (SQUARE,), _tile("wgmma", 128, 64, 64, 8, 8), 0, one_wave=True),
    Rule(129, 256, (SQUARE,), _tile("wgmma", 128, 64, 64, 4, 4), 0, one_wave=True),
    Rule(129, 256, (SQUARE,), _tile("wgmma", 256, 64, 64, 4, 4), 0),
    # without WGMMA (not Hopper, or its tiles do not fit): the rows below
    # 4096 x 14336 at M = 64: 39.8 us vs DEQUANT_MATMUL's 73.5 (docs/benchmark-history.md, round 7)
    Rule(17, 64, (WIDE,), _tile("tc", 64, 128, 128, 8, 3), 0),
    # 14336 x 4096 at M = 64: 48.5 us vs DEQUANT_MATMUL's 77.6; without split-K 136.0 (round 7)
    Rule(17, 64, (TALL,), _tile("tc", 64, 128, 128, 8, 3), 2),
    # without TC (8-bit, fp32 x, groups of less than a K step, CPU): 4096 x 4096 at M = 4, 12.9 us vs bf16 12.8 (round 3)
    Rule(1, 4, (SQUARE,), _tile("dot", 16, 64, 128, 4, 3), 4),
    Rule(1, 16, (WIDE, TALL), _tile("dot", 16, 128, 128, 4, 3), 4),
    # 4096 x 4096 at M = 16: 16.9 us vs bf16 13.1 (round 3)
    Rule(5, 16, (SQUARE,), _tile("dot_swap", 16, 64, 128, 4, 3), 4),
    # M = 256: 26.1 / 85.7 / 91.2 us, 0.65x / 0.51x / 0.52x of bf16; the fused Triton GEMMs tried reached 0.58x at best
    Rule(1, 2**62, ANY_SHAPE, _tile("dequant_matmul", 128, 128, 128, 4, 3), 0),
)


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
    if device.type != "cuda" or cuda_capability(device, TUNED_CAPABILITY)[0] != 9:
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
                   dtype: torch.dtype = torch.bfloat16, tma_aligned: bool = True) -> W4A16Config:
    """The launch configuration used when none is given: the first row of ``RULES`` for ``M`` and the weight's shape
    (``weight_shape``) whose kernel applies (and whose grid fits one program an SM, for a ``one_wave`` row), with its
    split-K from ``split_k_for`` (the device's SM count).

    Each row is the fastest configuration of the sweeps for its regime (docs/benchmark-history.md, issue 7, on the
    H200; BENCHMARKS.md, issue 23, on the H100): the GEMV at M = 1, the tensor-core kernel up to 16 rows, on Hopper
    the WGMMA kernel for 17-256 rows; elsewhere the tensor-core kernel for wide or tall weights up to 64 rows;
    dequantize + cuBLAS above (prefill chunks). Batch-1 decode of a GPTQ 4-bit Llama-3-8B shape takes 2.60 ms per
    token with them, bf16 4.44 (1.71x, H200, issue 7); 2.96 against 5.86 on an H100 (1.98x, issue 23, 2026-12-07).

    Args: the GEMM sizes (``x [M, K] @ W [K, N]``), the group size, the device, the weight's bits and x's dtype;
        ``tma_aligned``: whether qweight, scales and zeros have 16-byte aligned base addresses (False leaves out
        WGMMA, whose TMA copies need them).
    Returns: a ``W4A16Config``.
    Raises: ValueError: ``M < 1`` (``w4a16_matmul`` launches nothing for an empty batch).
    """
    if M < 1:
        raise ValueError(f"default_config needs M >= 1, got {M}")
    shape = weight_shape(N, K)
    for rule in RULES:
        if rule.min_m <= M <= rule.max_m and shape in rule.shapes:
            cfg = _with_split(rule, N, K, device)
            if _applies(cfg, N, K, group_size, device, bits, dtype, tma_aligned) and not (
                    rule.one_wave and _num_programs(M, N, cfg) > num_sms(device, TUNED_NUM_SMS)):
                return cfg
    raise AssertionError(f"no rule of RULES for M={M}, {shape}: the last rule must take every M and shape")


def _num_programs(M: int, N: int, cfg: W4A16Config) -> int:
    """Programs of ``cfg``'s grid: output tiles times ``split_k``."""
    return -(-M // cfg.block_m) * -(-N // cfg.block_n) * cfg.split_k


def _with_split(rule: Rule, N: int, K: int, device: torch.device) -> W4A16Config:
    """``rule.config`` with the split-K ``Rule`` describes."""
    cfg = rule.config
    k_iters = -(-K // cfg.block_k)
    if rule.programs_per_sm:
        split = split_k_for(-(-N // cfg.block_n), k_iters, num_sms(device, TUNED_NUM_SMS), rule.programs_per_sm)
    else:
        split = math.gcd(cfg.split_k, k_iters)  # the rules' splits are powers of two
        least = 2 * wgmma_consumers(cfg) if cfg.algo == W4A16Algo.WGMMA else 2
        while split > 1 and k_iters // split < least:  # at least 2 K steps per slice and WGMMA consumer
            split //= 2
    return cfg if split == cfg.split_k else dataclasses.replace(cfg, split_k=split)
