"""The fp32 projections of engine forwards on CPU through oneDNN (``torch.ops.mkldnn._linear_pointwise``)
instead of ``torch.nn.functional.linear`` (MKL's sgemm).

Measured on the 2-core AMD EPYC dev machine (torch 2.13 with MKL 2024.2 and oneDNN 3.12, one thread), SmolLM2
shapes ``[M, K] x [K, N]``, microseconds, MKL / oneDNN, weights hot in cache::

    N x K             M = 1        4            8            64
    576 x 576         27 / 38      51 / 48      75 / 59      409 / 206
    1536 x 576        53 / 55      144 / 111    210 / 139    1137 / 521
    49152 x 576       7385 / 4125  13773 / 7660 16596 / 8423 47400 / 21185   (the LM head)

MKL is ahead only for one to three rows on a weight that stays in cache; in a model whose weights stream from
memory every step, oneDNN is ahead at one row too (SmolLM2, 16 greedy tokens at batch 1: 0.54 s per call with every
product on oneDNN, 0.61 s with one-to-three-row products on MKL), so every fp32 product takes it. (The plain weight
is handed over: oneDNN reorders it at every call. A pre-reordered copy, ``torch.ops.mkldnn._reorder_linear_weight``,
halved batch 8 again, but costs a second copy of every weight, 538 MB for SmolLM2, and a 0.33 s repack whenever the
weights change.)

The routing exists only while an engine forward runs (``RoutedLinears.routed``): each ``nn.Linear``'s ``forward``
is shadowed by an instance attribute and removed after, so plain forwards, training, autograd and ``state_dict``
between steps are stock, and the weights are read as they are at each call (no copy, nothing to go stale).
"""

import contextlib
import platform
import types

import torch
import torch.nn.functional as F

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
    """``module(x)``: ``x [..., K]`` -> ``[..., N]``, through oneDNN for float32 (``F.linear`` otherwise)."""
    weight = module.weight
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.numel() == 0:
        return F.linear(x, weight, module.bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, module.bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])
