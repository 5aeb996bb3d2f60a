"""The fp32 projections of engine forwards on CPU through oneDNN (``torch.ops.mkldnn._linear_pointwise``)
instead of ``torch.nn.functional.linear`` (MKL's sgemm).

On SmolLM2's shapes (``[M, K] x [K, N]``, one thread) oneDNN computes a product of 4 to 64 rows faster than MKL,
up to about twice as fast at 64 rows and on the LM head; MKL is ahead only for one to three rows on a weight that
stays in cache. In a model whose weights stream from memory every step oneDNN is ahead at one row too, so every fp32
product of up to 64 rows takes it, its rows padded to the next of ``ROW_BUCKETS`` (oneDNN keeps a primitive per
shape, 0.3-1 MiB each, for good: see there). Above 64 rows ``F.linear`` is as fast or faster
(``research/cpu_linear_route.py``, SmolLM2's own weights), so the route ends there. (The plain weight is handed
over: oneDNN reorders it at every call. A pre-reordered copy, ``torch.ops.mkldnn._reorder_linear_weight``, makes
batched steps faster again, but costs a second copy of every weight and a repack whenever the weights change: see
"Packed weights" below.)

The routing exists only while an engine forward runs (``RoutedLinears.routed``): each ``nn.Linear``'s ``forward``
is shadowed by an instance attribute and removed after, so plain forwards, training, autograd and ``state_dict``
between steps are stock, and the plain route reads the weights as they are at each step.

Packed weights (``EngineConfig.cpu_prepack_weights``): when the weights are stable across calls, each routed module
also gets a copy of its weight in oneDNN's own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, as
inductor's weight-pack pass makes it; no batch-size hint, which measured as fast as the best hint at 1, 8 and 64
rows), handed to ``_linear_pointwise`` instead of the plain weight. The engine decides per call, at ``attach``
(``RoutedLinears.weights_changed``): unchanged since a call that ran steps -> pack; written in place -> drop the
packs. The engine's check sees every change of values between calls, also writes through ``.data`` and fused
optimizers, which leave the version counter alone (``weights.py``'s checksums). Each pack is keyed by its weight's
``(data_ptr, _version, shape)`` at pack time and by the weights' generation (``RoutedLinears.generation``, moved by
every change the engine reports), checked at every product: a weight changed since takes the plain route, so a
stale pack is never read, also should a pack outlive the change.
"""

import bisect
import contextlib
import platform
import types

import torch
import torch.nn.functional as F

from .weights import WeightsChange

# Row counts the oneDNN route computes with: a product of other rows is padded to the next one. oneDNN makes (JIT
# compiles) a primitive per shape and two caches keep them, torch's ideep (``LRU_CACHE_CAPACITY``, 1024 entries)
# and oneDNN's own (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1024): 0.3-1 MiB each, so every new row count held memory
# for good (265 MiB over 200 calls of a 2-layer model, still growing). Both capacities are process-wide environment
# variables read at start-up, so the route bounds its shapes instead: at most len(ROW_BUCKETS) per weight shape
# (14 per routed shape, padding at most a third of the rows). Above the largest bucket ``F.linear`` (MKL, which keeps
# nothing per shape) was as fast or faster (module docstring).
ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)


def available() -> bool:
    """Whether this torch has the oneDNN op on an x86-64 CPU (the only kind measured)."""
    return (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class RoutedLinears:
    """The model's fp32 CPU ``nn.Linear`` modules, their oneDNN forwards (made once) and, while the weights are stable,
    packed copies of their weights.

    Modules whose ``forward`` is already an instance attribute (accelerate's hooks put one there) are left alone.

    Args:
        model: the model whose ``nn.Linear`` modules are routed.
        prepack: ``EngineConfig.cpu_prepack_weights``: None packs by the policy of ``weights_changed``; False never
            packs; True packs now (engine start) and again after every change.

    Attributes:
        num_packed_products: products that read a packed weight (a counter; tests and benchmarks read it).
        num_packs: times the weights were packed.
        generation: changes of the weights reported to ``weights_changed``; a pack reads its weight only in the
            generation it was made in.
    """

    def __init__(self, model: torch.nn.Module, prepack: bool | None = None):
        self.routes = [
            (module, types.MethodType(_forward, module)) for module in model.modules()
            if type(module) is torch.nn.Linear and "forward" not in module.__dict__
            and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32
            and module.weight.is_contiguous()
        ]
        self.prepack = prepack
        self.packed_routes: list | None = None  # (module, forward reading its packed weight), while packed
        self.packed_nbytes = 0  # bytes of the packed copies (a second copy of the routed weights)
        self.num_steps = 0  # routed forwards run (the policy packs only after a call that ran steps)
        self.num_packs = 0
        self.num_packed_products = 0
        self.generation = 0
        if prepack:
            self.pack()

    @contextlib.contextmanager
    def routed(self):
        """The block runs with every route installed (the packed ones while packed); they are removed on exit, also on
        an exception."""
        self.num_steps += 1
        for module, forward in self.packed_routes or self.routes:
            module.__dict__["forward"] = forward
        try:
            yield
        finally:
            for module, _ in self.routes:
                module.__dict__.pop("forward", None)

    def weights_changed(self, change: WeightsChange) -> None:
        """The packing policy, run by ``LLMEngine.attach`` once per call with how the weights changed since the
        previous call (``weights.py``). Unchanged, and the engine has run steps on them (a previous call: so an
        evaluation loop packs at its second call, and never at an engine's first) -> pack, if not packed yet.
        Written in place (an optimizer step between calls) -> drop the packs, freeing their memory, so an RL loop
        never packs; with ``prepack=True``, pack again. ``prepack=False``: nothing. Packing reorders every routed
        weight into a new copy, so it is done only when the weights are expected to stay."""
        if change is not WeightsChange.NONE:
            self.generation += 1
            self.drop()
        if self.prepack is False:
            return
        if self.packed_routes is None and (self.prepack or (change is WeightsChange.NONE and self.num_steps > 0)):
            self.pack()

    def pack(self) -> None:
        """Pack every routed weight (a second copy of each, in oneDNN's blocked layout). Weights without a version
        counter (inference tensors) keep the plain route."""
        routes, nbytes = [], 0
        with torch.no_grad():
            for module, forward in self.routes:
                weight = module.weight
                if not weight.is_inference():
                    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
                    key = (weight.data_ptr(), weight._version, weight.shape, self.generation)
                    forward = _packed_forward(self, module, packed, key)
                    nbytes += weight.numel() * weight.element_size()
                routes.append((module, forward))
        self.packed_routes, self.packed_nbytes = routes, nbytes
        self.num_packs += 1

    def drop(self) -> None:
        """Forget the packed weights (their memory is freed); the plain routes stay."""
        self.packed_routes, self.packed_nbytes = None, 0


def _packed_forward(routes: RoutedLinears, module: torch.nn.Linear, packed: torch.Tensor, key: tuple):
    """``module``'s forward reading ``packed`` (its weight at pack time, ``key = (data_ptr, _version, shape,
    generation)``) while the weight and ``routes.generation`` still match ``key``; the plain route (``_forward``)
    otherwise."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        now = (weight.data_ptr(), weight._version, weight.shape, routes.generation)
        if now != key or x.dtype != torch.float32 or x.numel() == 0:
            return _forward(module, x)
        out = _onednn(x, packed, module.bias)
        if out is None:
            return F.linear(x, weight, module.bias)
        routes.num_packed_products += 1
        return out

    return forward


def rows_bucket(rows: int) -> int | None:
    """The row count ``rows`` rows are padded to on the oneDNN route (the smallest of ``ROW_BUCKETS`` that holds
    them), or None above the largest: those products take ``F.linear``."""
    i = bisect.bisect_left(ROW_BUCKETS, rows)
    return ROW_BUCKETS[i] if i < len(ROW_BUCKETS) else None


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x [..., K] @ weight^T + bias`` -> ``[..., N]`` float32 through ``_linear_pointwise`` (``weight`` plain
    ``[N, K]`` or packed), its rows padded with zeros to ``rows_bucket``; None when there are more rows than the
    largest bucket (the caller takes ``F.linear``)."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    bucket = rows_bucket(rows)
    if bucket is None:
        return None
    if bucket != rows:
        x2 = torch.cat([x2, x2.new_zeros(bucket - rows, x2.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[1])


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``: ``x [..., K]`` -> ``[..., N]``, through oneDNN for float32 up to ``ROW_BUCKETS[-1]`` rows
    (``F.linear`` otherwise)."""
    weight = module.weight
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.numel() == 0:
        return F.linear(x, weight, module.bias)
    out = _onednn(x, weight, module.bias)
    return F.linear(x, weight, module.bias) if out is None else out
