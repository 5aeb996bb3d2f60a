"""Every entry of ``paged_transformers.compat`` against the installed transformers: each private API the package
relies on still exists and still does what the package assumes. The references are transformers' public
behaviour (what stock ``generate()`` does and returns, public classes), not compat's own code. CI runs this file
on the newest transformers and on 5.17.0, the lowest supported."""

import inspect

import pytest
import torch
import transformers
from transformers import (
    DynamicCache, GenerationConfig, GenerationMixin, LogitsProcessor, LogitsProcessorList,
    NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
)

from paged_transformers import compat


class _Spy(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


def _spy_on_sample(monkeypatch):
    """Record the ``(generation_config, model_kwargs)`` each stock ``_sample`` call gets."""
    calls = []
    original = compat.original_generation_method("_sample")

    def spy(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
            streamer=None, **model_kwargs):
        calls.append((generation_config, model_kwargs))
        return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                        synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

    monkeypatch.setattr(GenerationMixin, "_sample", spy)
    return calls


def test_generation_mode_is_what_get_generation_mode_returns():
    assert GenerationConfig(do_sample=False).get_generation_mode() == compat.GenerationMode.GREEDY_SEARCH
    assert GenerationConfig(do_sample=True).get_generation_mode() == compat.GenerationMode.SAMPLE
    assert GenerationConfig(num_beams=2).get_generation_mode() == compat.GenerationMode.BEAM_SEARCH


def test_generate_returns_generate_decoder_only_output(tiny_model):
    model = tiny_model("llama")
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out, compat.GenerateDecoderOnlyOutput)
    rebuilt = compat.GenerateDecoderOnlyOutput(sequences=out.sequences, scores=None, logits=None)
    assert torch.equal(rebuilt.sequences, out.sequences)


def test_patched_methods_exist_with_the_signatures_patch_relies_on():
    sample, beam = (inspect.signature(compat.original_generation_method(n)) for n in ("_sample", "_beam_search"))
    head = ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus"]
    assert list(sample.parameters)[:7] == head + ["streamer"]
    assert list(beam.parameters)[:6] == head
    for sig in (sample, beam):
        assert list(sig.parameters.values())[-1].kind is inspect.Parameter.VAR_KEYWORD  # **model_kwargs
    for name in compat.PATCHED_GENERATION_METHODS:
        assert compat.original_generation_method(name) is GenerationMixin.__dict__[name]
    assert "logits_processor" in inspect.signature(compat.original_generation_method("generate")).parameters


def test_greedy_generate_goes_through_sample(tiny_model, monkeypatch):
    """patch() serves greedy/sampling by replacing ``_sample``: stock generate() must call it."""
    calls = _spy_on_sample(monkeypatch)
    tiny_model("llama").generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert len(calls) == 1
    assert calls[0][0].max_length == 5 and "attention_mask" in calls[0][1]


def test_beam_search_generate_goes_through_beam_search(tiny_model, monkeypatch):
    seen = []
    original = compat.original_generation_method("_beam_search")
    monkeypatch.setattr(GenerationMixin, "_beam_search", lambda self, *a, **k: seen.append(1) or original(self, *a, **k))
    tiny_model("llama").generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, num_beams=2, do_sample=False)
    assert seen == [1]


def test_prepare_generation_config_merges_like_generate(tiny_model, monkeypatch):
    """The config compat prepares equals the one stock generate() hands ``_sample``."""
    model = tiny_model("llama")
    monkeypatch.setattr(model.generation_config, "eos_token_id", [3, 4])  # the model is shared: restored after
    user = GenerationConfig(max_new_tokens=5, do_sample=True, top_k=7)
    gc, model_kwargs = compat.prepare_generation_config(model, GenerationConfig(**user.to_dict()), not_an_option=1)
    assert model_kwargs == {"not_an_option": 1}
    assert (gc.max_new_tokens, gc.do_sample, gc.top_k) == (5, True, 7)
    assert compat.eos_token_ids(gc) == [3, 4]
    calls = _spy_on_sample(monkeypatch)
    model.generate(torch.tensor([[1, 2, 3]]), generation_config=user)
    stock = calls[0][0]
    assert (stock.max_new_tokens, stock.do_sample, stock.top_k) == (gc.max_new_tokens, gc.do_sample, gc.top_k)
    assert compat.eos_token_ids(stock) == [3, 4]
    assert compat.pad_token_id(stock) == compat.pad_token_id(gc)


def test_build_logits_processors_builds_generate_list(tiny_model):
    model = tiny_model("llama")
    gc, _ = compat.prepare_generation_config(model, GenerationConfig(
        do_sample=True, temperature=0.7, top_k=5, repetition_penalty=1.3, no_repeat_ngram_size=2, max_new_tokens=4))
    user = _Spy()
    procs = compat.build_logits_processors(model, gc, [1, 2, 3], LogitsProcessorList([user]))
    kinds = {type(p) for p in procs}
    assert {RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor, TemperatureLogitsWarper,
            TopKLogitsWarper} <= kinds
    assert user in procs
    # the processors act on the prompt given: the repetition penalty lowers exactly its tokens' scores
    scores = torch.ones(1, model.config.vocab_size)
    penalized = next(p for p in procs if isinstance(p, RepetitionPenaltyLogitsProcessor))(torch.tensor([[1, 2, 3]]), scores)
    assert (penalized[0] < 1).nonzero().flatten().tolist() == [1, 2, 3]


def test_eos_and_pad_ids_of_a_config_as_generate_pads(tiny_model, monkeypatch):
    """Unprepared: the config's own ids. Prepared without a pad id: generate() pads finished rows with EOS."""
    assert compat.eos_token_ids(GenerationConfig(eos_token_id=5)) == [5]
    assert compat.eos_token_ids(GenerationConfig(eos_token_id=[5, 6])) == [5, 6]
    assert compat.eos_token_ids(GenerationConfig()) == []
    assert compat.pad_token_id(GenerationConfig(pad_token_id=9)) == 9
    assert compat.pad_token_id(GenerationConfig()) is None
    model = tiny_model("llama")
    monkeypatch.setattr(model.generation_config, "pad_token_id", None)  # the model is shared: restored after
    gc, _ = compat.prepare_generation_config(model, GenerationConfig(eos_token_id=7, max_new_tokens=2))
    assert compat.pad_token_id(gc) == 7


def test_attn_implementation_and_whether_it_can_be_set(tiny_model):
    model = tiny_model("llama")
    assert compat.can_set_attn_implementation(model) is True
    model.set_attn_implementation("eager")
    assert compat.attn_implementation(model.config) == "eager"
    model.set_attn_implementation("sdpa")
    assert compat.attn_implementation(model.config) == "sdpa"


def test_is_user_defined_cache_tells_a_users_cache_from_generates(tiny_model, monkeypatch):
    model = tiny_model("llama")
    calls = _spy_on_sample(monkeypatch)
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    key = "cache" if "cache" in calls[-1][1] else "past_key_values"  # (5.24 renamed it)
    own = calls[-1][1][key]
    assert own is not None and not compat.is_user_defined_cache(own)
    user = DynamicCache(config=model.config)
    assert not compat.is_user_defined_cache(user)
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, **{key: user})
    assert compat.is_user_defined_cache(user)


def test_model_from_config_builds_the_class_in_the_dtype():
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = compat.model_from_config(transformers.LlamaForCausalLM, config, torch.bfloat16)
    assert type(model) is transformers.LlamaForCausalLM
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_workload_hints_has_the_fields_the_bench_sets():
    hints = compat.workload_hints(max_prompt_length=7, max_generated_length=5, num_requests=3)
    if hints is None:
        pytest.skip(f"transformers {transformers.__version__} has no continuous-batching WorkloadHints")
    assert (hints.max_prompt_length, hints.max_generated_length, hints.num_requests) == (7, 5, 3)
