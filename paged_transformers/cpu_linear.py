"""The fp32 projections of engine forwards on CPU through oneDNN (``torch.ops.mkldnn._linear_pointwise``)
instead of ``torch.nn.functional.linear`` (MKL's sgemm).

Measured on the 2-core AMD EPYC dev machine (torch 2.13 with MKL 2024.2 and oneDNN 3.12, one thread), SmolLM2
shapes ``[M, K] x [K, N]``, microseconds, MKL / oneDNN::

    N x K             M = 1        4            8            64
    576 x 576         27 / 38      51 / 48      75 / 59      409 / 206
    1536 x 576        53 / 55      144 / 111    210 / 139    1137 / 521
    49152 x 576       7385 / 4125  13773 / 7660 16596 / 8423 47400 / 21185   (the LM head)

MKL is ahead only for one to three rows on a small weight, so a product takes oneDNN from ``MIN_ROWS`` rows, or at
any row count for a weight of ``BIG_WEIGHT`` elements or more. (The plain weight is handed over: oneDNN reorders it
at every call. A pre-reordered copy, ``torch.ops.mkldnn._reorder_linear_weight``, halved the 8-row LM head again,
but costs a second copy of every weight and a repack whenever one changes.)

The routing exists only while an engine forward runs (``RoutedLinears.routed``): each ``nn.Linear``'s ``forward``
is shadowed by an instance attribute and removed after, so plain forwards, training, autograd and ``state_dict``
between steps are stock, and the weights are read as they are at each call (no copy, nothing to go stale).
"""

import contextlib
import platform
import types

import torch
import torch.nn.functional as F

MIN_ROWS = 4  # rows of x from which oneDNN beats MKL on every measured weight
BIG_WEIGHT = 1 << 22  # elements (16 MiB of fp32): oneDNN at any row count (the LM head: 28.3M)


def available() -> bool:
    """Whether this torch has the oneDNN op on an x86-64 CPU (the only kind measured)."""
    return (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class RoutedLinears:
    """The model's fp32 CPU ``nn.Linear`` modules, and their oneDNN forwards (made once).

    Modules whose ``forward`` is already an instance attribute (accelerate's hooks put one there) are left alone.
    """

    def __init__(self, model: torch.nn.Module):
        self.routes = [
            (module, types.MethodType(_forward, module)) for module in model.modules()
            if type(module) is torch.nn.Linear and "forward" not in module.__dict__
            and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32
            and module.weight.is_contiguous()
        ]

    @contextlib.contextmanager
    def routed(self):
        """The block runs with every route installed; they are removed on exit, also on an exception."""
        for module, forward in self.routes:
            module.__dict__["forward"] = forward
        try:
            yield
        finally:
            for module, _ in self.routes:
                module.__dict__.pop("forward", None)


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``: ``x [..., K]`` -> ``[..., N]``, through oneDNN when it is the faster (see the module
    docstring), else ``F.linear``."""
    weight = module.weight
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or (rows < MIN_ROWS and weight.numel() < BIG_WEIGHT):
        return F.linear(x, weight, module.bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), weight, module.bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])
