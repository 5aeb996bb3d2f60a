"""Batch-1 fusion of RMSNorm, residual adds and SiLU * up into the GEMV (``decode_linear.fuse_decode_ops``).

References: the same layer compiled without the fusion (``FUSE_ENABLED = False``) and run eagerly; the graphs'
own node lists (the batch-1 graphs hold ``linear_fused`` and no norm / SiLU / add nodes, the n-row graphs are
unchanged). On CPU the fused op runs its PyTorch path (``F.linear`` between the same rounding steps); the kernel
itself is checked in ``test_gemv.py``.
"""

import pytest
import torch

from conftest import engine_greedy, make_tiny_model, random_prompts
from paged_transformers import EngineConfig, LLMEngine, decode_linear
from paged_transformers.compile import INDUCTOR_OPTIONS, decoder_layers
from paged_transformers.fusion import COMPILE_OPTIONS, fuse_projections, unfuse_projections

FUSED = torch.ops.paged_transformers.linear_fused.default
SMALL_OPS = {torch.ops.aten.rsqrt.default, torch.ops.aten.mean.dim, torch.ops.aten.exp.default,
             torch.ops.aten.add.Tensor}


class _Recorder(decode_linear.DecodeLinearPass):
    """The engine's pass on CPU weights, recording each graph's row count and call targets after it ran."""

    graphs: list = []

    def __init__(self):
        super().__init__("cpu")

    def __call__(self, graph):
        super().__call__(graph)
        rows = {_row_count(n.meta["val"].shape[0]) for n in graph.nodes if n.target is torch.ops.paged_transformers.linear.default
                or n.target is FUSED}
        _Recorder.graphs.append((rows, [n.target for n in graph.nodes if n.op == "call_function"]))


def _row_count(rows):
    return rows if type(rows) is int else "symbolic"


@pytest.fixture
def recorder(monkeypatch):
    _Recorder.graphs = []
    monkeypatch.setitem(INDUCTOR_OPTIONS, "post_grad_custom_post_pass", _Recorder())
    with torch._inductor.config.patch(fx_graph_cache=False):  # the pass must run
        yield _Recorder


def _layer_inputs(model, tokens: int):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(1, tokens, model.config.hidden_size, generator=g).bfloat16()
    pos = torch.arange(tokens)[None]
    return x, {"position_embeddings": model.model.rotary_emb(x, pos), "attention_mask": None, "position_ids": pos}


def _compiled_layer_outputs(layer, cases, fuse_enabled: bool, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setattr(decode_linear, "FUSE_ENABLED", fuse_enabled)
    torch._dynamo.reset()
    fn = torch.compile(layer.forward, dynamic=True, options={**INDUCTOR_OPTIONS, **COMPILE_OPTIONS})
    with torch.no_grad():
        outs = [fn(x, **kw) for x, kw in cases]
    torch._dynamo.reset()
    return [o[0] if isinstance(o, tuple) else o for o in outs]


def test_one_graph_layer_folds_all_four_products(recorder, monkeypatch):
    """A whole bf16 Llama layer in one graph (stock SDPA attention, no break): at one token all four products of
    the fused layer take their prologue / epilogue (q|k|v: input norm; o: residual; gate|up: post norm and SiLU *
    up; down: residual) and no norm, SiLU or add node is left; at 2 tokens (the dynamic graph) nothing changes.
    Outputs equal the unfused compiled layer's within bf16 rounding, and the eager layer's."""
    monkeypatch.setattr(decode_linear, "FUSE_NORM", True)
    model = make_tiny_model("llama", 21).to(torch.bfloat16)  # not the cached fixture's: .to() is in place
    handle = fuse_projections(model)
    try:
        layer = decoder_layers(model)[0]
        cases = [_layer_inputs(model, 1), _layer_inputs(model, 2)]
        with torch.no_grad():
            eager = [layer(x, **kw) for x, kw in cases]
        eager = [o[0] if isinstance(o, tuple) else o for o in eager]
        fused = _compiled_layer_outputs(layer, cases, True, monkeypatch)
        graphs = list(recorder.graphs)
        plain = _compiled_layer_outputs(layer, cases, False, monkeypatch)
    finally:
        unfuse_projections(handle)
    one = [targets for rows, targets in graphs if rows == {1}]
    many = [targets for rows, targets in graphs if rows and rows != {1}]
    assert len(one) == 1 and len(many) == 1
    assert one[0].count(FUSED) == 4 and not (SMALL_OPS - {torch.ops.aten.add.Tensor}) & set(one[0])
    assert one[0].count(torch.ops.aten.add.Tensor) == 2  # the RoPE sums of q and k; no residual or eps add
    assert FUSED not in many[0] and many[0].count(torch.ops.paged_transformers.linear.default) == 4
    assert many[0] == [t for rows, t in recorder.graphs if rows and rows != {1}][0]  # same nodes with fusion off
    for f, p, e in zip(fused, plain, eager):
        tol = 2**-7 * e.float().abs().max().item()  # a few bf16 roundings apart
        torch.testing.assert_close(f.float(), p.float(), rtol=2**-7, atol=tol)
        torch.testing.assert_close(f.float(), e.float(), rtol=2**-7, atol=tol)
    assert torch.equal(fused[1], plain[1])  # the 2-token graph is the same code


@pytest.mark.parametrize("fuse_norm", [True, False])
def test_engine_batch1_graph_is_fused_and_tokens_unchanged(recorder, monkeypatch, fuse_norm):
    """Through the engine (piecewise graphs, paged attention): the batch-1 MLP graph runs 2 fused products and no
    norm / SiLU / add node (with ``FUSE_NORM`` off: the norm's nodes stay, SiLU's go); the n-row graphs hold none;
    greedy tokens equal those with the fusion off."""
    monkeypatch.setattr(decode_linear, "FUSE_NORM", fuse_norm)
    model = make_tiny_model("llama", 3).to(torch.bfloat16)
    prompts, max_tokens = random_prompts(3, 1, 20, seed=5), [6, 3, 8]
    tokens = []
    for fuse in (True, False):
        monkeypatch.setattr(decode_linear, "FUSE_ENABLED", fuse)
        recorder.graphs = []
        torch._dynamo.reset()
        config = EngineConfig(compile_layers=True, attention_backend="torch", max_model_len=64, max_num_seqs=3)
        with LLMEngine(model, engine_config=config) as engine:
            assert engine.runner.compile_error is None
            tokens.append(engine_greedy(engine, prompts, max_tokens))
        if fuse:
            fused_graphs = [t for rows, t in recorder.graphs if FUSED in t]
            assert len(fused_graphs) == 1 and fused_graphs[0].count(FUSED) == 2
            ops = set(fused_graphs[0])
            if fuse_norm:
                assert not SMALL_OPS & ops
            else:
                assert torch.ops.aten.rsqrt.default in ops and torch.ops.aten.exp.default not in ops
            assert all(rows == {1} for rows, t in recorder.graphs if FUSED in t)
            graphs_on = [t for rows, t in recorder.graphs if rows and rows != {1}]
    torch._dynamo.reset()
    assert graphs_on == [t for rows, t in recorder.graphs if rows and rows != {1}]  # other graphs: unchanged
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("escapes", [False, True])
def test_norm_with_a_second_user_stays_unfused(escapes, monkeypatch):
    """A normalized activation used by something besides the product keeps its norm (the pattern is left alone);
    the residual epilogue still folds. Without the second user (the control) the norm folds too (``FUSE_NORM``)."""
    monkeypatch.setattr(decode_linear, "FUSE_NORM", True)
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(h, nw, eps, w, r):
        h32 = h.float()
        xn = nw * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
        y = torch.nn.functional.linear(xn.reshape(1, -1), w).reshape(1, 1, -1)
        return (y + r, xn) if escapes else (y + r,)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(1, 1, 16, generator=g).bfloat16(), torch.randn(16, generator=g).bfloat16(),
            torch.tensor(1e-6, dtype=torch.float64), torch.randn(8, 16, generator=g).bfloat16(),
            torch.randn(1, 1, 8, generator=g).bfloat16()]
    gm = make_fx(f, tracing_mode="fake")(*args)  # one fake mode for every node's meta["val"]
    for node in gm.graph.nodes:  # the dtype casts as Inductor's decompositions write them
        if node.target is torch.ops.aten._to_copy.default and list(node.kwargs) == ["dtype"]:
            node.target, node.args, node.kwargs = torch.ops.prims.convert_element_type.default, (node.args[0], node.kwargs["dtype"]), {}
    assert decode_linear.route_linears(gm.graph, device_type="cpu") == 1
    assert decode_linear.fuse_decode_ops(gm.graph) == 1
    fused = [n for n in gm.graph.nodes if n.target is FUSED]
    assert len(fused) == 1 and fused[0].args[6] is not None  # the residual epilogue
    assert (fused[0].args[4] is None) == escapes  # the norm weight: folded only without the second user
    assert (torch.ops.aten.rsqrt.default in [n.target for n in gm.graph.nodes]) == escapes
    gm.graph.lint()
    gm.recompile()
    for got, ref in zip(gm(*args), f(*args)):
        torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=2**-7 * ref.float().abs().max().item())


def test_op_reference_path_equals_the_unfused_ops():
    """On CPU (and for more than one row) ``linear_fused`` is the PyTorch ops it replaces, exactly."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(3, 16, generator=g).bfloat16() for _ in range(2))
    nw, w = torch.randn(16, generator=g).bfloat16(), torch.randn(12, 16, generator=g).bfloat16()
    r = torch.randn(3, 6, generator=g).bfloat16()
    h = a + b
    h32 = h.float()
    xn = nw * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype)
    y = torch.nn.functional.linear(xn, w)
    ref = torch.nn.functional.silu(y[:, :6]) * y[:, 6:] + r
    got = torch.ops.paged_transformers.linear_fused(a, w, None, b, nw, torch.tensor(1e-5, dtype=torch.float64), r,
                                                    None, True)
    assert torch.equal(got, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused GEMV and CUDA graphs need CUDA")
def test_cuda_graph_batch1_decode_fused_equals_unfused(monkeypatch):
    """bf16 on the GPU, engine defaults (compiled layers, fused projections, CUDA graphs, Triton attention): one
    request at a time, so decode replays the batch-1 graph, whose MLP graph runs the fused GEMVs; greedy tokens
    equal those with the fusion off."""
    model = make_tiny_model("llama", 8, hidden_size=256, intermediate_size=512).to("cuda", torch.bfloat16)
    prompts = random_prompts(3, 4, 30, seed=7)
    tokens = []
    for fuse in (True, False):
        monkeypatch.setattr(decode_linear, "FUSE_ENABLED", fuse)
        torch._dynamo.reset()
        config = EngineConfig(max_model_len=256, max_num_seqs=4)
        with LLMEngine(model, engine_config=config) as engine:
            assert engine.runner.compile_error is None and engine.runner.graph_capture_error is None
            assert 1 in engine.runner.graphs
            tokens.append([engine_greedy(engine, [p], [12])[0] for p in prompts])
    torch._dynamo.reset()
    assert tokens[0] == tokens[1]
