"""``pipeline("text-generation")`` on a patched model returns what stock returns (SmolLM2, fp32 CPU):
6 prompts with batch_size 4, return_full_text, chat-message inputs; a list runs on the engine in one
``generate()`` call, and falls back to the pipeline's batches where the engine would not serve it."""

import pytest
from transformers import pipeline

import paged_transformers
from paged_transformers.patches import generate as patch_module

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Three colors are",
    "The best way to learn is",
    "Water boils at",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a fruit."}],
]


@pytest.mark.slow
def test_pipeline_matches_stock(smollm2, monkeypatch):
    model, tokenizer = smollm2
    monkeypatch.setattr(tokenizer, "padding_side", "left")
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    kwargs = dict(batch_size=4, max_new_tokens=8, do_sample=False)
    stock = pipe(PROMPTS, **kwargs)
    stock_new = pipe(PROMPTS, return_full_text=False, **kwargs)
    stock_chat = pipe(CHATS, **kwargs)

    calls = []
    original = patch_module._engine_generate
    monkeypatch.setattr(patch_module, "_engine_generate", lambda *a, **k: calls.append(1) or original(*a, **k))
    with paged_transformers.patch():
        assert pipe(PROMPTS, **kwargs) == stock
        assert pipe(PROMPTS, return_full_text=False, **kwargs) == stock_new
        assert pipe(CHATS, **kwargs) == stock_chat
        engine = paged_transformers.engine_for(model)
    assert len(calls) == 1 + 1 + 1  # each list of prompts (or chats) in one engine run, not one per batch of 4
    assert engine.closed  # one warm engine served every call; unpatch() released it


def test_pipeline_keeps_its_batches_where_the_engine_would_not_serve_the_list(smollm2, monkeypatch):
    """Beam search (stock code on a PagedCache) and right padding (stock code) keep the pipeline's batches, so the
    stock path never sees a larger batch than the user asked for."""
    model, tokenizer = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    sizes = []
    original = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: sizes.append(len(k["input_ids"])) or original(*a, **k))
    with paged_transformers.patch():
        monkeypatch.setattr(tokenizer, "padding_side", "left")
        pipe(PROMPTS[:3], batch_size=2, max_new_tokens=2, num_beams=2, do_sample=False)
        monkeypatch.setattr(tokenizer, "padding_side", "right")
        pipe(PROMPTS[:3], batch_size=2, max_new_tokens=2, do_sample=False)
        monkeypatch.setattr(tokenizer, "padding_side", "left")
        pipe(PROMPTS[:3], batch_size=2, max_new_tokens=2, do_sample=False)
    assert sizes == [2, 1, 2, 1, 3]



@pytest.mark.slow
def test_pipeline_stop_sequence_on_the_engine(smollm2, monkeypatch):
    """``stop_sequence`` makes the pipeline pass ``stop_strings`` and ``tokenizer=`` to ``generate()``: the
    engine serves it (it used to fall back to stock code) with stock's result."""
    model, tokenizer = smollm2
    monkeypatch.setattr(tokenizer, "padding_side", "left")
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    kwargs = dict(batch_size=4, max_new_tokens=12, do_sample=False, stop_sequence=["is", "\n"])
    stock = pipe(PROMPTS, **kwargs)
    assert stock != pipe(PROMPTS, max_new_tokens=12, do_sample=False, batch_size=4)  # the stops cut something

    calls = []
    original = patch_module._engine_generate
    monkeypatch.setattr(patch_module, "_engine_generate", lambda *a, **k: calls.append(1) or original(*a, **k))
    with paged_transformers.patch():
        assert pipe(PROMPTS, **kwargs) == stock
    assert len(calls) == 1  # the 6 prompts in one engine run
