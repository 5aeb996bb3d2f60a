"""The batch-1 GEMV (``kernels.gemv``) and its routing into compiled layers (``paged_transformers.compilation.gemv_routing``).

References: ``gemv_ref`` (fp32 product, one rounding) for the kernel, which runs in Triton's interpreter without
CUDA (tiny shapes); the original FX graph's own output and ``torch.nn.functional.linear`` for the routing pass.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from paged_transformers.compilation import gemv_routing  # noqa: E402
from paged_transformers.kernels.gemv import DEFAULT_GEMV_CONFIG, WIDE_GEMV_CONFIG, GemvConfig, gemv, gemv_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32 = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16  # fp32 runs only under the interpreter


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to the order of the fp32 sum: one rounding step of the output dtype (bf16: 2**-8 relative)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


@pytest.mark.parametrize(
    "N, K, dtype, config, bias",
    [
        (37, 100, FP32, GemvConfig(8, 32), True),  # N and K off the tile grid, K steps masked
        (16, 128, torch.float16, GemvConfig(4, 64, 2), False),
        (40, 96, torch.bfloat16, GemvConfig(8, 64), True),
        (5, 64, torch.bfloat16, None, False),  # the default config: one program, rows clamped to N - 1
        (6, 1500, torch.bfloat16, WIDE_GEMV_CONFIG, True),  # the wide-N default: 4 rows, K = 1500 in 1024-steps
    ],
)
def test_matches_reference(N, K, dtype, config, bias):
    g = torch.Generator().manual_seed(N * K)
    x = torch.randn(1, K, generator=g).to(dtype).to(DEVICE)
    # a weight with row stride > K: the K columns of a wider tensor
    weight = torch.randn(N, K + 24, generator=g).to(dtype).to(DEVICE)[:, :K]
    b = torch.randn(N, generator=g).to(DEVICE) if bias else None  # fp32 bias with half x: added in fp32
    _close(gemv(x, weight, b, config), gemv_ref(x, weight, b))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="N >= 16384 (the wide default) is too slow for the interpreter")
def test_wide_default_matches_reference_cuda():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 512, generator=g).to(DEVICE, torch.bfloat16)
    weight = torch.randn(16384 + 3, 512, generator=g).to(DEVICE, torch.bfloat16)
    _close(gemv(x, weight), gemv_ref(x, weight))


def test_every_row_and_column_counts():
    """A one-hot x picks one weight column, exactly: a wrong row offset or a skipped K step shows up as a
    wrong value in that column."""
    N, K = 19, 70
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(1)).to(DEVICE, FP32)
    for k in (0, 31, 32, 69):
        x = torch.zeros(1, K, device=DEVICE, dtype=FP32)
        x[0, k] = 1.0
        assert torch.equal(gemv(x, weight, config=GemvConfig(8, 32)), weight[:, k][None])


@pytest.mark.parametrize(
    "x_shape, w_shape, match",
    [((2, 8), (4, 8), "x must be"), ((1, 8), (4, 6), "weight must be"), ((8,), (4, 8), "x must be")],
)
def test_bad_shapes(x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        gemv(torch.randn(*x_shape, device=DEVICE), torch.randn(*w_shape, device=DEVICE))


def test_bad_dtype_bias_and_config():
    x, w = torch.randn(1, 8, device=DEVICE, dtype=torch.bfloat16), torch.randn(4, 8, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share one dtype"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match=r"bias must be a contiguous float \[4\]"):
        gemv(x, w, torch.randn(5, device=DEVICE))
    with pytest.raises(ValueError, match="share one dtype"):
        gemv(x.to(torch.int32), w.to(torch.int32))
    with pytest.raises(ValueError, match="bias is on meta"):
        gemv(x, w, torch.randn(4, device="meta"))
    with pytest.raises(ValueError, match="config must be a GemvConfig, got dict"):
        gemv(x, w, config={"block_n": 8})
    for bad in (True, 64):
        with pytest.raises(ValueError, match="num_warps"):
            GemvConfig(8, 64, bad)
    with pytest.raises(ValueError, match="block_k must be a positive power of two, got 48"):
        GemvConfig(8, 48)
    assert str(DEFAULT_GEMV_CONFIG).startswith("gemv ")


# -- routing into compiled layers ---------------------------------------------------------------------


def _traced(dtype):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w1, w2, b2):
        return torch.nn.functional.linear(x, w1) + torch.nn.functional.linear(x, w2, b2)

    args = [torch.randn(3, 8), torch.randn(6, 8), torch.randn(6, 8), torch.randn(6)]
    args = [a.to(dtype) for a in args]
    return make_fx(f)(*args), f, args


def test_route_linears_replaces_mm_and_addmm():
    gm, f, args = _traced(torch.bfloat16)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.mm.default in targets and torch.ops.aten.addmm.default in targets
    assert gemv_routing.route_linears(gm.graph, device_type="cpu") == 2
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.paged_transformers.linear.default) == 2
    assert not {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.t.default} & set(targets)
    torch.testing.assert_close(gm(*args), f(*args))  # on CPU the op is F.linear: the same products


def test_route_linears_leaves_other_products():
    gm, _, _ = _traced(torch.float32)  # fp32 weights: cuBLAS / CPU as before
    assert gemv_routing.route_linears(gm.graph, device_type="cpu") == 0
    gm, _, _ = _traced(torch.bfloat16)
    assert gemv_routing.route_linears(gm.graph) == 0  # CPU weights, routing CUDA ones only

    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, b1, w2):
        # a broadcast [1] bias, beta/alpha, a weight that is a column slice (stride along K != 1)
        return torch.addmm(b1, x, w.t()) + torch.addmm(b1, x, w.t(), beta=0.5) + x @ w2[:, ::2].t()

    args = [t.bfloat16() for t in (torch.randn(3, 8), torch.randn(6, 8), torch.randn(1), torch.randn(6, 16))]
    gm = make_fx(f)(*args)
    assert gemv_routing.route_linears(gm.graph, device_type="cpu") == 0


@pytest.mark.parametrize("bias_shape", [(1,), (4,)])
def test_op_takes_any_bias_linear_takes(bias_shape):
    """The op's fallback is ``F.linear``: a broadcast bias works as there (the GEMV takes only ``[N]``)."""
    x, w = torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    b = torch.randn(*bias_shape, dtype=torch.bfloat16)
    assert torch.equal(torch.ops.paged_transformers.linear(x, w, b), torch.nn.functional.linear(x, w, b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GEMV branch of the op needs CUDA")
@pytest.mark.parametrize("N, K", [(6144, 4096), (4096, 14336), (1000, 4104)])
def test_op_takes_the_gemv_for_one_row(N, K):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
    x1 = torch.randn(1, K, device="cuda", dtype=torch.bfloat16, generator=g)
    _close(torch.ops.paged_transformers.linear(x1, w, b), gemv_ref(x1, w, b))
    x4 = torch.randn(4, K, device="cuda", dtype=torch.bfloat16, generator=g)
    assert torch.equal(torch.ops.paged_transformers.linear(x4, w, b), torch.nn.functional.linear(x4, w, b))


class _RouteCPU(gemv_routing.DecodeLinearPass):
    """The pass with CPU weights routed (on CPU the op runs ``F.linear``, so the output must not change)."""

    def __call__(self, graph):
        _RouteCPU.replaced = gemv_routing.route_linears(graph, device_type="cpu")

    def uuid(self) -> bytes:
        return super().uuid() + b"cpu"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with bias (addmm)
@pytest.mark.slow
def test_compiled_layer_routes_every_projection(arch):
    """Inductor compiles a bf16 decoder layer whose products the pass routed (7 per layer: q, k, v, o, gate,
    up, down) and gives the unrouted layer's output."""
    from conftest import make_tiny_model

    from paged_transformers.compilation.layers import INDUCTOR_OPTIONS, decoder_layers

    model = make_tiny_model(arch, 3).to(torch.bfloat16)
    layer = decoder_layers(model)[0]
    x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    position_ids = torch.arange(5)[None]
    kwargs = {"position_embeddings": model.model.rotary_emb(x, position_ids), "attention_mask": None,
              "position_ids": position_ids}
    outs = []
    for post_pass in (None, _RouteCPU()):
        torch._dynamo.reset()
        options = {**INDUCTOR_OPTIONS, "post_grad_custom_post_pass": post_pass}
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):  # the pass must run
            outs.append(torch.compile(layer.forward, dynamic=True, options=options)(x, **kwargs))
    torch._dynamo.reset()
    assert _RouteCPU.replaced == 7
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="routes CUDA weights only")
def test_compiled_cuda_layer_runs_the_gemv_at_one_token():
    """A bf16 decoder layer compiled with the engine's options on the GPU: its code calls the routed op, and at
    1 and 16 tokens its output matches the eager layer's within bf16 rounding."""
    from conftest import make_tiny_model
    from torch._inductor.utils import run_and_get_code

    from paged_transformers.compilation.layers import INDUCTOR_OPTIONS, decoder_layers

    model = make_tiny_model("llama", 5, hidden_size=256, intermediate_size=512).to("cuda", torch.bfloat16)
    layer = decoder_layers(model)[0]
    torch._dynamo.reset()
    fn = torch.compile(layer.forward, dynamic=True, options=INDUCTOR_OPTIONS)
    for tokens in (1, 16):
        x = torch.randn(1, tokens, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        position_ids = torch.arange(tokens, device="cuda")[None]
        kwargs = {"position_embeddings": model.model.rotary_emb(x, position_ids), "attention_mask": None,
                  "position_ids": position_ids}
        with torch.no_grad():
            out, code = run_and_get_code(fn, x, **kwargs)
            ref = layer.forward(x, **kwargs)
        out, ref = (o[0] if isinstance(o, tuple) else o for o in (out, ref))
        assert "paged_transformers.linear" in "\n".join(code)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=2**-6 * ref.float().abs().max().item())
    torch._dynamo.reset()
