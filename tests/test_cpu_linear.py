"""``cpu_linear``: fp32 CPU projections of engine forwards through oneDNN, against ``torch.nn.functional.linear``
(the stock product); the routing exists only inside engine forwards. Greedy equality with stock ``generate()``
on the engine path is in ``test_engine_equivalence.py`` (every tiny model there runs through it on x86-64)."""

import pytest
import torch
import torch.nn.functional as F

from paged_transformers import EngineConfig, LLMEngine, SamplingParams
from paged_transformers import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="oneDNN linear needs x86-64 torch with mkldnn")


@pytest.mark.parametrize("rows, out_features", [(1, 64), (3, 64), (4, 64), (37, 200), (2, 1 << 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_functional_linear(rows, out_features, bias):
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(64, out_features, bias=bias)
    x = torch.randn(2, rows, 64, generator=g)
    got = cpu_linear._forward(linear, x)
    want = F.linear(x, linear.weight, linear.bias)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_other_dtypes_take_functional_linear():
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu_linear._forward(linear, x), F.linear(x, linear.weight, linear.bias))


def test_routes_exist_only_inside_engine_forwards(tiny_model):
    """During an engine forward every fp32 ``nn.Linear`` runs the routed forward; before, after and on an
    exception none is left, and a forward the user (or accelerate) installed is kept."""
    model = tiny_model("llama", seed=3)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    hooked = linears[0]
    linears[1].__dict__["forward"] = linears[1].forward  # an instance forward, as accelerate installs: kept
    seen = []
    handles = [m.register_forward_pre_hook(lambda m, args: seen.append("forward" in m.__dict__)) for m in linears[2:]]
    try:
        with LLMEngine(model, engine_config=EngineConfig(max_model_len=64)) as engine:
            routes = engine.runner.cpu_linears.routes
            assert len(routes) == len(linears) - 1 and linears[1] not in [m for m, _ in routes]
            engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3))
            while engine.has_unfinished_requests():
                engine.step()
            assert all("forward" not in m.__dict__ for m in linears if m is not linears[1])
            with pytest.raises(RuntimeError, match="boom"), engine.runner.cpu_linears.routed():
                assert "forward" in hooked.__dict__
                raise RuntimeError("boom")
            assert "forward" not in hooked.__dict__
    finally:
        for handle in handles:
            handle.remove()
        del linears[1].__dict__["forward"]
    assert seen and all(seen)
