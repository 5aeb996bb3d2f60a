"""``w4a16_matmul``: argument checks, the launch of the kernel its config names, the split-K workspace, and the
custom op ``torch.ops.paged_transformers.w4a16_matmul`` that compiled graphs keep as one node."""

import importlib.util
import os

import torch

from .._launch import cdiv, load_triton_kernels
from .dispatch import W4A16Algo, W4A16Config, default_config, wgmma_consumers, wgmma_fits, wgmma_maxnreg


class _SplitKWorkspace:
    """Per-device fp32 workspace and tile counters for split-K, zero between calls.

    NOTE: the kernels leave both zeroed, so they are allocated once and reused by every layer. They
    only grow; an outgrown buffer is kept alive because a captured CUDA graph may still point at it.
    Calls on two streams at once would share them: run W4A16 split-K on one stream per device.
    """

    def __init__(self):
        self._buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._retired: list[torch.Tensor] = []

    def get(self, device: torch.device, ws_numel: int, num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        ws, locks = self._buffers.get(device, (None, None))
        if ws is None or ws.numel() < ws_numel or locks.numel() < num_tiles:
            if ws is not None:
                self._retired += [ws, locks]
            ws = torch.zeros(max(ws_numel, 1 << 20), dtype=torch.float32, device=device)
            locks = torch.zeros(max(num_tiles, 1 << 14), dtype=torch.int32, device=device)
            self._buffers[device] = (ws, locks)
        return ws, locks


_WORKSPACE = _SplitKWorkspace()


def _kernels(module: str, device: torch.device):
    """The kernel module ``module`` of this package, compiled on CUDA, interpreted on CPU.

    Raises:
        ValueError: triton is missing, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if importlib.util.find_spec("triton") is None:
        raise ValueError("w4a16_matmul needs triton; use w4a16_matmul_ref")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"w4a16_matmul needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 or use w4a16_matmul_ref")
    return load_triton_kernels(f"w4a16.{module}", device)


def _check_layer(x, qweight, scales, zeros, bits, group_size, bias) -> None:
    """``w4a16_matmul``'s argument checks (its docstring has the rules); raises ``ValueError`` naming the tensor."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with unit stride along K, got shape {tuple(x.shape)} strides {x.stride()}")
    K = x.shape[1]
    pack = 32 // bits
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] * pack != K or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous int32 [K/{pack}={K // pack}, N], got {qweight.dtype} {tuple(qweight.shape)}")
    N = qweight.shape[1]
    if group_size <= 0 or K % group_size:
        raise ValueError(f"group_size={group_size} must divide K={K}")
    G = K // group_size
    if scales.shape != (G, N) or not scales.is_floating_point() or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous float [{G}, {N}], got {scales.dtype} {tuple(scales.shape)}")
    if zeros.shape != (G, N) or zeros.dtype != torch.int16 or not zeros.is_contiguous():
        raise ValueError(f"zeros must be contiguous int16 [{G}, {N}], got {zeros.dtype} {tuple(zeros.shape)}")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{N}], got {tuple(bias.shape)}")
    allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if x.device.type == "cpu" else ())
    if x.dtype not in allowed:
        raise ValueError(f"x must be one of {allowed}, got {x.dtype}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def _check_config(cfg: W4A16Config, x: torch.Tensor, N: int, bits: int, group_size: int, tma_aligned: bool) -> None:
    """Raise ``ValueError`` if ``cfg``'s kernel cannot run this call (its tile and the layer's shape)."""
    M, K = x.shape
    pack = 32 // bits
    if cfg.block_k % pack:
        raise ValueError(f"config.block_k={cfg.block_k} must be a multiple of {pack}")
    if cfg.algo == W4A16Algo.WGMMA:
        why = wgmma_fits(cfg, N, K, group_size, x.device, bits, x.dtype)
        if why is None and not tma_aligned:
            why = "WGMMA's TMA copies need qweight, scales and zeros at 16-byte aligned addresses"
        if why is not None:
            raise ValueError(f"config {cfg}: {why}")
        return
    if cfg.algo == W4A16Algo.GEMV and cfg.block_m != 1:
        raise ValueError(f"config {cfg}: the GEMV needs block_m == 1")
    if cfg.algo == W4A16Algo.GEMV and (M != 1 or group_size % pack):
        raise ValueError(f"config {cfg}: the GEMV needs M == 1 (got {M}) and group_size % {pack} == 0 (got {group_size})")
    if x.is_cuda and cfg.algo in (W4A16Algo.DOT, W4A16Algo.DOT_SWAP) and (cfg.block_m < 16 or cfg.block_k // pack < 16):
        raise ValueError(f"config {cfg}: tl.dot needs block_m >= 16 and block_k // {pack} >= 16")
    if cfg.algo != W4A16Algo.TC:
        return
    if x.is_cuda and cfg.block_m < 8:
        raise ValueError(f"config {cfg}: tl.dot needs block_m >= 8 here (a wgmma of N = 8)")
    if bits != 4:
        raise ValueError(f"config {cfg}: {cfg.algo.value} takes 4-bit weights only, got bits={bits}")
    if group_size % cfg.block_k and group_size != K:
        raise ValueError(f"config {cfg}: {cfg.algo.value} needs group_size ({group_size}) a multiple of block_k or K ({K})")
    if cfg.block_n < 16 or cfg.block_k % 32:
        raise ValueError(f"config {cfg}: the tensor-core tile needs block_n >= 16 and block_k % 32 == 0")


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """Fused dequantize + matmul ``x @ W (+ bias)`` with the Triton kernels.

    Args:
        x: ``[M, K]`` fp16 or bf16 (or fp32 under the interpreter), unit stride along K.
        qweight: int32 ``[K // (32 // bits), N]``, contiguous (layout in the package docstring).
        scales: ``[K // group_size, N]`` fp16/bf16/fp32, contiguous; converted to fp32 in the kernel.
        zeros: int16 ``[K // group_size, N]``, contiguous.
        bits: 4 or 8.
        group_size: input rows per group, dividing K (pass K for per-channel / ``group_size=-1``).
        bias: optional ``[N]``.
        config: a ``W4A16Config``; default ``default_config(...)``.

    Returns:
        ``[M, N]`` in ``x.dtype`` (empty, with no launch, when ``M`` or ``N`` is 0).

    Raises:
        ValueError: a wrong dtype, device, shape or stride (the offending tensor is named), a config
            the kernel cannot run, triton missing, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _check_layer(x, qweight, scales, zeros, bits, group_size, bias)
    M, K = x.shape
    N = qweight.shape[1]
    if M == 0 or N == 0:  # nothing to compute (torch.matmul's empty result; no kernel takes an empty grid)
        return x.new_empty((M, N))
    tma_aligned = all(t.data_ptr() % 16 == 0 for t in (qweight, scales, zeros))
    cfg = config or default_config(M, N, K, group_size, x.device, bits, x.dtype, tma_aligned)
    _check_config(cfg, x, N, bits, group_size, tma_aligned)
    if cfg.algo == W4A16Algo.DEQUANT_MATMUL:
        return _dequant_matmul(x, qweight, scales, zeros, bits, group_size, bias, cfg)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    num_tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    ws, locks = _WORKSPACE.get(x.device, M * N, num_tiles) if cfg.split_k > 1 else (out, out)  # unused without split-K
    if cfg.algo == W4A16Algo.WGMMA:
        _wgmma(x, qweight, scales, zeros, group_size, bias, out, ws, locks, cfg, num_tiles)
        return out
    common = dict(HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (x, qweight, scales, zeros, bias if bias is not None else out, out, ws, locks)
    grid = (num_tiles, cfg.split_k)  # one program per (output tile, K slice); tiles enumerate N-major
    if cfg.algo == W4A16Algo.GEMV:
        _kernels("gemv_kernels", x.device)._w4a16_gemv_kernel[grid](
            *args, N, K, BITS=bits, GROUP_SIZE=group_size, EVEN_K=K % cfg.block_k == 0, EVEN_N=N % cfg.block_n == 0,
            **common)
    elif cfg.algo == W4A16Algo.TC:
        _kernels("tc_kernels", x.device)._w4a16_tc_kernel[grid](
            *args, M, N, K, x.stride(0), out.stride(0), GROUP_SIZE=group_size, BLOCK_M=cfg.block_m,
            USE_ASM=x.is_cuda, EVEN_K=K % cfg.block_k == 0, **common)
    else:
        _kernels("dot_kernels", x.device)._w4a16_dot_kernel[grid](
            *args, M, N, K, x.stride(0), out.stride(0), BITS=bits, GROUP_SIZE=group_size, BLOCK_M=cfg.block_m,
            SWAP=cfg.algo == W4A16Algo.DOT_SWAP, **common)
    return out


def _wgmma(x, qweight, scales, zeros, group_size, bias, out, ws, locks, cfg: W4A16Config, num_tiles: int) -> None:
    """``W4A16Algo.WGMMA`` into ``out`` (arguments and config already checked). x goes through a TMA descriptor, which
    needs a 16-byte aligned base and row stride: a view that has neither is copied first."""
    M, K = x.shape
    N = qweight.shape[1]
    if x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    mod = _kernels("wgmma_kernels", x.device)
    descs = mod.descriptors(x, qweight, scales, zeros, cfg.block_m, cfg.block_n, cfg.block_k)
    consumers = wgmma_consumers(cfg)
    mod._w4a16_wgmma_kernel[(num_tiles, cfg.split_k)](  # one program per (output tile, K slice), tiles N-major
        *descs, bias if bias is not None else out, out, ws, locks, M, N, K, out.stride(0), HAS_BIAS=bias is not None,
        GROUP_SIZE=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.num_stages,
        SPLIT_K=cfg.split_k, CONSUMERS=consumers, num_warps=cfg.num_warps // consumers, maxnreg=wgmma_maxnreg(cfg),
    )  # fmt: skip


def _dequant_matmul(x, qweight, scales, zeros, bits, group_size, bias, cfg: W4A16Config) -> torch.Tensor:
    """``W4A16Algo.DEQUANT_MATMUL`` (arguments already checked): the weight in ``x.dtype``, then ``x @ w`` (cuBLAS)."""
    K, N = x.shape[1], qweight.shape[1]
    # NOTE: a [K, N] scratch weight per call (from the caching allocator); meant for prefill-sized M
    w = torch.empty((K, N), dtype=x.dtype, device=x.device)
    _kernels("dot_kernels", x.device)._w4a16_dequant_kernel[(cdiv(K, cfg.block_k), cdiv(N, cfg.block_n))](
        qweight, scales, zeros, w, N, K, BITS=bits, GROUP_SIZE=group_size, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    out = x @ w
    return out + bias.to(x.dtype) if bias is not None else out


@torch.library.custom_op("paged_transformers::w4a16_matmul", mutates_args=())
def w4a16_matmul_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``w4a16_matmul`` with the default config, as the custom op ``torch.ops.paged_transformers.w4a16_matmul``.

    Dynamo keeps it as one opaque node of a compiled graph instead of tracing the Python validation, the
    Triton launch and the split-K workspace (``_WORKSPACE``, hidden state the compiler must not see); its
    fake implementation gives the ``[M, N]`` output in ``x.dtype``. Arguments, result and errors as
    ``w4a16_matmul``.
    """
    return w4a16_matmul(x, qweight, scales, zeros, bits, group_size, bias)


@w4a16_matmul_op.register_fake
def _w4a16_matmul_fake(x, qweight, scales, zeros, bits, group_size, bias=None):
    return x.new_empty((x.shape[0], qweight.shape[1]))
