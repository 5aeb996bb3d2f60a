"""Async scheduling (``EngineConfig.async_scheduling``) against the synchronous loop.

Reference: the same engine with ``async_scheduling=False`` (the synchronous loop, itself checked against
stock ``generate()`` elsewhere) on the same tiny random model and requests. Each case compares token ids,
finish reasons, stop reasons and logprobs request by request, checks the KV pool is whole afterwards,
and checks that the pipelined path ran (``num_pipelined_steps``), so that a case where every step fell
back to the synchronous path cannot pass silently.
"""

import pytest

from conftest import assert_pool_whole, check_block_invariants, random_prompts
from paged_transformers import EngineConfig, LLMEngine, SamplingParams

PROMPTS = random_prompts(5, 4, 40, seed=31)


class WordTokenizer:
    """A stand-in tokenizer for stop strings: token ``t`` is the word ``"w{t}"``, words joined by spaces."""

    eos_token_id = None

    def decode(self, token_ids, skip_special_tokens=True):
        return " ".join(f"w{t}" for t in token_ids)


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


def run(model, requests, async_scheduling, *, tokenizer=None, before_step=None, **config):
    """Run ``requests`` [(prompt, SamplingParams), ...] (a list, or a dict step -> list for requests
    added before that step) to completion. Returns ``(results, engine)``: request id -> per completion
    ``(token_ids, finish_reason, stop_reason, logprobs, cumulative_logprob)`` of its last output."""
    waves = requests if isinstance(requests, dict) else {0: requests}
    config.setdefault("max_model_len", 256)
    engine = LLMEngine(model, tokenizer, EngineConfig(async_scheduling=async_scheduling, **config))
    results, num_added, step = {}, 0, 0
    with engine:
        while step <= max(waves) or engine.has_unfinished_requests():
            for prompt, params in waves.get(step, []):
                engine.add_request(str(num_added), prompt, params)
                num_added += 1
            if before_step is not None:
                before_step(engine, step)
            for out in engine.step():
                results[out.request_id] = [
                    (c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob) for c in out.outputs
                ]
                assert all(0 <= t < model.config.vocab_size for t in out.outputs[0].token_ids)
            check_block_invariants(engine)
            step += 1
        assert_pool_whole(engine)  # no KV block leaked (cached blocks count as free)
    return results, engine


def compare(model, requests, **kwargs):
    """Run async and sync; assert equal results and that steps were pipelined. Returns (results, async engine)."""
    sync, sync_engine = run(model, requests, False, **kwargs)
    got, engine = run(model, requests, True, **kwargs)
    assert got == sync
    assert sync_engine.num_pipelined_steps == 0
    assert engine.num_pipelined_steps > 0, "no step was pipelined"
    return got, engine


def test_greedy_eos_at_different_steps_and_max_tokens(llama, monkeypatch):
    """Two EOS ids met at different output lengths, the rest by max_tokens (2..12 tokens)."""
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (12, 12, 2, 7, 12)]
    reference, _ = run(llama, list(zip(PROMPTS, params)), False)
    tokens = [reference[str(i)][0][0] for i in range(len(PROMPTS))]
    eos = {tokens[0][3], tokens[1][8]}  # request 0 stops after at most 4 tokens, request 1 after at most 9
    monkeypatch.setattr(llama.generation_config, "eos_token_id", sorted(eos))
    got, _ = compare(llama, list(zip(PROMPTS, params)))
    reasons = [got[str(i)][0][1] for i in range(len(PROMPTS))]
    lengths = [len(got[str(i)][0][0]) for i in range(len(PROMPTS))]
    assert reasons[0] == reasons[1] == "stop" and lengths[0] <= 4 < lengths[1] <= 9, (reasons, lengths)
    assert "length" in reasons, (reasons, lengths)


def test_length_stops_at_different_steps_keep_the_pipeline(llama):
    """Requests that stop by length at different steps (2..12 tokens, EOS ignored): a sequence whose token in
    flight is its last sits out the step launched next, so no step falls back to the synchronous loop. One
    prefill step, then every step up to the 12th token is launched ahead: 11 pipelined steps."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 3, 2, 7, 12)]
    got, engine = compare(llama, list(zip(PROMPTS, params)))
    assert [len(got[str(i)][0][0]) for i in range(len(PROMPTS))] == [12, 3, 2, 7, 12]
    assert engine.num_pipelined_steps == 11


def test_min_tokens_rows_are_pipelined(llama, monkeypatch):
    """min_tokens masks EOS on the device, batched, so such rows pipeline too (they used to need host work):
    the same tokens as the synchronous loop, and EOS not sampled before min_tokens."""
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=10, min_tokens=10) for i in range(5)]
    reference, _ = run(llama, list(zip(PROMPTS, params)), False)
    eos = sorted({reference[str(i)][0][0][1] for i in range(len(PROMPTS))})  # tokens the rows would draw early
    monkeypatch.setattr(llama.generation_config, "eos_token_id", eos)
    got, _ = compare(llama, list(zip(PROMPTS, params)))
    for i in range(len(PROMPTS)):
        tokens, reason = got[str(i)][0][:2]
        assert len(tokens) == 10 and reason == "length" and not set(tokens) & set(eos), (i, tokens, eos)


def test_stop_strings_and_stop_token_ids(llama):
    """A stop string across two tokens and a stop token id, found by the host after the next step launched."""
    base = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True) for _ in PROMPTS]
    reference, _ = run(llama, list(zip(PROMPTS, base)), False, tokenizer=WordTokenizer())
    out0, out1 = reference["0"][0][0], reference["1"][0][0]
    stop = f"w{out0[5]} w{out0[6]}"
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop_token_ids=[out1[4]])] + base[2:]
    got, _ = compare(llama, list(zip(PROMPTS, params)), tokenizer=WordTokenizer())
    assert got["0"][0][1:3] == ("stop", stop) and len(got["0"][0][0]) <= 7
    assert got["1"][0][1:3] == ("stop", out1[4]) and len(got["1"][0][0]) <= 5


def test_seeded_sampling_with_logprobs_and_n(llama):
    """Seeded temperature / top-k / top-p / min-p sampling with logprobs, and an n = 2 request (forks run
    synchronously, then pipelined): same tokens, logprobs and cumulative logprobs."""
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=2, max_tokens=10, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=1.0, min_p=0.05, seed=3, max_tokens=8, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=9, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
    ]
    got, _ = compare(llama, list(zip(PROMPTS, params)))
    assert len(got["0"][0][3]) == 10 and len(got["3"]) == 2 and got["3"][0][0] != got["3"][1][0]


def test_abort_while_a_step_is_in_flight(llama):
    """Aborting a request between steps while the next step runs with its row: the others are unchanged,
    its blocks come back, and its last output is the same as in the synchronous loop."""
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    in_flight_at_abort = []

    def abort(engine, step):
        if step == 5:
            if engine.config.async_scheduling:
                in_flight_at_abort.append(engine._in_flight is not None)
            engine.abort_request("2")
        if step == 7:  # and every request of the step in flight: it is dropped
            if engine.config.async_scheduling:
                in_flight_at_abort.append(engine._in_flight is not None)
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
            assert engine._in_flight is None and not engine.has_unfinished_requests()

    got, _ = compare(llama, list(zip(PROMPTS, params)), before_step=abort)
    assert in_flight_at_abort == [True, True]
    assert len(got["2"][0][0]) == 5 and got["2"][0][1] is None  # the last output before the abort


@pytest.mark.parametrize("old_n", [1, 2])
def test_request_id_reused_while_a_step_is_in_flight(llama, old_n):
    """A request aborted and added again under the same id while a step with the old one's rows runs (the old
    one with n = 1 or 2 sequences, the new one with 1): those rows are not reported as the new request's (every
    output of it carries a token, as in the synchronous loop), and its final tokens equal the synchronous loop's."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    new_prompt = random_prompts(1, 6, 6, seed=9)[0]

    def outputs_of_new_request(async_scheduling):
        seen, in_flight = [], None
        with LLMEngine(llama, engine_config=EngineConfig(max_model_len=256, async_scheduling=async_scheduling)) as engine:
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(str(i), prompt, SamplingParams(n=old_n, temperature=0, max_tokens=8, ignore_eos=True)
                                   if i == 2 else params)
            step = 0
            while engine.has_unfinished_requests():
                if step == 4:
                    in_flight = engine._in_flight is not None
                    engine.abort_request("2")
                    engine.add_request("2", new_prompt, params)
                for out in engine.step():
                    if out.request_id == "2" and step >= 4:
                        seen.append(list(out.outputs[0].token_ids))
                step += 1
            assert_pool_whole(engine)
        return seen, in_flight

    (sync, _), (got, in_flight) = outputs_of_new_request(False), outputs_of_new_request(True)
    assert in_flight
    assert all(got) and all(sync) and len(got[-1]) == 8
    assert got[-1] == sync[-1]


def test_preemption_with_a_tiny_pool(llama):
    """A pool too small for all requests: preempting steps run synchronously, the rest pipelined."""
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for _ in PROMPTS]
    got, engine = compare(llama, list(zip(PROMPTS, params)), num_gpu_blocks=12, block_size=8,
                          max_model_len=96, enable_prefix_caching=False)
    assert engine.stats().num_preemptions > 0
    assert all(len(got[str(i)][0][0]) == 24 for i in range(len(PROMPTS)))


def test_prefix_caching_with_shared_prefixes(llama):
    """Requests sharing a 32-token prefix, a second wave added while the first decodes: prefix-cache hits,
    full blocks cached while steps are in flight, same outputs."""
    prefix = random_prompts(1, 32, 32, seed=5)[0]
    tails = random_prompts(4, 3, 9, seed=6)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    waves = {0: [(prefix + tails[0], params), (prefix + tails[1], params)],
             6: [(prefix + tails[2], params), (prefix + tails[0], params)]}
    got, engine = compare(llama, waves, block_size=8)
    assert engine.stats().num_cached_tokens >= 2 * 32  # the second wave's prefixes at least
    assert got["3"][0][0] == got["0"][0][0]


def test_pipelined_steps_keep_a_step_in_flight(llama):
    """Steady greedy decode: after the first step each step() returns with the next step launched, one
    token per request per call; between calls each sequence counts the in-flight step's token as its one
    placeholder (already in num_computed_tokens), and its token ids are the ones reported."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLMEngine(llama, engine_config=EngineConfig(max_model_len=256)) as engine:
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(str(i), prompt, params)
        lengths = []
        while engine.has_unfinished_requests():
            outs = engine.step()
            lengths.append(sorted(len(o.outputs[0].token_ids) for o in outs))
            reported = {o.request_id: o.outputs[0].token_ids for o in outs}
            for seq in engine.scheduler.running:
                assert seq.num_output_placeholders == (engine._in_flight is not None)
                assert seq.num_computed_tokens == seq.num_tokens - (engine._in_flight is None)
                assert seq.output_token_ids == reported[seq.request_id]
        assert lengths == [[n] * 3 for n in range(1, 11)]
        # steps 2..10 launched before the previous step's tokens were read (step 10's token ends by length,
        # so nothing is launched after it)
        assert engine.num_pipelined_steps == 9
        assert engine._in_flight is None


def test_async_scheduling_config_is_checked():
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        EngineConfig(async_scheduling="yes")
