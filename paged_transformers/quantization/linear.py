"""``QuantLinear``: an ``nn.Linear`` replacement holding int4/int8 packed weights.

Forward: gather the act-order input columns once (if any), then the fused W4A16 Triton kernel on
CUDA for fp16/bf16 activations, else the PyTorch reference (dequantize per group, matmul). Under
``torch.compile`` the kernel is called through the custom op ``torch.ops.paged_transformers.w4a16_matmul``,
so compiled decoder layers keep it as one node; eagerly (eager steps, CUDA-graph capture: one call per projection
per layer) it is called directly, without the custom op's dispatch (about 10-35 us a call in
PyTorch's own measurements, pytorch/pytorch#139500 and pytorch/pytorch#177109).
"""

import torch
from torch import nn

from ..kernels.w4a16 import dequantize_packed, w4a16_matmul, w4a16_matmul_op, w4a16_matmul_ref
from .formats import PackedWeight


class QuantLinear(nn.Module):
    """A linear layer ``y = x W^T + b`` with ``W`` stored in the W4A16 kernel layout.

    Buffers (created empty on ``device``; fill them with ``load_packed``)::

        qweight  int32 [in_features // (32 // bits), out_features]
        scales   [n_groups, out_features]   (the checkpoint's dtype, fp16 for GPTQ/AWQ; converted to
                                             fp32 inside the kernel, so bf16 activations lose nothing)
        zeros    int16 [n_groups, out_features]
        perm     int64 [in_features]        only for act-order checkpoints
        bias     [out_features]             a frozen Parameter in the activation dtype, if any

    Args:
        in_features, out_features: as ``nn.Linear``.
        bits: 4 or 8. group_size: rows per group, -1 for per channel.
        bias: whether the layer has a bias.
        act_order: whether to hold an input permutation ``perm``.
        dtype: the activation dtype (the bias's); scales_dtype: the scales' dtype.
        device: where the buffers live.

    Raises:
        ValueError: ``in_features`` not a multiple of ``32 // bits`` or of ``group_size``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int,
        bias: bool,
        act_order: bool = False,
        dtype: torch.dtype = torch.float16,
        scales_dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        pack = 32 // bits
        gs = in_features if group_size == -1 else group_size
        if bits not in (4, 8) or in_features % pack or in_features % gs:
            raise ValueError(f"QuantLinear: in_features={in_features} must be a multiple of {pack} and of group_size={gs} (bits={bits})")
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, gs
        groups = in_features // gs
        self.register_buffer("qweight", torch.empty(in_features // pack, out_features, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(groups, out_features, dtype=scales_dtype, device=device))
        self.register_buffer("zeros", torch.empty(groups, out_features, dtype=torch.int16, device=device))
        self.register_buffer("perm", torch.empty(in_features, dtype=torch.int64, device=device) if act_order else None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self._cpu_cache: tuple | None = None

    # NOTE: on CPU (tests, CI) dequantizing every layer at every forward dominates the run time, so
    # the reference path keeps each layer's dequantized weight after its first forward. This is a
    # CPU convenience only: loading never builds it, and the CUDA path never materializes it.
    cache_dequantized_on_cpu: bool = True

    def load_packed(self, packed: PackedWeight, prefix: str = "") -> None:
        """Copy a converted layer in (moving it to this module's device).

        Raises:
            ValueError: a shape, bit width or group size that does not match this module (``prefix``
                names the layer).
        """
        if (packed.bits, packed.group_size) != (self.bits, self.group_size):
            raise ValueError(f"{prefix}: bits/group_size {packed.bits}/{packed.group_size} != module's {self.bits}/{self.group_size}")
        if (packed.perm is None) != (self.perm is None):
            raise ValueError(f"{prefix}: act-order permutation {'missing' if packed.perm is None else 'unexpected'}")
        self._cpu_cache = None
        for name in ("qweight", "scales", "zeros", "perm"):
            src, dst = getattr(packed, name), getattr(self, name)
            if src is None:
                continue
            if src.shape != dst.shape:
                raise ValueError(f"{prefix}.{name}: converted shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
            dst.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` (fp16/bf16 on CUDA: Triton; anything else: reference) -> ``[..., out_features]`` in ``x.dtype``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)  # act-order: one gather per layer, not per tile
        elif x2.stride(1) != 1:
            x2 = x2.contiguous()
        args = (x2, self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.bias)
        if x2.is_cuda and x2.dtype in (torch.float16, torch.bfloat16):
            # the custom op is one opaque node inside compiled layers; eagerly its dispatch is pure host overhead
            out = w4a16_matmul_op(*args) if torch.compiler.is_compiling() else w4a16_matmul(*args)
        elif x2.is_cuda or not self.cache_dequantized_on_cpu or torch.compiler.is_compiling():
            # NOTE: under torch.compile the reference is traced into the graph (the weight cache below keys on
            # data_ptr() and mutates the module, which Dynamo would answer with a graph break per layer)
            out = w4a16_matmul_ref(*args)
        else:
            out = x2 @ self._cpu_weight(x2.dtype)
            if self.bias is not None:
                out = out + self.bias.to(x2.dtype)
        return out.reshape(*lead, self.out_features)

    def drop_dequantized(self) -> None:
        """Forget the reference path's dequantized weight (``_cpu_weight``), which is keyed by the buffers'
        addresses only: after an in-place write to ``qweight``, ``scales`` or ``zeros`` (the engine calls it when
        the weights changed, ``ModelRunner.weights_changed``)."""
        self._cpu_cache = None

    def _cpu_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The reference path's dequantized ``[K, N]`` weight (permuted rows), kept after first use."""
        key = (dtype, self.qweight.data_ptr(), self.scales.data_ptr(), self.zeros.data_ptr())
        if self._cpu_cache is None or self._cpu_cache[0] != key:
            w = dequantize_packed(self.qweight, self.scales, self.zeros, self.bits, self.group_size).to(dtype)
            self._cpu_cache = (key, w)
        return self._cpu_cache[1]

    def dequantize(self) -> torch.Tensor:
        """The exact weight as float32 ``[out_features, in_features]`` in the original input order."""
        w = dequantize_packed(self.qweight, self.scales, self.zeros, self.bits, self.group_size)  # [K, N], permuted rows
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(0, self.perm, w)
        return w.t()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, act_order={self.perm is not None}, bias={self.bias is not None}"
        )
