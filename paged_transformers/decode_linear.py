"""Batch-1 decode projections of the compiled decoder layers on the Triton GEMV (``kernels.gemv``).

Inside a compiled decoder layer every projection is ``aten.mm(x, permute(W, [1, 0]))`` (``addmm`` with a bias)
on a weight ``W [N, K]`` that is a graph input. ``route_linears``, an Inductor post-grad pass that
``compile.INDUCTOR_OPTIONS`` installs, replaces each product on an fp16/bf16 CUDA weight by the custom op
``torch.ops.paged_transformers.linear(x, W, bias)``. The op chooses when it runs: one row of x takes the GEMV,
anything else ``torch.nn.functional.linear`` (cuBLAS, what the ``mm`` would have run). Decode steps replay CUDA
graphs, so the choice is made once, at capture, per batch-size bucket: the batch-1 graph holds GEMVs, the
others cuBLAS GEMMs. Eager (prefill / mixed) steps pay one Python dispatch per projection for the choice.

    compiled layer graph            after route_linears
      mm(x, permute(W, [1, 0]))       paged_transformers.linear(x, W, None)
      addmm(b, x, permute(W, [1, 0])) paged_transformers.linear(x, W, b)

The pass runs after ``fusion.ProjectionCSE`` (a pre pass), so a fused q|k|v product is routed once.

Then, in graphs whose product has exactly one row (the concrete int 1: Dynamo specializes size-1 dims, so the
batch-1 decode graph is traced apart from the graph every other batch size, prefill and mixed step runs),
``fuse_decode_ops`` folds the small ops around a routed product into it (issue #4), as the op
``paged_transformers.linear_fused`` (``kernels.gemv.gemv_fused`` at one CUDA row)::

    h = a + b ; RMSNorm(h) -> linear          linear_fused(a, W, x2=b, norm_weight, eps)     prologue
    linear(2I) -> slice | slice -> silu * up  linear_fused(..., gated=True)                  gated epilogue
    linear -> + r   (r = a + b)               linear_fused(..., residual=a, residual2=b)     residual epilogue

The piecewise-compiled Llama layer is 4 Dynamo graphs per shape: [input RMSNorm], [q|k|v, RoPE] (a new frame:
``self_attn.forward``), [o_proj] (resumed after the attention break), [residual add, post-attention RMSNorm,
gate|up, SiLU * up, down, residual add] (the layer frame, resumed). Only the last has a norm or an add next to a
product, so at batch 1 its 5 kernels become 2 (gate|up with the add and norm prologue and the gated epilogue; down
with the residual ``a + b`` recomputed in its epilogue): 13 -> 10 kernels per layer. The input norm and the o
projection's residual add are in other graphs than their products and stay Inductor kernels. A node chain that is
not exactly the expected one (other users of an intermediate, a broadcast, a different dtype) is left alone.
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

from .kernels.gemv import fused_epilogue_ref, fused_prologue_ref, gemv, gemv_fused

GEMV_ENABLED = True
"""Whether ``paged_transformers.linear`` takes the GEMV for one row (benchmarks turn it off to time cuBLAS in
the same engine; read when the op runs, i.e. when a decode graph is captured)."""

FUSE_ENABLED = True
"""Whether the pass folds norms, residual adds and SiLU * up into the batch-1 products (``fuse_decode_ops``); read
when a layer is compiled (benchmarks turn it off to A/B the fusion; part of the pass's ``uuid``)."""

FUSE_NORM = False
"""With ``FUSE_ENABLED``: whether the add + RMSNorm prologue is folded too (else only the gated and residual
epilogues); read when a layer is compiled (benchmarks A/B it; part of the pass's ``uuid``). Off: on the H200 the
prologue made the batch-1 GEMVs 460 us per step slower (every program re-reads and re-normalizes the whole row)
for 157 us of kernels saved (``profile_decode.py --decode-fusion``, BENCHMARKS.md)."""

_HALF = (torch.float16, torch.bfloat16)


@torch.library.custom_op("paged_transformers::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: the Triton GEMV (``kernels.gemv.gemv``) when ``x`` is one fp16/bf16 CUDA row
    with unit stride along K, ``bias`` is None or contiguous ``[N]`` (and ``GEMV_ENABLED``), else
    ``torch.nn.functional.linear`` (which also takes a broadcasting bias).

    Args:
        x: ``[M, K]``. weight: ``[N, K]``. bias: optional ``[N]``.

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Raises:
        RuntimeError / ValueError: as ``torch.nn.functional.linear`` for mismatched shapes or dtypes.
    """
    if (GEMV_ENABLED and x.is_cuda and x.shape[0] == 1 and x.dtype in _HALF and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1
            and (bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous()))):  # fmt: skip
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@linear.register_fake
def _linear_fake(x, weight, bias=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("paged_transformers::linear_fused", mutates_args=())
def linear_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x2: torch.Tensor | None,
                 norm_weight: torch.Tensor | None, eps: torch.Tensor | None, residual: torch.Tensor | None,
                 residual2: torch.Tensor | None, gated: bool) -> torch.Tensor:
    """``paged_transformers.linear`` with the prologue / epilogue of ``kernels.gemv.gemv_fused``: the fused GEMV
    when ``x`` is one fp16/bf16 CUDA row and every operand is contiguous in x's dtype (and ``GEMV_ENABLED``),
    else the same ops in PyTorch (``fused_prologue_ref``, ``F.linear``, ``fused_epilogue_ref``), rounding at the
    same points.

    Args:
        x, x2: ``[M, K]``; the product's input is ``x + x2`` (x2 optional). weight: ``[N, K]`` (gated: ``[2I, K]``,
            gate rows then up rows). bias: optional ``[N]``. norm_weight: optional ``[K]``: RMSNorm of the input
            with ``eps``, a 0-d CPU tensor (Dynamo passes the layer's float epsilon as one). residual, residual2:
            optional ``[M, N_out]`` added to the output (``N_out`` = N, or I when gated). gated: write
            ``silu(gate) * up``.

    Returns:
        ``[M, N_out]`` in ``x.dtype``.
    """
    eps_value = float(eps) if eps is not None else 0.0
    operands = (x2, norm_weight, residual, residual2)
    if (GEMV_ENABLED and x.is_cuda and x.shape[0] == 1 and x.dtype in _HALF and weight.dtype == x.dtype
            and x.is_contiguous() and weight.stride(1) == 1
            and all(t is None or (t.dtype == x.dtype and t.is_contiguous()) for t in operands)
            and (bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous()))):  # fmt: skip
        return gemv_fused(x, weight, bias, x2=x2, norm_weight=norm_weight, eps=eps_value, residual=residual,
                          residual2=residual2, gated=gated)
    y = F.linear(fused_prologue_ref(x, x2, norm_weight, eps_value), weight, bias)
    return fused_epilogue_ref(y, residual, residual2, gated)


@linear_fused.register_fake
def _linear_fused_fake(x, weight, bias, x2, norm_weight, eps, residual, residual2, gated):
    return x.new_empty((x.shape[0], weight.shape[0] // (2 if gated else 1)))


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
    """Inductor post-grad pass running ``route_linears`` and then, if ``FUSE_ENABLED``, ``fuse_decode_ops`` on
    the products of weights on ``device_type`` (``"cuda"``; tests pass ``"cpu"``). Its ``uuid`` keys Inductor's
    FX graph cache on the sources of this file, the pattern matcher and the GEMV kernel, ``device_type`` and
    ``FUSE_ENABLED``."""

    def __init__(self, device_type: str = "cuda"):
        self.device_type = device_type

    def __call__(self, graph: torch.fx.Graph) -> None:
        route_linears(graph, self.device_type)
        if FUSE_ENABLED:
            fuse_decode_ops(graph)

    def uuid(self) -> bytes:
        from .kernels import gemv as gemv_module

        # the kernel module by path: importing it would fix Triton's interpret-or-compile choice (kernels._launch)
        kernel_path = os.path.join(os.path.dirname(gemv_module.__file__), "gemv_kernels.py")
        digest = hashlib.sha256(f"{self.device_type} fuse={FUSE_ENABLED} norm={FUSE_NORM}".encode())
        for path in (__file__, gemv_module.__file__, kernel_path):
            with open(path, "rb") as f:
                digest.update(f.read())
        return digest.digest()


# -- batch-1 fusion: matching the post-grad node chains -------------------------------------------------------

_aten, _prims = torch.ops.aten, torch.ops.prims


def _is(node, target, nargs: int | None = None) -> bool:
    """``node`` is a call of ``target`` without kwargs (and with ``nargs`` positional args if given)."""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target
            and not node.kwargs and (nargs is None or len(node.args) == nargs))  # fmt: skip


def _is_view(node) -> bool:
    """``node`` is ``reshape(t, shape)`` or ``view(t, shape)`` (post-grad graphs have the first, ``make_fx`` the
    second)."""
    return _is(node, _aten.reshape.default, 2) or _is(node, _aten.view.default, 2)


def _val(node):
    """The FakeTensor of ``node`` (``meta["val"]``), or None."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _only_users(node, *users) -> bool:
    """``node``'s users are exactly ``users``."""
    return set(node.users) == set(users)


def _other(node, first):
    """The argument of the binary ``node`` that is not ``first`` (None if ``first`` is not one of them)."""
    a, b = node.args
    return b if a is first else a if b is first else None


def _cast(node, dtype) -> bool:
    return _is(node, _prims.convert_element_type.default, 2) and node.args[1] == dtype


def _match_rms_norm(x):
    """Match ``x = reshape(norm_weight * half(f32(h) * rsqrt(mean(f32(h)**2, [-1], True) + f32(eps))), [1, K])``
    (transformers' ``LlamaRMSNorm`` after Inductor's decompositions), each intermediate used by the chain only.

    Returns: ``(h, norm_weight, eps, chain nodes)`` or None."""
    if not (_is_view(x) and _only_users(x.args[0], x) and _is(x.args[0], _aten.mul.Tensor, 2)):
        return None
    mul_w = x.args[0]
    for nw, half in (mul_w.args, mul_w.args[::-1]):
        if _cast(half, _val(x).dtype) and _only_users(half, mul_w) and _is(half.args[0], _aten.mul.Tensor, 2):
            break
    else:
        return None
    mul_r = half.args[0]
    for up, rsqrt in (mul_r.args, mul_r.args[::-1]):
        if _cast(up, torch.float32) and _is(rsqrt, _aten.rsqrt.default, 1):
            break
    else:
        return None
    add_e = rsqrt.args[0]
    if not (_is(add_e, _aten.add.Tensor, 2) and _is(add_e.args[0], _aten.mean.dim, 3)):
        return None
    mean, eps_f = add_e.args
    pow_ = mean.args[0]
    if not (list(mean.args[1]) == [-1] and mean.args[2] is True and _is(pow_, _aten.pow.Tensor_Scalar, 2)
            and pow_.args == (up, 2)):  # fmt: skip
        return None
    # eps: a 0-d tensor input (Dynamo's float), cast to fp32 in post-grad graphs, added as is in make_fx's
    eps = eps_f.args[0] if _cast(eps_f, torch.float32) else eps_f
    h, nw_val, eps_val, h_val = up.args[0], _val(nw), _val(eps), _val(up.args[0])
    chain = [x, mul_w, half, mul_r, rsqrt, add_e, mean, pow_, up] + ([eps_f] if eps_f is not eps else [])
    if not (eps_val is not None and eps_val.dim() == 0 and eps_val.device.type == "cpu"
            and h_val is not None and h_val.dtype == _val(x).dtype and h_val.shape[-1] == h_val.numel()
            and nw_val is not None and nw_val.shape == h_val.shape[-1:] and nw_val.dtype == h_val.dtype
            and _only_users(up, pow_, mul_r) and _only_users(pow_, mean) and _only_users(mean, add_e)
            and _only_users(add_e, rsqrt) and _only_users(rsqrt, mul_r) and _only_users(mul_r, half)
            and (eps_f is eps or _only_users(eps_f, add_e))):  # fmt: skip
        return None
    return h, nw, eps, chain


def _match_add(h):
    """``h = a + b`` of two tensors of h's shape and dtype (the residual stream's add): ``(a, b)`` or None."""
    if not _is(h, _aten.add.Tensor, 2):
        return None
    vals = [_val(t) for t in h.args]
    if all(v is not None and v.shape == _val(h).shape and v.dtype == _val(h).dtype for v in vals):
        return h.args
    return None


def _match_silu_mul(y, n_out: int):
    """Match ``reshape(y) -> slice [0, I) -> half(silu) * slice [I, 2I)`` on the gated product ``y [1, 2I]``, SiLU
    decomposed as ``f32(g) / (1 + exp(-f32(g)))`` and rounded (Inductor's decomposition of ``ACT2FN["silu"]``).

    Returns: ``(the mul node, chain nodes)`` or None."""
    view = next(iter(y.users)) if len(y.users) == 1 else None
    if not (_is_view(view) and len(view.users) == 2):
        return None
    rank, slices = _val(view).dim(), {}
    for s in view.users:
        if not (_is(s, _aten.slice.Tensor, 4) and s.args[1] in (-1, rank - 1) and len(s.users) == 1):
            return None
        slices[s.args[2]] = s
    gate, up = slices.get(0), slices.get(n_out)
    if gate is None or up is None or gate.args[3] != n_out or _val(up).shape[-1] != n_out:
        return None
    g32 = next(iter(gate.users))
    if not (_cast(g32, torch.float32) and len(g32.users) == 2):
        return None
    div = next((u for u in g32.users if _is(u, _aten.div.Tensor, 2)), None)
    neg = next((u for u in g32.users if _is(u, _aten.neg.default, 1)), None)
    if div is None or neg is None or div.args[0] is not g32 or not _is(div.args[1], _aten.add.Tensor, 2):
        return None
    add1, exp = div.args[1], next(iter(neg.users))
    if not (_is(exp, _aten.exp.default, 1) and add1.args == (exp, 1) and _only_users(neg, exp)
            and _only_users(exp, add1) and _only_users(add1, div) and len(div.users) == 1):  # fmt: skip
        return None
    act = next(iter(div.users))
    mul = next(iter(up.users))
    if not (_cast(act, _val(y).dtype) and _only_users(act, mul) and _is(mul, _aten.mul.Tensor, 2)
            and set(mul.args) == {act, up}):  # fmt: skip
        return None
    return mul, [mul, act, div, add1, exp, neg, g32, gate, up, view]


def _match_residual(out):
    """``out``'s one user is ``out + r`` (or ``r + out``) with ``r`` of out's shape and dtype: ``(add, r)`` or
    None."""
    add = next(iter(out.users)) if len(out.users) == 1 else None
    if not _is(add, _aten.add.Tensor, 2):
        return None
    r = _other(add, out)
    rv, ov = _val(r), _val(out)
    if r is None or r is out or rv is None or rv.shape != ov.shape or rv.dtype != ov.dtype:
        return None
    return add, r


def _call(graph: torch.fx.Graph, target, args: tuple) -> torch.fx.Node:
    """Insert ``target(*args)`` (before the current insertion point) with its FakeTensor in ``meta["val"]``."""
    from torch._guards import detect_fake_mode

    node = graph.call_function(target, args)
    fake_args = [_val(a) if isinstance(a, torch.fx.Node) else a for a in args]
    with detect_fake_mode([a for a in fake_args if isinstance(a, torch.Tensor)]):
        node.meta["val"] = target(*fake_args)
    return node


def _erase_dead(graph: torch.fx.Graph, nodes) -> None:
    """Erase the nodes of ``nodes`` left without users (repeatedly: a chain dies from its end)."""
    alive = [n for n in dict.fromkeys(nodes) if n.op == "call_function" and n.graph is graph]
    changed = True
    while changed:
        changed = False
        for n in list(alive):
            if not n.users:
                graph.erase_node(n)
                alive.remove(n)
                changed = True


def fuse_decode_ops(graph: torch.fx.Graph) -> int:
    """Fold, in place, the ops around each one-row ``paged_transformers.linear`` into a
    ``paged_transformers.linear_fused`` (module docstring): an RMSNorm of its input (and the add ``h = a + b``
    before it), SiLU(gate) * up of its output (a ``[1, 2I]`` fused gate|up product), and a residual add after it.
    Only products whose row count is the concrete int 1 are changed; a chain that is not exactly the expected
    one is left alone (it still runs, unfused).

    Returns:
        The number of products that took a prologue or an epilogue.
    """
    fused = 0
    for node in list(graph.nodes):
        if not _is(node, torch.ops.paged_transformers.linear.default, 3):
            continue
        x, weight, bias = node.args
        rows = _val(x).shape[0] if _val(x) is not None else None
        if not (type(rows) is int and rows == 1 and _val(x).dim() == 2):  # a SymInt: the graph of every other size
            continue
        K, N = _val(x).shape[1], _val(weight).shape[0]
        x2 = norm_weight = eps = residual = residual2 = None
        gated, dead, last = False, [node], node
        norm = _match_rms_norm(x) if FUSE_NORM else None
        if norm is not None:
            h, norm_weight, eps, chain = norm
            dead += [*chain, h]
            x, x2 = _match_add(h) or (h, None)
        silu = _match_silu_mul(node, N // 2) if N % 2 == 0 else None
        if silu is not None:
            gated, (last, chain) = True, silu
            dead += chain
        elif len(node.users) == 1 and _is_view(next(iter(node.users))):
            last = next(iter(node.users))  # the product's [1, N] -> [1, 1, N] view
            dead.append(last)
        res = _match_residual(last)
        if res is not None:
            last, r = res
            dead.append(last)
            ab = _match_add(r)
            residual, residual2 = ab if ab is not None and _only_users(r, last) else (r, None)
        if norm is None and not gated and res is None:
            continue
        n_out = N // 2 if gated else N
        with graph.inserting_before(last):
            flat = [_call(graph, _aten.reshape.default, (t, [1, size])) if t is not None else None
                    for t, size in ((x, K), (x2, K), (residual, n_out), (residual2, n_out))]
            new = _call(graph, torch.ops.paged_transformers.linear_fused.default,
                        (flat[0], weight, bias, flat[1], norm_weight, eps, flat[2], flat[3], gated))
            out = _call(graph, _aten.reshape.default, (new, list(_val(last).shape)))
        last.replace_all_uses_with(out)
        _erase_dead(graph, dead + ([r] if res is not None else []))
        fused += 1
    return fused
