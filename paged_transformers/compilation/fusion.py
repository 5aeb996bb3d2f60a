"""Fused q|k|v and gate|up projections for compiled decoder layers and the fused eager layers
(``fused_layers.py``), without rewriting any model's forward.

A decoder layer computes three projections of one input for attention (``q_proj``, ``k_proj``,
``v_proj``) and two for the MLP (``gate_proj``, ``up_proj``). At decode batch sizes each is a GEMV that
reads its weight once; one GEMV over the concatenated weight ``[sum(out_features), in_features]`` reads
the same bytes in one launch, with fewer, fuller waves (Llama-3-8B shape, M = 1: q|k|v fused in about 40% less
time than separate; docs/benchmark-history.md). vLLM gets this by defining its models with a
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` and splitting the output in the attention forward.

We keep transformers' forward code and instead swap each projection module for a ``FusedLinearSlice``:
all slices of one group share ONE fused module (weight ``[N_q + N_k + N_v, K]``) and each returns
``fused(x)[..., start:stop]``. Eagerly that computes the big product once per slice (3x the work, which
is why fusion is only turned on with compiled layers, or with the fused eager layers, whose forward calls the
fused module once and slices its output itself). Under ``torch.compile`` Dynamo sees the same
weight tensor through every slice and lifts it as one graph input, so the graph holds identical
``mm(x, W^T)`` nodes; ``ProjectionCSE``, a post-grad Inductor pass given in the compile options, merges
them into one (AOTAutograd's own CSE, ``torch._functorch.config.cse``, runs only in the training
partitioner, not on inference graphs: checked on torch 2.13, the mm count stayed 7 per Llama layer).
After the pass the slices are views of one product, exactly like vLLM's ``qkv.split(...)``.

Memory stays neutral: the fused weight is built by concatenation, then the original modules' weights
become views into it (their old storage is freed), so ``model.state_dict()`` keeps its keys and values
while fused, and ``unfuse_projections`` gives each original module a contiguous copy of its slice back.

    decoder layer (fused)                 one fused weight W [N_q + N_k + N_v, K]
      self_attn.q_proj -> FusedLinearSlice(start=0,         stop=N_q)          --.
      self_attn.k_proj -> FusedLinearSlice(start=N_q,       stop=N_q+N_k)        +--> fused(x) = x W^T (+ b)
      self_attn.v_proj -> FusedLinearSlice(start=N_q+N_k,   stop=N_q+N_k+N_v)  --'
      original q_proj.weight = W[0:N_q] (a view), k_proj.weight = W[N_q:N_q+N_k], ...
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..quantization.linear import QuantLinear
from .layers import decoder_layers

# (container attribute of a decoder layer, projection names fused together)
PROJECTION_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))

_QUANT_CAT_DIM1 = ("qweight", "scales", "zeros")  # QuantLinear buffers laid out [.., out_features]


class FusedLinearSlice(nn.Module):
    """Output columns ``[start, stop)`` of a fused projection shared with sibling slices.

    It registers the replaced module's own parameters and buffers (views into the fused ones) under
    their names, so the model's ``state_dict`` keys, shapes and values do not change while fused.

    Args:
        original: the ``nn.Linear`` / ``QuantLinear`` it replaces (kept by the handle, not registered).
        fused: the shared fused module, output ``[..., sum(out_features)]``; held outside the module
            tree (a 1-tuple) so that ``state_dict`` keeps the original keys. ``model.to()`` while fused
            would move the views but not the fused tensors: unfuse first (the engine never moves it).
        start, stop: the slice's output columns in ``fused``'s output.
    """

    def __init__(self, original: nn.Module, fused: nn.Module, start: int, stop: int):
        super().__init__()
        assert stop - start == original.out_features, (start, stop, original.out_features)
        self.in_features, self.out_features = original.in_features, original.out_features
        self.start, self.stop = start, stop
        self._fused = (fused,)
        for name, param in original.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in original.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name not in original._non_persistent_buffers_set)

    @property
    def fused(self) -> nn.Module:
        """The fused module this slice reads."""
        return self._fused[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` -> ``[..., out_features]``: the slice of the fused product (all of it is
        computed; identical products of sibling slices are merged by ``ProjectionCSE`` when compiled)."""
        return self.fused(x)[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, columns=[{self.start}, {self.stop}) of {self.fused.out_features}"


@dataclass
class FusionHandle:
    """What ``fuse_projections`` changed, for ``unfuse_projections``.

    Attributes:
        groups: per fused group, ``(parent module, [(attribute name, original module)], fused module)``.
        skipped: ``"<layer index>.<container>: reason"`` for every group left alone.
    """

    groups: list[tuple[nn.Module, list[tuple[str, nn.Module]], nn.Module]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def num_fused(self) -> int:
        """Number of groups fused (2 per decoder layer when every layer matched)."""
        return len(self.groups)


def _mismatch(mods: list[nn.Module]) -> str | None:
    """Why these projections cannot share one fused module, or None when they can."""
    first = mods[0]
    if type(first) is nn.Linear:
        if any(type(m) is not nn.Linear for m in mods):
            return f"module types differ: {[type(m).__name__ for m in mods]}"
        tensors = [(m.weight, m.bias) for m in mods]
        if len({(w.dtype, w.device, w.shape[1], b is None, None if b is None else b.dtype) for w, b in tensors}) != 1:
            return "in_features, dtype, device or bias presence differ"
        return None
    if type(first) is QuantLinear:
        if any(type(m) is not QuantLinear for m in mods):
            return f"module types differ: {[type(m).__name__ for m in mods]}"
        keys = {(m.in_features, m.bits, m.group_size, m.scales.dtype, m.qweight.device, m.bias is None,
                 None if m.bias is None else m.bias.dtype, m.perm is None) for m in mods}
        if len(keys) != 1:
            return "in_features, bits, group_size, dtypes, device, bias or act-order presence differ"
        if first.perm is not None and not all(torch.equal(first.perm, m.perm) for m in mods[1:]):
            return "act-order permutations differ"
        return None
    return f"not nn.Linear or QuantLinear: {type(first).__name__}"


def _has_instance_forward(mods: list[nn.Module]) -> bool:
    """A module with hooks or a ``forward`` set on the instance (accelerate offload) is not fused."""
    return any("forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks for m in mods)


def _build_fused(mods: list[nn.Module]) -> nn.Module:
    """A fused module over ``mods`` (concatenated along out_features); each original's tensors become
    views into the fused ones (same Parameter objects for parameters, so ties and references hold)."""
    first = mods[0]
    N = sum(m.out_features for m in mods)
    bounds = []
    start = 0
    for m in mods:
        bounds.append((start, start + m.out_features))
        start += m.out_features
    if type(first) is nn.Linear:
        fused = nn.Linear(first.in_features, N, bias=first.bias is not None, device="meta")
        fused.weight = nn.Parameter(torch.cat([m.weight for m in mods]), requires_grad=False)  # [N, K]
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in mods]), requires_grad=False)  # [N]
        for m, (a, b) in zip(mods, bounds):
            m.weight.data = fused.weight[a:b]  # [out_m, K], contiguous rows of W
            if m.bias is not None:
                m.bias.data = fused.bias[a:b]
        return fused
    fused = QuantLinear(first.in_features, N, first.bits, first.group_size, bias=first.bias is not None,
                        act_order=first.perm is not None, dtype=first.bias.dtype if first.bias is not None else torch.float16,
                        scales_dtype=first.scales.dtype, device="meta")
    for name in _QUANT_CAT_DIM1:
        setattr(fused, name, torch.cat([getattr(m, name) for m in mods], dim=1))  # [.., N]
        for m, (a, b) in zip(mods, bounds):
            setattr(m, name, getattr(fused, name)[:, a:b])  # column views (not contiguous)
    if first.perm is not None:
        fused.perm = first.perm  # equal in every module (checked); shared, not copied
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in mods]), requires_grad=False)
        for m, (a, b) in zip(mods, bounds):
            m.bias.data = fused.bias[a:b]
    for m in mods:
        m._cpu_cache = None
    return fused


def fuse_projections(model: nn.Module) -> FusionHandle:
    """Swap, in every decoder layer, q|k|v and gate|up for ``FusedLinearSlice``s of one fused module each.

    A group is fused when its container (``layer.self_attn`` / ``layer.mlp``) has all its projections
    (``PROJECTION_GROUPS``), all plain ``nn.Linear`` with the same ``in_features``, dtype, device and bias
    presence (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3, ...), or all ``QuantLinear`` with the same
    bits, group size, dtypes and act-order permutation (their ``qweight``/``scales``/``zeros`` are laid out
    ``[.., out_features]``, so fusing is a concatenation along the last dim). Anything else (Phi-3's
    ``qkv_proj``, modules with hooks or an instance ``forward``, mixed types) is left alone and listed in
    ``handle.skipped``; a group is fused in every decoder layer or in none (``_fuse_layers``). Memory
    neutral: see the module docstring.

    Only worth it under ``torch.compile`` with ``COMPILE_OPTIONS``, or with the fused eager layers (which call the
    fused module itself): run eagerly through the slices, each computes the whole fused product.

    Args:
        model: a transformers model whose decoder layers subclass ``GradientCheckpointingLayer``.

    Returns:
        A ``FusionHandle`` for ``unfuse_projections``.
    """
    handle = FusionHandle()
    # NOTE: the fused tensors become the model's parameters: never inference tensors, even when called
    # under inference_mode (the runner compiles under it), so the model stays usable outside it.
    with torch.inference_mode(False), torch.no_grad():
        try:
            _fuse_layers(model, handle)
        except BaseException:
            _unfuse_groups(handle)  # no half-fused model
            raise
    return handle


def _group_plans(model: nn.Module) -> list[tuple[tuple[str, ...], list[tuple[nn.Module, list[nn.Module]]], list[str]]]:
    """Per group of ``PROJECTION_GROUPS``: its projection names, ``(container, projections)`` of every decoder layer
    whose projections could share a fused module, and why the others cannot (``handle.skipped``'s entries; empty
    when the group can be fused in every layer). Changes nothing.

    A group (q|k|v, or gate|up) is fused in every layer or in none: layers of one class whose modules differ would
    each need their own Dynamo graph, and past Dynamo's recompile limit (8) the layers run uncompiled, where every
    fused slice computes the whole fused product.
    """
    layers = decoder_layers(model)
    plans = []
    for container, names in PROJECTION_GROUPS:
        found, reasons = [], []
        for i, layer in enumerate(layers):
            parent = getattr(layer, container, None)
            mods = [getattr(parent, n, None) for n in names] if parent is not None else []
            if not mods or any(m is None for m in mods):
                reasons.append(f"{i}.{container}: no {'/'.join(names)}")
                continue
            reason = _mismatch(mods)
            if reason is None and _has_instance_forward(mods):
                reason = "hooks or an instance forward"
            if reason is not None:
                reasons.append(f"{i}.{container}: {reason}")
            found.append((parent, mods))
        if reasons and found and len(reasons) < len(layers):
            reasons.append(f"{container}: fused in no layer, as {len(reasons)} of {len(layers)} cannot be")
        plans.append((names, found, reasons))
    return plans


def unfusable(model: nn.Module) -> list[str]:
    """Why ``fuse_projections`` would leave a group of ``model`` unfused (``"<layer index>.<container>: reason"``
    entries, as ``FusionHandle.skipped``); empty when it would fuse q|k|v and gate|up in every decoder layer. Changes
    nothing."""
    return [reason for _, _, reasons in _group_plans(model) for reason in reasons]


def _fuse_layers(model: nn.Module, handle: FusionHandle) -> None:
    """``fuse_projections``' work: each group that ``_group_plans`` finds fusable in every layer is fused there."""
    for names, found, reasons in _group_plans(model):
        if reasons:
            handle.skipped += reasons
            continue
        for parent, mods in found:
            fused = _build_fused(mods)
            start = 0
            for name, m in zip(names, mods):
                setattr(parent, name, FusedLinearSlice(m, fused, start, start + m.out_features))
                start += m.out_features
            handle.groups.append((parent, list(zip(names, mods)), fused))


def unfuse_projections(handle: FusionHandle) -> None:
    """Undo ``fuse_projections``: put the original modules back, each holding a contiguous copy of its
    slice (same values; the fused tensors are freed once the last copy is made). Idempotent."""
    with torch.inference_mode(False), torch.no_grad():
        _unfuse_groups(handle)


def _unfuse_groups(handle: FusionHandle) -> None:
    """``unfuse_projections``' loop, last group first."""
    while handle.groups:
        parent, originals, fused = handle.groups.pop()
        for name, m in originals:
            for pname, p in m.named_parameters(recurse=False):
                p.data = p.data.clone()
            for bname, b in list(m.named_buffers(recurse=False)):
                if bname != "perm":  # the act-order perm was never replaced
                    setattr(m, bname, b.contiguous().clone())
            setattr(parent, name, m)
        del fused


# -- the compiler pass ------------------------------------------------------------------------------
def _cse_targets() -> set:
    """Pure, deterministic ops that are merged when repeated with identical arguments: the products and
    the layout ops in front of them (the input's reshape and the weight's transpose)."""
    aten = torch.ops.aten
    targets = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.reshape.default, aten.view.default,
               aten._unsafe_view.default, aten.permute.default, aten.t.default, aten.transpose.int,
               aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.clone.default,
               aten.index_select.default, aten._to_copy.default, torch.ops.prims.convert_element_type.default}
    w4a16 = getattr(getattr(torch.ops, "paged_transformers", None), "w4a16_matmul", None)
    if w4a16 is not None:
        targets.add(w4a16.default)
    return targets


def _key(value):
    """A hashable key for an FX argument; scalars keep their type (1, 1.0 and True differ)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, torch.fx.Node):
        return ("node", value)
    return (type(value).__name__, value)


def cse_projection_nodes(graph: torch.fx.Graph) -> int:
    """Merge repeated ``_cse_targets`` nodes with identical arguments (in place, in topological order:
    a later duplicate's users are moved to the first one). Returns the number of nodes removed.

    NOTE: merged products may back several graph outputs (q/k/v are views of one product, as in vLLM);
    that is safe because the attention only reads them, and every merged op is functional.
    """
    targets = _cse_targets()
    seen: dict = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        key = (node.target, _key(node.args), _key(node.kwargs))
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            removed += 1
    return removed


class ProjectionCSE(CustomGraphPass):
    """Inductor post-grad pass running ``cse_projection_nodes`` (its ``uuid`` keys Inductor's FX graph
    cache on this file's source)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        cse_projection_nodes(graph)

    def uuid(self) -> bytes:
        with open(__file__, "rb") as f:
            return hashlib.sha256(f.read()).digest()


# Inductor options the compiled layers need when projections are fused (merged with layers.INDUCTOR_OPTIONS)
COMPILE_OPTIONS = {"post_grad_custom_pre_pass": ProjectionCSE()}
