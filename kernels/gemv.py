"""The linear layer ``x W^T + b`` at decode batch 1 (one row of x): a Triton GEMV, and its PyTorch reference
``gemv_ref``.

At M = 1 a projection reads its whole weight to make one row of output, so its time is the weight's bytes over
the memory bandwidth. cuBLAS reaches 3.1-4.1 TB/s on the projections of a Llama-3-8B layer (H200, M = 1:
BENCHMARKS.md), short of the 4.2 TB/s copy bandwidth on the smaller ones (q|k|v, o). This kernel streams the
weight in its ``nn.Linear`` layout ``[N, K]`` (rows contiguous along K), ``BLOCK_N`` rows per program over all of
K: no split-K and no second reduction kernel, and enough programs (``N / BLOCK_N``, hundreds) to keep every SM
loading. Each step is 16-byte loads of a ``[BLOCK_N, BLOCK_K]`` weight tile and FMAs into an elementwise fp32
accumulator, summed over K once at the end: the shape of the decode GEMVs of FasterTransformer / TensorRT-LLM.

Layout::

    x       [1, K]   fp16 / bf16 (fp32 under the interpreter), unit stride along K
    weight  [N, K]   x's dtype, unit stride along K (nn.Linear's weight; any row stride)
    bias    [N]      optional, any float dtype
    out     [1, N]   x.dtype; the sum is fp32, rounded once

``gemv_fused`` folds the small ops around a decode-layer projection into the same kernel (issue #4): a residual add
and an RMSNorm before it (prologue), SiLU(gate) * up and a residual add after it (epilogue), each rounded where the
eager ops round (``fused_prologue_ref`` / ``fused_epilogue_ref``)::

    h   = x (+ x2)                                        half(x + x2): the residual stream's pending add
    x_n = norm_weight * half(h * rsqrt(mean(h**2) + eps)) transformers' LlamaRMSNorm (with norm_weight)
    y   = x_n @ weight.T (+ bias)                         weight [N, K], or [2I, K] = gate rows | up rows (gated)
    y   = silu(y[:, :I]) * y[:, I:]                       gated: [1, I]
    out = y + residual (+ residual2)                      residual: [1, N] (or [1, I]); half(r + r2) first
"""

from dataclasses import dataclass

import torch

from ._launch import cdiv, load_triton_kernels


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
"""The configuration ``gemv`` uses when none is given. In the H200 sweep of ``benchmarks/bench_gemv.py`` (13
configs, Llama-3-8B projections; BENCHMARKS.md) it was the fastest on q|k|v and within 0.1-1.3 us of the best
config of each other shape; configs with 64 weights per thread per step were up to 1.7x slower."""


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of ``gemv``: the product and the bias in fp32, rounded once to ``x.dtype``.

    Args: as ``gemv``. Returns: ``[1, N]`` in ``x.dtype``.
    """
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fused_prologue_ref(x: torch.Tensor, x2: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                       eps: float = 1e-6) -> torch.Tensor:
    """PyTorch reference of ``gemv_fused``'s prologue: ``h = x + x2`` (in x's dtype), then, with ``norm_weight``,
    transformers' ``LlamaRMSNorm``: ``norm_weight * (h_f32 * rsqrt(mean(h_f32**2, -1) + eps)).to(x.dtype)``.

    Args: x, x2: ``[M, K]`` (same dtype); norm_weight: ``[K]``; eps: the norm's epsilon. Returns: ``[M, K]``.
    """
    h = x if x2 is None else x + x2
    if norm_weight is None:
        return h
    h32 = h.float()
    return norm_weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def fused_epilogue_ref(y: torch.Tensor, residual: torch.Tensor | None = None, residual2: torch.Tensor | None = None,
                       gated: bool = False) -> torch.Tensor:
    """PyTorch reference of ``gemv_fused``'s epilogue on the projection's output ``y`` (``[M, N]``, rounded):
    ``silu(y[:, :N/2]) * y[:, N/2:]`` if ``gated`` (``ACT2FN["silu"]`` then the product, each rounded), then
    ``+ residual`` (``residual + residual2`` first, if given), in y's dtype. Returns: ``[M, N]`` or ``[M, N/2]``.
    """
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    if residual is not None:
        y = y + (residual if residual2 is None else residual + residual2)
    return y


def gemv_fused_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   x2: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                   residual: torch.Tensor | None = None, residual2: torch.Tensor | None = None,
                   gated: bool = False) -> torch.Tensor:
    """PyTorch reference of ``gemv_fused``: ``fused_prologue_ref``, ``gemv_ref`` (fp32 product, one rounding),
    ``fused_epilogue_ref``. Args and returns: as ``gemv_fused``."""
    y = gemv_ref(fused_prologue_ref(x, x2, norm_weight, eps), weight, bias)
    return fused_epilogue_ref(y, residual, residual2, gated)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for one row of ``x``, with the Triton GEMV (module docstring).

    Args:
        x: ``[1, K]``, fp16 or bf16 on CUDA (also fp32 under the interpreter), unit stride along K.
        weight: ``[N, K]``, ``x``'s dtype and device, unit stride along K (any row stride).
        bias: optional contiguous ``[N]`` of any float dtype on ``x``'s device (added in fp32).
        config: a ``GemvConfig``; default ``DEFAULT_GEMV_CONFIG``. Its sizes are not checked against the
            device's limits: a ``block_k`` of hundreds of thousands fails inside Triton.

    Returns:
        ``[1, N]`` in ``x.dtype``.

    Raises:
        ValueError: a wrong shape, dtype, device or stride (the message names the tensor).
        RuntimeError: CPU tensors without the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    _check(x, weight, bias, config)
    return _launch(x, weight, bias, config)


def gemv_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               x2: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               residual: torch.Tensor | None = None, residual2: torch.Tensor | None = None, gated: bool = False,
               config: GemvConfig | None = None) -> torch.Tensor:
    """``gemv`` with the prologue and epilogue of the module docstring folded into the kernel (no argument given:
    exactly ``gemv``). Each step rounds to ``x.dtype`` where ``gemv_fused_ref`` does, so the result equals the
    unfused ops up to the order of the fp32 sums (the GEMV's and the RMSNorm's mean).

    Args:
        x, weight, bias, config: as ``gemv``; with ``gated``, ``weight`` is ``[2I, K]`` (gate rows, then up rows,
            as ``fusion.fuse_projections`` concatenates them) and ``bias`` ``[2I]``.
        x2: ``[1, K]`` like x: the GEMV's input is ``x + x2`` (rounded to x's dtype).
        norm_weight: contiguous ``[K]`` in x's dtype: RMSNorm (transformers' ``LlamaRMSNorm``) of the input.
        eps: the RMSNorm's epsilon (used with ``norm_weight`` only).
        residual, residual2: contiguous ``[1, N_out]`` in x's dtype, added to the output (``N_out`` = N, or I
            when gated); ``residual2`` (only with ``residual``) is added to ``residual`` first.
        gated: write ``silu(gate) * up``, ``[1, I]``.

    Returns:
        ``[1, N_out]`` in ``x.dtype``.

    Raises:
        ValueError: as ``gemv``; an odd row count when gated; a fused operand of the wrong shape, dtype, device
            or layout (the message names it); ``residual2`` without ``residual``.
        RuntimeError: CPU tensors without the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    _check(x, weight, bias, config)
    K, N = x.shape[1], weight.shape[0]
    if gated and N % 2:
        raise ValueError(f"a gated weight has 2I rows (gate | up), got {N}")
    n_out = N // 2 if gated else N
    if residual2 is not None and residual is None:
        raise ValueError("residual2 is added to residual: give residual too")
    for name, t, shape in (("x2", x2, (1, K)), ("norm_weight", norm_weight, (K,)), ("residual", residual, (1, n_out)),
                           ("residual2", residual2, (1, n_out))):
        if t is not None and (tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device
                              or not t.is_contiguous()):  # fmt: skip
            raise ValueError(f"{name} must be a contiguous {x.dtype} {list(shape)} on {x.device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
    return _launch(x, weight, bias, config, x2=x2, norm_weight=norm_weight, eps=float(eps), residual=residual,
                   residual2=residual2, gated=gated)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig | None) -> None:
    """``gemv``'s argument checks (``ValueError`` naming the bad tensor)."""
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


def _launch(x, weight, bias, config, x2=None, norm_weight=None, eps=0.0, residual=None, residual2=None,
            gated=False) -> torch.Tensor:
    """Launch ``_gemv_kernel`` on checked arguments; returns ``[1, N_out]``."""
    cfg = config or DEFAULT_GEMV_CONFIG
    K, N = x.shape[1], weight.shape[0] // (2 if gated else 1)
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    if N == 0 or K == 0:  # nothing to launch: the fused ops on a zero product (the reference handles K = 0)
        return gemv_fused_ref(x, weight, bias, x2=x2, norm_weight=norm_weight, eps=eps, residual=residual,
                              residual2=residual2, gated=gated)
    kernels = load_triton_kernels("gemv_kernels", x.device)
    kernels._gemv_kernel[(cdiv(N, cfg.block_n),)](
        x, weight, bias if bias is not None else out, out, N, K, weight.stride(0),
        x2 if x2 is not None else x, norm_weight if norm_weight is not None else x, eps,
        residual if residual is not None else out, residual2 if residual2 is not None else out,
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0,
        HAS_X2=x2 is not None, HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        HAS_RESIDUAL2=residual2 is not None, GATED=gated, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
