"""``cpu_linear``: fp32 CPU projections of engine forwards through oneDNN, against ``torch.nn.functional.linear``
(the stock product); the routing exists only inside engine forwards. Greedy equality with stock ``generate()``
on the engine path is in ``test_engine_equivalence.py`` (every tiny model there runs through it on x86-64); here
also the packed weights (``EngineConfig.cpu_prepack_weights``) against ``F.linear`` and stock ``generate()``, and
their policy."""

import pytest
import torch
import torch.nn.functional as F

import paged_transformers
from conftest import make_tiny_model, random_prompts
from paged_transformers import EngineConfig, LLMEngine, SamplingParams
from paged_transformers.core import cpu_linear
from paged_transformers.integration.warm import current_engine
from test_patch import left_pad

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


# -- packed weights (EngineConfig.cpu_prepack_weights) ------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("in_features, out_features, bias", [(64, 96, False), (576, 1536, True), (40, 7, True)])
def test_packed_products_match_functional_linear(rows, in_features, out_features, bias):
    """A packed weight computes ``F.linear``'s product within fp32 tolerance, and the packed route ran."""
    g = torch.Generator().manual_seed(rows * out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    torch.nn.init.normal_(linear.weight, generator=g)
    x = torch.randn(1, rows, in_features, generator=g)
    routes = cpu_linear.RoutedLinears(torch.nn.Sequential(linear), prepack=True)
    with torch.no_grad(), routes.routed():
        got = linear(x)
    want = F.linear(x, linear.weight, linear.bias)
    assert routes.num_packed_products == 1
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_a_weight_written_after_packing_takes_the_plain_route():
    """A pack whose weight was written in place since is never read, even without the engine dropping it."""
    linear = torch.nn.Linear(32, 16)
    routes = cpu_linear.RoutedLinears(torch.nn.Sequential(linear), prepack=True)
    with torch.no_grad():
        linear.weight.mul_(-3.0)
        x = torch.randn(4, 32)
        with routes.routed():
            got = linear(x)
    assert routes.num_packed_products == 0
    assert torch.allclose(got, F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


def _patched_calls(model, ids, mask, num_calls, **config) -> tuple[list[torch.Tensor], list[int]]:
    """``num_calls`` patched greedy ``generate()`` calls (8 new tokens) on the model's warm engine, which is released
    after; returns each call's sequences and how many products read packed weights in each call."""
    outputs, packed = [], []
    for _ in range(num_calls):
        engine = current_engine(model)
        before = engine.runner.cpu_linears.num_packed_products if engine is not None else 0
        outputs.append(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))
        packed.append(current_engine(model).runner.cpu_linears.num_packed_products - before)
    return outputs, packed


def test_stable_weights_are_packed_from_the_second_call_and_an_optimizer_step_drops_them():
    """Three patched calls on unchanged weights: tokens equal stock's; the first call reads no pack, the second packs
    (once) and computes with the packs, so does the third. After an optimizer step the next call's tokens are stock's
    on the updated model: its attach dropped the packs (memory freed) and no product read one."""
    model, reference = make_tiny_model("llama", seed=31), make_tiny_model("llama", seed=31)
    ids, mask = left_pad(random_prompts(3, 5, 20, seed=31))
    stock = reference.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    with paged_transformers.patch():
        outputs, packed = _patched_calls(model, ids, mask, 3)
        routes = current_engine(model).runner.cpu_linears
        assert all(torch.equal(out, stock) for out in outputs)
        assert packed[0] == 0 and packed[1] > 0 and packed[2] == packed[1] and routes.num_packs == 1
        for m in (model, reference):
            m.train()
            optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
            m(ids, labels=ids).loss.backward()
            optimizer.step()
            m.eval()
        after, packed_after = _patched_calls(model, ids, mask, 1)
        assert current_engine(model).runner.cpu_linears is routes  # the same engine: its packs were dropped
        assert routes.packed_routes is None and routes.packed_nbytes == 0 and packed_after == [0]
        paged_transformers.release(model)
    stock_after = reference.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert not torch.equal(stock_after, stock), "the step must change the greedy tokens for this test"
    assert torch.equal(after[0], stock_after)


def test_prepack_false_never_packs_and_true_packs_at_engine_start(tiny_model):
    """``cpu_prepack_weights=False``: three calls on unchanged weights, no pack; True: packed before any call."""
    model = tiny_model("llama", seed=32)
    with paged_transformers.patch(engine_config=EngineConfig(cpu_prepack_weights=False)):
        _, packed = _patched_calls(model, *left_pad(random_prompts(2, 5, 12, seed=32)), 3)
        routes = current_engine(model).runner.cpu_linears
        paged_transformers.release(model)
    assert routes.num_packs == 0 and routes.packed_routes is None and packed == [0, 0, 0]
    with LLMEngine(model, engine_config=EngineConfig(max_model_len=64, cpu_prepack_weights=True)) as engine:
        routes = engine.runner.cpu_linears
        assert routes.num_packs == 1 and routes.packed_nbytes == sum(
            m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert routes.packed_routes is None  # close drops them


def test_prepack_config_is_a_bool_or_none():
    with pytest.raises(ValueError, match="cpu_prepack_weights must be a bool or None, got 'yes'"):
        EngineConfig(cpu_prepack_weights="yes")
