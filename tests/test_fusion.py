"""Fused q|k|v and gate|up projections (``paged_transformers.compilation.fusion``, ``EngineConfig.fuse_projections``).

References: stock ``model.generate()`` (fp32, CPU, each prompt alone) for the engine's greedy tokens; the
unfused modules' own outputs and ``state_dict`` for the module swap; the generated code's count of
``extern_kernels.mm/addmm`` calls for the merge of the products. The compiled tests compile C++ kernels
with Inductor on CPU (seconds each), so they use one tiny model per architecture and few prompts.
"""

import re

import pytest
import torch
from conftest import engine_greedy, random_prompts, stock_greedy
from torch import nn

from paged_transformers import EngineConfig, LLMEngine
from paged_transformers.core.execution_plan import LayerPath
from paged_transformers.compilation.layers import INDUCTOR_OPTIONS, decoder_layers
from paged_transformers.compilation.fusion import (
    COMPILE_OPTIONS,
    FusedLinearSlice,
    cse_projection_nodes,
    fuse_projections,
    unfuse_projections,
)
from paged_transformers.quantization.linear import QuantLinear

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


def _snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_state_equal(model, snapshot: dict) -> None:
    sd = model.state_dict()
    assert list(sd) == list(snapshot)
    for k, v in snapshot.items():
        assert sd[k].shape == v.shape and torch.equal(sd[k], v), k


def _projections(model) -> list[nn.Module]:
    return [layer.get_submodule(p) for layer in decoder_layers(model) for p in PROJ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with bias (addmm)
@pytest.mark.slow
def test_fused_compiled_engine_matches_stock_and_close_restores(tiny_model, arch):
    model = tiny_model(arch, seed=11)
    prompts = random_prompts(3, 2, 30, seed=7)
    max_tokens = [8, 5, 10]
    refs = [stock_greedy(model, p, n)[0] for p, n in zip(prompts, max_tokens)]
    originals = _projections(model)
    before = _snapshot(model)

    torch._dynamo.reset()
    config = EngineConfig(compile_layers=True, attention_backend="torch", max_model_len=64, max_num_seqs=4)
    with LLMEngine(model, engine_config=config) as engine:
        runner = engine.runner
        assert engine.execution_plan.layers is LayerPath.COMPILED and engine.execution_plan.fuse_projections
        assert runner.compilation.fusion.num_fused == 2 * model.config.num_hidden_layers and not runner.compilation.fusion.skipped
        assert all(isinstance(m, FusedLinearSlice) for m in _projections(model))
        _assert_state_equal(model, before)  # while fused: same keys, shapes and values
        got = engine_greedy(engine, prompts, max_tokens)
    assert got == refs

    assert all(a is b for a, b in zip(_projections(model), originals))  # the very modules are back
    _assert_state_equal(model, before)
    for m in originals:  # each owns a contiguous weight again (no view of a fused tensor)
        assert m.weight.is_contiguous() and m.weight.untyped_storage().nbytes() == m.weight.numel() * m.weight.element_size()
    assert [stock_greedy(model, p, n)[0] for p, n in zip(prompts, max_tokens)] == refs


def _compiled_layer_mm_count(model) -> tuple[int, torch.Tensor]:
    from torch._inductor.utils import run_and_get_code

    layer = decoder_layers(model)[0]
    x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(5)[None]
    kwargs = {"position_embeddings": model.model.rotary_emb(x, position_ids), "attention_mask": None,
              "position_ids": position_ids}
    fused = any(isinstance(m, FusedLinearSlice) for m in layer.modules())
    torch._dynamo.reset()
    fn = torch.compile(layer.forward, dynamic=True, options={**INDUCTOR_OPTIONS, **(COMPILE_OPTIONS if fused else {})})
    with torch.no_grad():
        out, code = run_and_get_code(fn, x, **kwargs)
    torch._dynamo.reset()
    return len(re.findall(r"extern_kernels\.(?:mm|addmm|bmm)\(", "\n".join(code))), out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.slow
def test_compiled_layer_runs_one_product_per_group(tiny_model, arch):
    """7 GEMMs per layer (q, k, v, o, gate, up, down) become 4 (q|k|v, o, gate|up, down)."""
    model = tiny_model(arch, seed=12)
    n_plain, out_plain = _compiled_layer_mm_count(model)
    handle = fuse_projections(model)
    try:
        n_fused, out_fused = _compiled_layer_mm_count(model)
    finally:
        unfuse_projections(handle)
    assert (n_plain, n_fused) == (7, 4)
    torch.testing.assert_close(out_fused, out_plain, rtol=1e-5, atol=1e-5)


def test_cse_merges_only_identical_products():
    """The pass on a traced graph: identical products of one input and weight merge; a product of another
    weight does not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, w2):
        return (x @ w.t())[:, :4] + (x @ w.t())[:, 4:8] + (x @ w2.t())[:, :4]

    gm = make_fx(f)(torch.randn(3, 6), torch.randn(8, 6), torch.randn(8, 6))
    def mms():
        return sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes)

    assert mms() == 3
    assert cse_projection_nodes(gm.graph) >= 1
    gm.recompile()
    assert mms() == 2
    x, w, w2 = torch.randn(3, 6), torch.randn(8, 6), torch.randn(8, 6)
    torch.testing.assert_close(gm(x, w, w2), f(x, w, w2))


def test_unmatched_projections_are_left_alone(tiny_model):
    """A group with a bias mismatch, a mixed Linear/QuantLinear group, and Phi-3's already fused
    qkv_proj / gate_up_proj: nothing changes. A group is fused in every layer or in none (mixed layers
    would each need a Dynamo graph), and a matching group of the same model is fused everywhere."""
    model = tiny_model("llama", seed=13)
    layers = decoder_layers(model)
    attn, mlp = layers[0].self_attn, layers[0].mlp
    saved = (attn.k_proj, mlp.up_proj)
    attn.k_proj = nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features, bias=True)
    try:
        mods, before = _projections(model), _snapshot(model)
        handle = fuse_projections(model)  # q|k|v mismatched in layer 0 only: fused nowhere; gate|up everywhere
        assert handle.num_fused == len(layers), handle.skipped
        assert "0.self_attn" in handle.skipped[0] and "fused in no layer" in handle.skipped[1], handle.skipped
        assert all(not isinstance(layer.self_attn.q_proj, FusedLinearSlice) for layer in layers)
        assert all(isinstance(layer.mlp.up_proj, FusedLinearSlice) for layer in layers)
        unfuse_projections(handle)
        assert all(a is b for a, b in zip(_projections(model), mods))
        _assert_state_equal(model, before)

        mlp.up_proj = QuantLinear(mlp.up_proj.in_features, mlp.up_proj.out_features, bits=4, group_size=32,
                                  bias=False, dtype=torch.float32)
        for buf in mlp.up_proj.buffers():
            buf.zero_()  # created empty: defined values for the state_dict comparison
        mods, before = _projections(model), _snapshot(model)
        handle = fuse_projections(model)
        assert handle.num_fused == 0 and "0.mlp: module types differ" in handle.skipped[2], handle.skipped
        assert all(a is b for a, b in zip(_projections(model), mods))
        _assert_state_equal(model, before)
    finally:
        attn.k_proj, mlp.up_proj = saved

    phi3 = tiny_model("phi3", seed=13)
    before = _snapshot(phi3)
    handle = fuse_projections(phi3)
    assert handle.num_fused == 0 and len(handle.skipped) == 4
    _assert_state_equal(phi3, before)


@pytest.mark.parametrize("method,desc_act", [("awq", False), ("gptq", True)])
def test_quantized_projections(method, desc_act):
    """AWQ (no act-order): fused along N, every slice equals its original module's output, and unfusing
    restores the buffers. GPTQ act-order with per-layer random permutations: the groups are skipped."""
    import transformers

    from paged_transformers.quantization.random_model import (
        build_random_quantized_model,
    )

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = build_random_quantized_model(cfg, method, group_size=32, dtype=torch.float32, device="cpu", desc_act=desc_act)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    mods, before = _projections(model), _snapshot(model)
    refs = [m(x) for m in mods]
    handle = fuse_projections(model)
    if desc_act:
        assert handle.num_fused == 0 and all("permutations differ" in s for s in handle.skipped), handle.skipped
    else:
        assert handle.num_fused == 2
        _assert_state_equal(model, before)
        got = [m(x) for m in _projections(model)]
        for g, r in zip(got, refs):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    unfuse_projections(handle)
    assert all(a is b for a, b in zip(_projections(model), mods))
    _assert_state_equal(model, before)
    assert all(m.qweight.is_contiguous() for m in mods)
    for m, r in zip(mods, refs):
        torch.testing.assert_close(m(x), r)


def test_compile_failure_unfuses(tiny_model, monkeypatch):
    from paged_transformers.core.runner import ModelRunner

    model = tiny_model("llama", seed=14)
    mods, before = _projections(model), _snapshot(model)

    def broken(self, *args):
        raise RuntimeError("inductor says no")

    monkeypatch.setattr(ModelRunner, "_forward", broken)
    config = EngineConfig(compile_layers=True, attention_backend="torch", max_model_len=64, max_num_seqs=2)
    engine = LLMEngine(model, engine_config=config)
    try:
        plan = engine.execution_plan
        assert "inductor says no" in plan.compile_error
        assert plan.layers is not LayerPath.COMPILED and not plan.fuse_projections
        assert all(a is b for a, b in zip(_projections(model), mods))
        _assert_state_equal(model, before)
    finally:
        engine.close()


def test_fuse_projections_validated(tiny_model, monkeypatch):
    with pytest.raises(ValueError, match="fuse_projections must be a bool or None, got 'yes'"):
        EngineConfig(fuse_projections="yes")
    # uncompiled layers (compile_layers=None is off on CPU: no CUDA graphs) need the fused eager layers, which Phi-3
    # (its own qkv_proj) does not get: the engine refuses, naming why, and leaves the model as it was
    model = tiny_model("phi3", seed=15)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="fuse_projections=True with uncompiled layers needs the fused eager layers, "
                                         "which cannot run this model: layer 0 is a Phi3DecoderLayer"):
        LLMEngine(model, engine_config=EngineConfig(fuse_projections=True, attention_backend="torch", max_model_len=64))
    _assert_state_equal(model, before)
    assert all("forward" not in vars(layer) for layer in decoder_layers(model))
    assert model.config._attn_implementation != "paged_transformers"
    # their kernels need CUDA or the interpreter
    model = tiny_model("llama", seed=15)
    mods = _projections(model)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="need CUDA or the Triton interpreter"):
        LLMEngine(model, engine_config=EngineConfig(fuse_projections=True, compile_layers=False,
                                                    attention_backend="torch", max_model_len=64))
    assert all(a is b for a, b in zip(_projections(model), mods))
    assert model.config._attn_implementation != "paged_transformers"
