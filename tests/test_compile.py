"""``EngineConfig(compile_layers=True)``: decoder layers compiled around the paged attention give stock
``model.generate()``'s greedy tokens, and closing the engine gives the model its eager layers back.

Reference: transformers' own ``generate()`` (fp32, CPU, each prompt alone). On CPU, Inductor compiles
C++ kernels (tens of seconds), so this runs one tiny model with a few prompts; on CUDA the same path is
the engine's default (with CUDA graphs) and runs through every GPU test.
"""

import torch

from conftest import engine_greedy, random_prompts, stock_greedy
from paged_transformers import EngineConfig, LLMEngine
from paged_transformers.compile import decoder_layers


def test_compiled_layers_match_stock_generate(tiny_model):
    model = tiny_model("llama", seed=3)
    prompts = random_prompts(4, 1, 40, seed=5)
    max_tokens = [9, 3, 12, 6]
    refs = [stock_greedy(model, p, n)[0] for p, n in zip(prompts, max_tokens)]
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers

    torch._dynamo.reset()
    config = EngineConfig(compile_layers=True, attention_backend="torch", max_model_len=128, max_num_seqs=4)
    with LLMEngine(model, engine_config=config) as engine:
        assert engine.runner.compile_error is None
        assert engine.runner.compiled_layers == layers
        assert all("forward" in vars(layer) for layer in layers)
        got = engine_greedy(engine, prompts, max_tokens)
    assert got == refs
    # the layers ran through Dynamo (not silently eager), and are eager again after close
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2
    assert not any("forward" in vars(layer) for layer in layers)
    assert model.config._attn_implementation != "paged_transformers"


def test_compile_layers_validated():
    import pytest

    with pytest.raises(ValueError, match="compile_layers must be a bool or None, got 'yes'"):
        EngineConfig(compile_layers="yes")
