"""``paged_transformers.patch()``: patched ``model.generate()`` against stock ``generate()`` on the same
weights (fp32 CPU). Per prompt alone and as a left-padded batch, for the GenerationConfig options the
engine serves; fallbacks (beam search on a PagedCache); unpatch / context manager; plain forwards and a
training step unchanged; unsupported options and failing processors."""

import contextlib
import logging
import threading
import time

import pytest
import torch
import transformers
from transformers import GenerationConfig, LogitsProcessor

import paged_transformers
from paged_transformers import PagedCache, SamplingParams, paged_generate
from paged_transformers.integration import warm as warm_module
from paged_transformers.patches import generate as patch_module

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32, 33, 34]]

# greedy unless do_sample; every option generate() honours for decoder-only greedy / sampling
OPTIONS = {
    "greedy": dict(do_sample=False),
    "repetition_penalty": dict(do_sample=False, repetition_penalty=1.8),
    "no_repeat_ngram": dict(do_sample=False, no_repeat_ngram_size=2),
    "bad_words": dict(do_sample=False, bad_words_ids=[[40], [41, 42]]),
    "min_new_suppress": dict(do_sample=False, min_new_tokens=6, suppress_tokens=[43], begin_suppress_tokens=[44]),
    "forced_eos": dict(do_sample=False, forced_eos_token_id=2),
    "scores_logits": dict(do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True),
    "sample_warpers": dict(do_sample=True, temperature=0.7, top_k=30, top_p=0.9, min_p=0.02),
    "sample_typical": dict(do_sample=True, typical_p=0.8),
    # NOTE: sampled tokens match bitwise while both draw from the global RNG with the same shapes; stock
    # keeps drawing for rows that finished, the engine does not, so EOS is suppressed here.
    "nrs4": dict(do_sample=True, num_return_sequences=4, suppress_tokens=[2]),
}


def left_pad(prompts, pad_id=2):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture
def engine_count(monkeypatch):
    """Counts the ``generate()`` calls the engine served (proof the engine path ran)."""
    served = []
    original = patch_module._engine_generate

    def counting(*args, **kwargs):
        served.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(patch_module, "_engine_generate", counting)
    return served


def run(model, ids, mask, patched, seed=0, **kwargs):
    torch.manual_seed(seed)
    if patched:
        with paged_transformers.patch():
            return model.generate(ids, attention_mask=mask, max_new_tokens=10, **kwargs)
    return model.generate(ids, attention_mask=mask, max_new_tokens=10, **kwargs)


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if not torch.equal(a.sequences, b.sequences):
        return False
    for name in ("scores", "logits"):
        xs, ys = getattr(a, name), getattr(b, name)
        if (xs is None) != (ys is None) or (xs is not None and len(xs) != len(ys)):
            return False
        for x, y in zip(xs or (), ys or ()):
            live = ~torch.isnan(x).all(-1)  # rows already finished are NaN on the engine path
            if not torch.allclose(x[live], y[live], atol=1e-4, rtol=1e-4):
                return False
    return True


@pytest.mark.parametrize("option", list(OPTIONS))
def test_patched_equals_stock_per_prompt(tiny_model, engine_count, option):
    model = tiny_model("llama")
    for prompt in (PROMPTS[0], PROMPTS[1]):
        ids = torch.tensor([prompt])
        mask = torch.ones_like(ids)
        stock = run(model, ids, mask, patched=False, **OPTIONS[option])
        paged = run(model, ids, mask, patched=True, **OPTIONS[option])
        assert same(paged, stock), f"{option} {prompt}"
    assert len(engine_count) == 2


def _stock_repetition_penalty_skips_left_padding() -> bool:
    """Newer transformers give RepetitionPenaltyLogitsProcessor per-row ``prompt_ignore_length`` (a tensor)
    and skip left padding; older ones (5.17) penalize the pad tokens of a padded batch, so their padded
    batch differs from the same prompts alone (which the engine reproduces)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    try:
        RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.tensor([0]))
    except ValueError:
        return False
    return True


PADDED_OPTIONS = ("greedy", "scores_logits") + (
    ("repetition_penalty",) if _stock_repetition_penalty_skips_left_padding() else ()
)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_patched_equals_stock_padded_batch(tiny_model, engine_count, arch):
    model = tiny_model(arch)
    ids, mask = left_pad(PROMPTS)
    for option in PADDED_OPTIONS:
        stock = run(model, ids, mask, patched=False, **OPTIONS[option])
        paged = run(model, ids, mask, patched=True, **OPTIONS[option])
        assert same(paged, stock), f"{arch} {option}"
    assert len(engine_count) == len(PADDED_OPTIONS)


def test_eos_rows_right_padded(tiny_model):
    model = tiny_model("llama")
    ids, mask = left_pad(PROMPTS)
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    eos = int(stock[0, ids.shape[1]])  # make the first row stop at once with this token as EOS
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=3)
    stock = model.generate(ids, **kwargs)
    with paged_transformers.patch():
        paged = model.generate(ids, **kwargs)
    assert torch.equal(paged, stock)
    assert paged[0, ids.shape[1] + 1 :].eq(3).all()


def test_beam_search_falls_back_to_paged_cache(tiny_model, engine_count, caplog, monkeypatch):
    monkeypatch.setattr(patch_module, "_LOGGED", set())
    seen = []
    original = PagedCache.reorder_cache
    monkeypatch.setattr(PagedCache, "reorder_cache", lambda self, idx: (seen.append(1), original(self, idx)))
    model = tiny_model("qwen2")
    ids, mask = left_pad(PROMPTS)
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="paged_transformers"), paged_transformers.patch():
        paged = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False)
        model.generate(ids, attention_mask=mask, max_new_tokens=2, num_beams=3, do_sample=False)
    assert torch.equal(paged, stock)
    assert seen and not engine_count
    assert sum("beam search" in r.message for r in caplog.records) == 1  # logged once


def test_unpatch_and_context_manager():
    from transformers import GenerationMixin

    original = GenerationMixin.generate
    handle = paged_transformers.patch()
    assert GenerationMixin.generate is not original and patch_module.is_patched()
    paged_transformers.patch()  # idempotent
    paged_transformers.unpatch()
    assert GenerationMixin.generate is original
    with handle:
        pass  # __exit__ unpatches even when already unpatched
    with paged_transformers.patch():
        assert GenerationMixin.generate is not original
    assert GenerationMixin.generate is original


def test_forward_and_training_unchanged(tiny_model):
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (2, 12))

    def loss_and_grads(model):
        model.train()
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.eval()
        return loss.detach(), grads

    reference = tiny_model("llama", seed=5)
    ref_loss, ref_grads = loss_and_grads(reference)
    ref_logits = reference(ids).logits
    with paged_transformers.patch():
        model = tiny_model("llama", seed=5)
        model.generate(ids[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=3, do_sample=False)
        assert model.config._attn_implementation == reference.config._attn_implementation
        loss, grads = loss_and_grads(model)
        assert torch.equal(model(ids).logits, ref_logits)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


class Boom(LogitsProcessor):
    """Raises for one prompt (recognised by its first token), passes the others through."""

    def __init__(self, bad_first_token):
        self.bad_first_token = bad_first_token

    def __call__(self, input_ids, scores):
        if int(input_ids[0, 0]) == self.bad_first_token:
            raise KeyError("boom")
        return scores


def test_failing_processor_fails_only_its_row(tiny_model):
    model = tiny_model("llama")
    ids, mask = left_pad(PROMPTS)
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    with paged_transformers.patch(), pytest.raises(KeyError, match="boom") as info:
        model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, logits_processor=[Boom(PROMPTS[1][0])])
    assert list(info.value.paged_failed_rows) == [1]
    partial = info.value.paged_partial_output
    for row in (0, 2, 3):
        assert torch.equal(partial[row, : stock.shape[1]], stock[row])
    # the engine API: the failed request carries its exception, the others finish
    outs = paged_generate(model, PROMPTS, generation_config=GenerationConfig(max_new_tokens=5, do_sample=False),
                          logits_processor=[Boom(PROMPTS[1][0])], use_tqdm=False)
    assert isinstance(outs[1].outputs[0].error, KeyError) and outs[1].outputs[0].finish_reason == "abort"
    assert all(outs[i].outputs[0].error is None and outs[i].outputs[0].finish_reason in ("stop", "length") for i in (0, 2, 3))


def test_processor_failing_every_row_with_scores(tiny_model):
    """With ``output_scores`` it used to raise a bare StopIteration (no row had recorded a score)."""
    model = tiny_model("llama")
    ids, mask = left_pad(PROMPTS)

    def raiser(input_ids, scores):
        raise RuntimeError("boom")

    for output_scores in (False, True):
        with paged_transformers.patch(), pytest.raises(RuntimeError, match="boom") as info:
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, logits_processor=[raiser],
                           return_dict_in_generate=True, output_scores=output_scores, output_logits=output_scores)
        assert sorted(info.value.paged_failed_rows) == list(range(len(PROMPTS)))
        partial = info.value.paged_partial_output
        assert torch.equal(partial.sequences, ids) and (partial.scores == () if output_scores else partial.scores is None)


@pytest.mark.parametrize(
    "option, name",
    [(dict(num_beams=2), "num_beams"), (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
     (dict(guidance_scale=1.5), "guidance_scale"), (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions")],
)
def test_unsupported_options_raise(tiny_model, option, name):
    model = tiny_model("llama")
    with pytest.raises(NotImplementedError, match=name):
        paged_generate(model, PROMPTS[:1], generation_config=GenerationConfig(max_new_tokens=3, **option), use_tqdm=False)


@pytest.mark.slow
def test_stop_strings_with_tokenizer_served_by_the_engine(smollm2, engine_count, monkeypatch, caplog):
    """``generate(..., stop_strings=..., tokenizer=tok)`` used to run stock code: ``tokenizer`` was taken
    for a model input. Stops that end inside a token and span tokens, on a left-padded batch."""
    model, tokenizer = smollm2
    monkeypatch.setattr(tokenizer, "padding_side", "left")
    monkeypatch.setattr(patch_module, "_LOGGED", set())
    batch = tokenizer(["The capital of France is", "One, two, three,", "Once upon a time"], return_tensors="pt", padding=True)
    kwargs = dict(**batch, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    stops = dict(stop_strings=["is.", "x, s", "va H"], tokenizer=tokenizer)
    stock = model.generate(**kwargs, **stops)
    assert stock.shape[1] < model.generate(**kwargs).shape[1]  # every row stopped early
    with caplog.at_level(logging.WARNING, logger="paged_transformers"), paged_transformers.patch():
        paged = model.generate(**kwargs, **stops)
    assert torch.equal(paged, stock)
    assert len(engine_count) == 1 and not caplog.records  # the engine served it, no fallback


# -- position limits: the engine serves what fits max_position_embeddings; past it, RoPE models run stock code
# and learned position tables are refused up front (stock would fail mid-generation) ---------------------------


def tiny_gpt2():
    """A tiny GPT-2 (learned position table ``wpe`` of 64 rows), fp32, eval mode."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return transformers.GPT2LMHeadModel(config).eval()


def run_at_length(model, prompt_len, max_new, patched):
    ids = torch.randint(3, 128, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    with paged_transformers.patch() if patched else contextlib.nullcontext():
        # EOS suppressed: every call runs to max_length, so a refused call is one where stock fails
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                              suppress_tokens=[2])


@pytest.mark.parametrize(
    "prompt_len, max_new, served",
    [(40, 24, "engine"), (63, 1, "engine"), (63, 2, "stock"), (64, 1, "stock"), (60, 10, "refused"), (65, 1, "refused")],
)
def test_learned_positions_past_the_table(engine_count, prompt_len, max_new, served):
    """GPT-2 with n_positions=64: past 65 tokens stock dies mid-forward (IndexError); the patched generate used
    to fall back to it. Now it raises a ValueError naming the lengths before any forward; up to 64 tokens the
    engine serves it, at 65 (stock feeds every token but the last) stock code runs."""
    model = tiny_gpt2()
    if served == "refused":
        with pytest.raises(IndexError):
            run_at_length(model, prompt_len, max_new, patched=False)
        forwards = []
        hook = model.register_forward_pre_hook(lambda *a: forwards.append(1))
        match = (rf"GPT2LMHeadModel.*max_position_embeddings=64.*prompt of {prompt_len} tokens with "
                 rf"max_new_tokens={max_new} \(max_length={prompt_len + max_new}\).*<= 65")
        with pytest.raises(ValueError, match=match):
            run_at_length(model, prompt_len, max_new, patched=True)
        hook.remove()
        assert not forwards and not engine_count
        return
    stock = run_at_length(model, prompt_len, max_new, patched=False)
    assert torch.equal(run_at_length(model, prompt_len, max_new, patched=True), stock)
    assert len(engine_count) == (served == "engine")


@pytest.mark.parametrize(
    "prompt_len, max_new, served",
    [(40, 24, "engine"), (63, 1, "engine"), (63, 2, "stock"), (64, 1, "stock"), (65, 3, "stock"), (60, 10, "stock")],
)
def test_rope_positions_past_max_position_embeddings(tiny_model, engine_count, prompt_len, max_new, served):
    """A RoPE Llama with max_position_embeddings=64: the engine serves prompt + new tokens <= 64 (a prompt
    leaves room for one token, as LLMEngine requires); past that stock code extrapolates and runs, as unpatched."""
    model = tiny_model("llama", max_position_embeddings=64)
    stock = run_at_length(model, prompt_len, max_new, patched=False)
    assert torch.equal(run_at_length(model, prompt_len, max_new, patched=True), stock)
    assert len(engine_count) == (served == "engine")


def test_eos_id_outside_the_vocabulary_runs_as_stock(engine_count):
    """GPT2Config's default eos 50256 on a 128-token vocabulary: stock generate() warns and runs; the patched call
    used to refuse it (``stop_token_ids outside the vocabulary``). Such an id can never be sampled, so the engine
    serves the call without it, with stock's tokens."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2)  # eos 50256
    model = transformers.GPT2LMHeadModel(config).eval()
    assert model.generation_config.eos_token_id >= model.config.vocab_size
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    stock = model.generate(ids, **kwargs)
    with paged_transformers.patch():
        assert torch.equal(model.generate(ids, **kwargs), stock)
    assert len(engine_count) == 1


def test_left_padding_of_a_mask():
    """padding.left_padding (the one place the patch reads the padding from) against a per-row count; a 0 after
    a 1 is refused, naming the rows."""
    from paged_transformers.integration.padding import left_padding, unpadded_prompts

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 7, (9,), generator=g).tolist()  # real tokens per row, 0 = all padding
    mask = torch.tensor([[0] * (6 - n) + [1] * n for n in lens], dtype=torch.bool)
    assert left_padding(mask) == [6 - n for n in lens]
    ids = torch.arange(9 * 6).view(9, 6)
    assert unpadded_prompts(ids, left_padding(mask)) == [row[6 - n:] for row, n in zip(ids.tolist(), lens)]
    assert left_padding(None, num_rows=3) == [0, 0, 0]
    with pytest.raises(ValueError, match=r"rows \[1\] have a 0 after a 1"):
        left_padding(torch.tensor([[0, 1, 1], [1, 1, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match="must be"):
        left_padding(torch.ones(3))


@pytest.mark.parametrize("dropout, served", [(0.1, "stock"), (0.0, "engine")])
def test_training_mode_with_dropout(engine_count, caplog, monkeypatch, dropout, served):
    """GPT-2 in train() mode (an RL loop generating without eval()): stock generate() runs with dropout (GPT-2's
    default attn_pdrop is 0.1); the patched call used to raise (the engine runs inference only). With dropout it
    now runs stock code, with stock's random draws (same seed, same tokens) and a one-time log line; with every
    dropout probability 0 the engine serves it."""
    monkeypatch.setattr(patch_module, "_LOGGED", set())
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                                     eos_token_id=2, pad_token_id=2, attn_pdrop=dropout, resid_pdrop=dropout,
                                     embd_pdrop=dropout)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True, suppress_tokens=[2])
    torch.manual_seed(5)
    stock = model.generate(ids, **kwargs)
    with caplog.at_level(logging.WARNING, logger="paged_transformers"), paged_transformers.patch():
        torch.manual_seed(5)
        patched = model.generate(ids, **kwargs)
        model.generate(ids, **kwargs)
    assert torch.equal(patched, stock)
    assert len(engine_count) == (2 if served == "engine" else 0)
    assert sum("training mode with dropout" in r.message for r in caplog.records) == (served == "stock")
    assert model.training


@pytest.mark.parametrize("shape", [(1, 0), (3, 0)])
def test_input_ids_without_a_token(engine_count, shape):
    """Stock generate() fails on empty input_ids only mid-forward (GPT-2: an IndexError, or on older transformers a
    reshape RuntimeError); the patched call raised that too. It raises a ValueError naming the shape, as paged_generate
    and LLM refuse an empty prompt."""
    model = tiny_gpt2()
    ids = torch.zeros(shape, dtype=torch.int64)
    with pytest.raises((IndexError, RuntimeError)):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    with paged_transformers.patch(), pytest.raises(ValueError, match=rf"input_ids of shape \({shape[0]}, 0\) hold no token"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert not engine_count
    with pytest.raises(ValueError, match=r"prompt 0: prompt is empty"):
        paged_generate(model, [[]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 0: prompt is empty"):
        paged_transformers.LLM(model).generate([[]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_unpatch_keeps_an_engine_another_entry_point_built(tiny_model, monkeypatch):
    """A patched generate() that starts while paged_generate (another thread) builds the model's warm engine waits
    for it and runs on it. unpatch() used to take that engine for the patch's own (it compared the engine with the
    one seen before taking the model's lock, None during the build) and close it."""
    model = tiny_model("llama")
    building, original = threading.Event(), warm_module.LLMEngine

    def slow_engine(*args, **kwargs):
        building.set()
        time.sleep(2.0)  # the patched call reaches the model's lock during the build
        return original(*args, **kwargs)

    monkeypatch.setattr(warm_module, "LLMEngine", slow_engine)
    params = SamplingParams(temperature=0, max_tokens=4)
    builder = threading.Thread(target=paged_generate, args=(model, [PROMPTS[0]], params), kwargs=dict(use_tqdm=False))
    builder.start()
    assert building.wait(timeout=60)
    ids, mask = left_pad(PROMPTS[:2])
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with paged_transformers.patch():
        patched = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        engine = warm_module.current_engine(model)
    builder.join()
    assert torch.equal(patched, stock)
    assert engine is not None and not engine.closed and warm_module.current_engine(model) is engine
    # an engine the patched call built is still the patch's to close
    paged_transformers.release(model)
    with paged_transformers.patch():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        engine = warm_module.current_engine(model)
    assert engine.closed and warm_module.current_engine(model) is None
