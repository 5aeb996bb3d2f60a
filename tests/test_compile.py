"""``EngineConfig(compile_layers=True)``: decoder layers compiled around the paged attention give stock
``model.generate()``'s greedy tokens, and closing the engine gives the model its eager layers back.

Reference: transformers' own ``generate()`` (fp32, CPU, each prompt alone). On CPU, Inductor compiles
C++ kernels (tens of seconds), so this runs one tiny model with a few prompts; on CUDA the same path is
the engine's default (with CUDA graphs) and runs through every GPU test.
"""

import pytest
import torch

from conftest import engine_greedy, random_prompts, stock_greedy
from paged_transformers import EngineConfig, LLMEngine
from paged_transformers.core.execution_plan import LayerPath
from paged_transformers.compilation.layers import decoder_layers, outer_modules


@pytest.mark.slow
def test_compiled_layers_match_stock_generate(tiny_model):
    model = tiny_model("llama", seed=3)
    prompts = random_prompts(4, 1, 40, seed=5)
    max_tokens = [9, 3, 12, 6]
    refs = [stock_greedy(model, p, n)[0] for p, n in zip(prompts, max_tokens)]
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    outer = outer_modules(model)
    assert outer == [model.model.norm, model.model.rotary_emb, model.lm_head]

    torch._dynamo.reset()
    config = EngineConfig(compile_layers=True, attention_backend="torch", max_model_len=128, max_num_seqs=4)
    with LLMEngine(model, engine_config=config) as engine:
        assert engine.execution_plan.layers is LayerPath.COMPILED
        assert [module for module, _ in engine.runner.compilation.modules] == layers + outer
        assert all("forward" in vars(module) for module in layers + outer)
        got = engine_greedy(engine, prompts, max_tokens)
    assert got == refs
    # the layers ran through Dynamo (not silently eager), and are eager again after close
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2
    assert not any("forward" in vars(module) for module in layers + outer)
    assert model.config._attn_implementation != "paged_transformers"


@pytest.mark.slow
def test_close_restores_a_forward_set_on_the_instance(tiny_model):
    """A ``forward`` already on a layer instance (accelerate's hooks do this) is compiled and put back on close."""
    model = tiny_model("llama", seed=4)
    layer = decoder_layers(model)[0]
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return type(layer).forward(layer, *args, **kwargs)

    layer.forward = wrapper
    try:
        torch._dynamo.reset()
        config = EngineConfig(compile_layers=True, attention_backend="torch", max_model_len=64, max_num_seqs=2)
        with LLMEngine(model, engine_config=config) as engine:
            assert engine.execution_plan.layers is LayerPath.COMPILED
            engine_greedy(engine, [[5, 6, 7]], [2])
        assert vars(layer)["forward"] is wrapper and calls  # the wrapper ran (inside the compiled layer) and is back
        assert "forward" not in vars(decoder_layers(model)[1])
    finally:
        del layer.forward


def test_interrupt_while_compiling_leaves_the_layers_eager(tiny_model, monkeypatch):
    from paged_transformers.core.runner import ModelRunner

    model = tiny_model("llama", seed=4)

    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(ModelRunner, "_forward", interrupted)
    config = EngineConfig(compile_layers=True, attention_backend="torch", max_model_len=64, max_num_seqs=2)
    with pytest.raises(KeyboardInterrupt):
        LLMEngine(model, engine_config=config)
    assert not any("forward" in vars(layer) for layer in decoder_layers(model))
    assert model.config._attn_implementation != "paged_transformers"


def test_compile_layers_validated():
    with pytest.raises(ValueError, match="compile_layers must be a bool or None, got 'yes'"):
        EngineConfig(compile_layers="yes")


@pytest.mark.slow
def test_several_model_classes_stay_compiled(tiny_model):
    """transformers' wrappers are one code object for every model class; with Dynamo's default recompile limit (8),
    the layers of the third model class compiled in one process ran eagerly, silently (``compile_error`` None).
    A hook on the first layer's MLP counts its calls outside Dynamo during generation."""
    torch._dynamo.reset()
    config = EngineConfig(compile_layers=True, attention_backend="torch", max_model_len=64, max_num_seqs=2)
    for arch in ("llama", "qwen2", "mistral", "phi3"):
        model = tiny_model(arch, seed=0)
        eager_calls = []
        hook = decoder_layers(model)[0].mlp.register_forward_pre_hook(
            lambda module, args: None if torch.compiler.is_compiling() else eager_calls.append(1))
        try:
            with LLMEngine(model, engine_config=config) as engine:
                assert engine.execution_plan.layers is LayerPath.COMPILED
                warm_up = len(eager_calls)
                engine_greedy(engine, [[5, 6, 7]], [3])
        finally:
            hook.remove()
        assert len(eager_calls) == warm_up, f"{arch}: the compiled layers ran eagerly"
