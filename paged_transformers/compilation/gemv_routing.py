"""Batch-1 decode projections of the compiled decoder layers on the Triton GEMV (``kernels.gemv``).

Inside a compiled decoder layer every projection is ``aten.mm(x, permute(W, [1, 0]))`` (``addmm`` with a bias)
on a weight ``W [N, K]`` that is a graph input. ``route_linears``, an Inductor post-grad pass that
``layers.INDUCTOR_OPTIONS`` installs, replaces each product on an fp16/bf16 CUDA weight by the custom op
``torch.ops.paged_transformers.linear(x, W, bias)``. The op chooses when it runs: one row of x takes the GEMV,
anything else ``torch.nn.functional.linear`` (cuBLAS, what the ``mm`` would have run). Decode steps replay CUDA
graphs, so the choice is made once, at capture, per batch-size bucket: the batch-1 graph holds GEMVs, the
others cuBLAS GEMMs. Eager (prefill / mixed) steps pay one Python dispatch per projection for the choice.

    compiled layer graph            after route_linears
      mm(x, permute(W, [1, 0]))       paged_transformers.linear(x, W, None)
      addmm(b, x, permute(W, [1, 0])) paged_transformers.linear(x, W, b)

The pass runs after ``fusion.ProjectionCSE`` (a pre pass), so a fused q|k|v product is routed once.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..kernels.gemv import gemv

_HALF = (torch.float16, torch.bfloat16)


@torch.library.custom_op("paged_transformers::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: the Triton GEMV (``kernels.gemv.gemv``) when ``x`` is one fp16/bf16 CUDA row
    with unit stride along K and ``bias`` is None or contiguous ``[N]``, else
    ``torch.nn.functional.linear`` (which also takes a broadcasting bias).

    Args:
        x: ``[M, K]``. weight: ``[N, K]``. bias: optional ``[N]``.

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Raises:
        RuntimeError / ValueError: as ``torch.nn.functional.linear`` for mismatched shapes or dtypes.
    """
    return project(x, weight, bias)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The choice of ``linear`` as a plain function, for eager code (the fused eager layers, ``fused_layers.py``),
    which would otherwise pay the custom op's dispatch at every projection. Same arguments, result and errors."""
    if (x.is_cuda and x.shape[0] == 1 and x.dtype in _HALF and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1
            and (bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous()))):  # fmt: skip
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@linear.register_fake
def _linear_fake(x, weight, bias=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


def route_linears(graph: torch.fx.Graph, device_type: str = "cuda") -> int:
    """Replace, in place, every ``mm(x, permute(W, [1, 0]))`` / ``addmm(b, x, permute(W, [1, 0]))`` (or with
    ``t(W)``, as ``make_fx`` traces ``F.linear``) whose ``W [N, K]`` is an fp16/bf16 tensor on ``device_type``
    with unit stride along K, and ``b`` of shape ``[N]`` (not a broadcast one; no ``beta``/``alpha``), by
    ``paged_transformers.linear(x, W, b)``; the transposes left without users are removed.

    Args:
        graph: an FX graph whose nodes carry ``meta["val"]`` (Inductor's post-grad graphs do).
        device_type: the weights' device type to route (``"cuda"``; tests pass ``"cpu"``).

    Returns:
        The number of products replaced.
    """
    aten = torch.ops.aten
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.kwargs or node.target not in (aten.mm.default, aten.addmm.default):
            continue
        bias, x, wt = node.args if node.target is aten.addmm.default else (None, *node.args)
        if not (isinstance(wt, torch.fx.Node) and (wt.target is aten.t.default or
                                                   (wt.target is aten.permute.default and list(wt.args[1]) == [1, 0]))):
            continue
        w = wt.args[0]
        val = w.meta.get("val") if isinstance(w, torch.fx.Node) else None
        if not (isinstance(val, torch.Tensor) and val.dim() == 2 and val.dtype in _HALF
                and val.device.type == device_type and val.stride(1) == 1):  # fmt: skip
            continue
        if bias is not None:
            bval = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
            if not (isinstance(bval, torch.Tensor) and bval.shape == val.shape[:1]):  # [N]; not a broadcast one
                continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.paged_transformers.linear.default, (x, w, bias))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if not wt.users:
            graph.erase_node(wt)
        replaced += 1
    return replaced


class DecodeLinearPass(CustomGraphPass):
    """Inductor post-grad pass running ``route_linears`` (its ``uuid`` keys Inductor's FX graph cache on this
    file's and the GEMV family's sources)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        route_linears(graph)

    def uuid(self) -> bytes:
        import importlib.util

        digest = hashlib.sha256()
        kernels = importlib.util.find_spec("paged_transformers.kernels.gemv.triton_kernels").origin
        wrapper = importlib.util.find_spec("paged_transformers.kernels.gemv").origin
        for path in (__file__, wrapper, kernels):
            with open(path, "rb") as f:
                digest.update(f.read())
        return digest.digest()
