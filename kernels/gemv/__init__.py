"""The linear layer ``x W^T + b`` at decode batch 1 (one row of x): a Triton GEMV, and its PyTorch reference
``gemv_ref``.

At M = 1 a projection reads its whole weight to make one row of output, so its time is the weight's bytes over
the memory bandwidth. cuBLAS stays short of the copy bandwidth on the smaller projections of a Llama-3-8B layer
(q|k|v, o; docs/benchmark-history.md). This kernel streams
the weight in its ``nn.Linear`` layout ``[N, K]`` (rows contiguous along K), ``BLOCK_N`` rows per program over all of
K: no split-K and no second reduction kernel, and enough programs (``N / BLOCK_N``, hundreds) to keep every SM
loading. Each step is 16-byte loads of a ``[BLOCK_N, BLOCK_K]`` weight tile and FMAs into an elementwise fp32
accumulator, summed over K once at the end: the shape of the decode GEMVs of FasterTransformer / TensorRT-LLM.

Layout::

    x       [1, K]   fp16 / bf16 (fp32 under the interpreter), unit stride along K
    weight  [N, K]   x's dtype, unit stride along K (nn.Linear's weight; any row stride)
    bias    [N]      optional, any float dtype
    out     [1, N]   x.dtype; the sum is fp32, rounded once
"""

from dataclasses import dataclass

import torch

from .._launch import cdiv, load_triton_kernels


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Launch configuration of the GEMV: ``block_n`` weight rows per program, a K step of ``block_k``,
    ``num_warps`` warps per program.

    Raises:
        ValueError: a size that is not a positive power of two, or more than 32 warps.
    """

    block_n: int
    block_k: int
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if type(value) is not int or value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a positive power of two, got {value!r}")
        if self.num_warps > 32:
            raise ValueError(f"GemvConfig.num_warps must be at most 32 (1024 threads), got {self.num_warps}")

    def __str__(self) -> str:
        return f"gemv {self.block_n}x{self.block_k} w{self.num_warps}"


DEFAULT_GEMV_CONFIG = GemvConfig(block_n=8, block_k=512, num_warps=4)
"""The configuration of ``default_gemv_config`` below 16,384 rows. In the sweep of ``research/bench_gemv.py``
(13 configs, Llama-3-8B projections; docs/benchmark-history.md) it was the fastest on q|k|v and close to the best
config of each other shape; configs with 64 weights per thread per step were up to 1.7x slower."""

WIDE_GEMV_CONFIG = GemvConfig(block_n=4, block_k=1024, num_warps=4)
"""The configuration of ``default_gemv_config`` from 16,384 rows on: in both sweeps of ``research/bench_gemv.py``
(docs/benchmark-history.md) it beat ``DEFAULT_GEMV_CONFIG`` on gate|up (28672 x 4096) and on the LM head
(128256 x 4096), by up to 2.5%, and lost on every smaller projection."""


def default_gemv_config(N: int, K: int) -> GemvConfig:
    """The ``GemvConfig`` ``gemv`` uses for a weight ``[N, K]`` when none is given: ``WIDE_GEMV_CONFIG`` for
    ``N >= 16384`` (many programs: smaller, longer ones), ``DEFAULT_GEMV_CONFIG`` otherwise. ``K`` is not used
    (the sweeps had K = 4096 and 14336 only)."""
    return WIDE_GEMV_CONFIG if N >= 16384 else DEFAULT_GEMV_CONFIG


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of ``gemv``: the product and the bias in fp32, rounded once to ``x.dtype``.

    Args: as ``gemv``. Returns: ``[1, N]`` in ``x.dtype``.
    """
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for one row of ``x``, with the Triton GEMV (module docstring).

    Args:
        x: ``[1, K]``, fp16 or bf16 on CUDA (also fp32 under the interpreter), unit stride along K.
        weight: ``[N, K]``, ``x``'s dtype and device, unit stride along K (any row stride).
        bias: optional contiguous ``[N]`` of any float dtype on ``x``'s device (added in fp32).
        config: a ``GemvConfig``; default ``default_gemv_config(N, K)``. Its sizes are not checked against the
            device's limits: a ``block_k`` of hundreds of thousands fails inside Triton.

    Returns:
        ``[1, N]`` in ``x.dtype``.

    Raises:
        ValueError: a wrong shape, dtype, device or stride (the message names the tensor).
        RuntimeError: CPU tensors without the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"x must be [1, K] with unit stride along K, got shape {tuple(x.shape)} strides {x.stride()}")
    K = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, K={K}] with unit stride along K, got shape {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    N = weight.shape[0]
    allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if x.device.type == "cpu" else ())
    if x.dtype not in allowed or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one dtype of {allowed}, got {x.dtype} and {weight.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous() or not bias.is_floating_point()):
        raise ValueError(f"bias must be a contiguous float [{N}], got {bias.dtype} {tuple(bias.shape)}")
    if config is not None and not isinstance(config, GemvConfig):
        raise ValueError(f"config must be a GemvConfig, got {type(config).__name__}")
    cfg = config or default_gemv_config(N, K)
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    if N == 0 or K == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(x.dtype).expand(1, N))
    kernels = load_triton_kernels("gemv.triton_kernels", x.device)
    kernels._gemv_kernel[(cdiv(N, cfg.block_n),)](
        x, weight, bias if bias is not None else out, out, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
