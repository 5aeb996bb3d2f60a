"""Sampling and stopping through the engine, checked against stock transformers.

References: stock ``model.generate()`` (greedy, ``min_new_tokens``, ``eos_token_id``), the stock model's
own logits by teacher forcing (logprobs; the support of top-k / top-p / min-p), and exact
probabilities for the sampler's draws on fixed logits.
"""

import pytest
import torch

from conftest import check_block_invariants, random_prompts, stock_greedy
from sampler_helpers import Rows, sample, sample_tokens
from paged_transformers import EngineConfig, LLMEngine, SamplingParams, paged_generate

PROMPTS = random_prompts(6, 5, 60, seed=1)


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


def run(model, prompts, params, engine_config=None):
    """paged_generate, returning the first completion of each prompt."""
    outs = paged_generate(model, prompts, params, engine_config=engine_config, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@torch.inference_mode()
def stock_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Teacher forcing: the stock model's raw logits ``[len(output), vocab]`` float32 that chose each output token."""
    ids = torch.tensor([prompt + output[:-1]])
    logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 :]


# -- seeds ---------------------------------------------------------------------------------------
def test_seeded_request_ignores_the_rest_of_the_batch(llama, engine_spy):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = run(llama, [PROMPTS[0]], seeded)[0].token_ids

    others = [SamplingParams(temperature=0.7, max_tokens=5 + i, ignore_eos=True) for i in range(4)]
    others.append(SamplingParams(temperature=1.0, seed=99, max_tokens=9, ignore_eos=True))
    torch.manual_seed(7)  # the unseeded rows draw from the global stream; it must not matter
    in_batch = run(llama, PROMPTS[1:] + [PROMPTS[0]], others + [seeded])
    assert in_batch[-1].token_ids == alone

    # ... also when the batch preempts it and chunks prompts (pool of 10 blocks of 8 tokens).
    small = EngineConfig(block_size=8, num_gpu_blocks=10, max_model_len=80, max_num_batched_tokens=24)
    crowded = run(llama, PROMPTS[1:] + [PROMPTS[0]], others + [seeded], engine_config=small)
    assert crowded[-1].token_ids == alone
    assert sum(seq.num_preemptions for seq in engine_spy[-1].seen_seqs.values()) > 0

    # Not vacuous: another seed, or greedy, gives other tokens.
    other_seed = run(llama, [PROMPTS[0]], SamplingParams(temperature=1.0, seed=1235, max_tokens=16, ignore_eos=True))
    greedy = run(llama, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert other_seed[0].token_ids != alone and greedy[0].token_ids != alone


def test_top_k_1_is_greedy(llama):
    greedy = run(llama, PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    top1 = run(llama, PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=12))
    assert [c.token_ids for c in top1] == [c.token_ids for c in greedy]


def test_tiny_temperature_is_greedy(llama):
    """Temperatures under 1e-5 count as greedy (vLLM); 1e-40 used to overflow to inf and fail the whole batch."""
    greedy = run(llama, PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    params = [SamplingParams(temperature=t, seed=i, max_tokens=8) for i, t in enumerate([1e-6, 1e-40, 1e-45, 0.0, 1e-6, 1.0])]
    mixed = run(llama, PROMPTS, params)
    assert [c.token_ids for c in mixed[:5]] == [c.token_ids for c in greedy[:5]]
    assert all(c.finished and c.error is None for c in mixed)


# -- stopping ------------------------------------------------------------------------------------
def test_eos_min_tokens_ignore_eos(llama, monkeypatch):
    """Make the prompt's first greedy token the EOS, then check each stopping rule against stock generate."""
    prompt = PROMPTS[2]
    first = stock_greedy(llama, prompt, 1)[0][0]
    monkeypatch.setattr(llama.generation_config, "eos_token_id", first)

    (stop,) = run(llama, [prompt], SamplingParams(temperature=0.0, max_tokens=10))
    assert stop.token_ids == [first] and stop.finish_reason == "stop"

    (held,) = run(llama, [prompt], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5))
    want, _ = stock_greedy(llama, prompt, 10, min_new_tokens=5)
    assert held.token_ids == want
    assert first not in held.token_ids[:5] and len(held.token_ids) >= 5

    (ignored,) = run(llama, [prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert ignored.token_ids[0] == first and len(ignored.token_ids) == 6 and ignored.finish_reason == "length"
    monkeypatch.setattr(llama.generation_config, "eos_token_id", None)
    want, _ = stock_greedy(llama, prompt, 6)
    assert ignored.token_ids == want


def test_stop_token_ids_and_length(llama):
    prompt = PROMPTS[3]
    want, _ = stock_greedy(llama, prompt, 12)
    assert 2 not in want, "the reference should run to max_tokens for this test"
    k = next(k for k in range(2, len(want)) if want[k] not in want[:k])
    (full,) = run(llama, [prompt], SamplingParams(temperature=0.0, max_tokens=12))
    assert full.token_ids == want and full.finish_reason == "length" and full.stop_reason is None

    (stopped,) = run(llama, [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[want[k]]))
    assert stopped.token_ids == want[: k + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == want[k]

    (held,) = run(llama, [prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=k + 1,
                                                  stop_token_ids=[want[k]]))
    assert held.token_ids[:k] == want[:k] and held.token_ids[k] != want[k]


# -- logprobs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_log_softmax_of_stock_logits(llama, temperature):
    """Logprobs are of the raw logits (before temperature), as the SamplingParams docstring says."""
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=10, logprobs=4, ignore_eos=True)
    completions = run(llama, PROMPTS[:3], params)
    for prompt, c in zip(PROMPTS[:3], completions):
        ref = torch.log_softmax(stock_logits(llama, prompt, c.token_ids), dim=-1)
        assert len(c.logprobs) == len(c.token_ids) == 10
        total = 0.0
        for step, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            top = ref[step].topk(4)
            want = {int(i): float(v) for i, v in zip(top.indices, top.values)}
            want[tok] = float(ref[step, tok])
            assert lp.keys() == want.keys(), f"step {step}: top-4 ids {sorted(lp)} != {sorted(want)}"
            for t, v in want.items():
                assert lp[t] == pytest.approx(v, abs=1e-4)
            total += lp[tok]
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)


# -- support of top-k / top-p / min-p ---------------------------------------------------------------
def _allowed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, tol: float = 1e-4):
    """Tokens a correct sampler may draw from ``logits [vocab]`` (borderline ones within ``tol`` included)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True)
    allowed = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0:
        allowed[order[top_k:]] = False
        kept = probs[order[:top_k]]
        probs = torch.zeros_like(probs).scatter(0, order[:top_k], kept / kept.sum())
    sorted_probs = probs[order]
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    allowed[order[mass_before > top_p + tol]] = False
    allowed &= probs >= min_p * probs.max() - tol
    return allowed


@pytest.mark.parametrize(
    "top_k, top_p, min_p", [(5, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.3), (8, 0.8, 0.1)],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_sampled_tokens_stay_in_the_support(llama, top_k, top_p, min_p):
    temperature = 1.5
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=s,
                             max_tokens=24, ignore_eos=True) for s in range(len(PROMPTS))]
    completions = run(llama, PROMPTS, params)
    not_argmax = wide = 0
    for prompt, c in zip(PROMPTS, completions):
        logits = stock_logits(llama, prompt, c.token_ids)
        for step, tok in enumerate(c.token_ids):
            allowed = _allowed(logits[step], temperature, top_k, top_p, min_p)
            assert allowed[tok], f"step {step}: token {tok} outside the support {allowed.nonzero().flatten().tolist()}"
            not_argmax += tok != int(logits[step].argmax())
            wide += int(allowed.sum()) > 1
    # Not vacuous: it sampled (not only argmax), and the support was usually wider than one token.
    assert not_argmax > 10 and wide > len(PROMPTS) * 24 // 2


def _draws(logits_row: list[float], num: int, top_p_candidates: int = 256, **params) -> torch.Tensor:
    """``num`` seeded draws from one fixed logits row through the engine's sampler."""
    sp = SamplingParams(**params)
    generators = [torch.Generator().manual_seed(i) for i in range(num)]
    logits = torch.tensor([logits_row] * num)
    out = sample_tokens(logits, [sp] * num, generators, prompts=[[0]] * num, top_p_candidates=top_p_candidates)
    return torch.tensor(out.token_ids)


@pytest.mark.parametrize(
    "params, expected",
    [
        ({}, [0.5, 0.3, 0.15, 0.05]),
        ({"top_p": 0.7}, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),  # mass before token 2 is 0.8 >= 0.7
        ({"top_p": 0.85}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        ({"top_k": 2}, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
        ({"min_p": 0.25}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),  # 0.05 < 0.25 * 0.5
        ({"min_p": 0.7}, [1.0, 0, 0, 0]),
    ],
    ids=["plain", "top_p=0.7", "top_p=0.85", "top_k=2", "min_p=0.25", "min_p=0.7"],
)
@pytest.mark.parametrize("candidates", [256, 2], ids=["whole-row", "2-candidates"])
def test_sampler_distribution(params, expected, candidates):
    """Draw frequencies match the renormalised target distribution (4000 seeded draws; 4 sigma). With 2 top-p
    candidates, top_p=0.7 is drawn among them (they hold 0.8 of the mass) and top_p=0.85 falls back to the row."""
    num = 4000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = _draws(probs.log().tolist(), num, candidates, temperature=1.0, **params)
    freq = torch.bincount(draws, minlength=4).double() / num
    want = torch.tensor(expected, dtype=torch.float64)
    assert ((freq > 0) == (want > 0)).all(), f"support {freq.tolist()} != {want.tolist()}"
    sigma = (want * (1 - want) / num).sqrt()
    assert ((freq - want).abs() <= 4 * sigma + 1e-9).all(), f"frequencies {freq.tolist()} vs {want.tolist()}"


def test_seeded_rows_with_top_k_or_top_p_ignore_the_batch():
    """A seeded row's draws do not depend on the other rows, also when they change how many candidates its
    top-k / top-p is computed on (another row's larger top_k, a top-p row whose nucleus is wider than the
    candidates) or which group it is drawn in (rows without filters, greedy rows)."""
    from paged_transformers.core.sampling import Sampler

    vocab = 300
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 2
    flat = torch.zeros(1, vocab)  # its nucleus needs most of the vocabulary: the batch falls back to the whole row
    seeded = [SamplingParams(temperature=0.9, top_k=5, seed=1), SamplingParams(temperature=1.1, top_p=0.8, seed=2),
              SamplingParams(temperature=1.0, top_k=12, top_p=0.7, min_p=0.05, seed=3)]
    others = [SamplingParams(temperature=1.0, top_k=60), SamplingParams(temperature=1.0, top_p=0.95),
              SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)]

    def draws(params, rows, steps=25):
        batch = Rows(params, [torch.Generator().manual_seed(sp.seed) if sp.seed else None for sp in params])
        sampler = Sampler(vocab, top_p_candidates=16)
        return [batch.sample_tokens(sampler, rows).token_ids[: len(seeded)] for _ in range(steps)]

    alone = draws(seeded, logits.expand(len(seeded), vocab))
    assert len({tuple(step) for step in alone}) > 1  # not vacuous: the draws vary
    batch = seeded + others
    assert draws(batch, logits.expand(len(batch), vocab)) == alone
    assert draws(batch, torch.cat([logits.expand(len(batch) - 3, vocab), flat, logits, logits])) == alone


def test_temperature_sharpens(llama):
    """Lower temperature -> the draws agree with argmax more often (checked by teacher forcing)."""
    agree = {}
    for temperature in (0.3, 3.0):
        params = [SamplingParams(temperature=temperature, seed=s, max_tokens=16, ignore_eos=True) for s in range(6)]
        completions = run(llama, PROMPTS, params)
        agree[temperature] = sum(
            int((stock_logits(llama, p, c.token_ids).argmax(-1) == torch.tensor(c.token_ids)).sum())
            for p, c in zip(PROMPTS, completions)
        )
    assert agree[0.3] > agree[3.0]


def test_engine_step_invariants_with_sampling(llama):
    """Mixed greedy / seeded / unseeded requests with a small pool: blocks stay within bounds each step."""
    config = EngineConfig(block_size=8, num_gpu_blocks=12, max_model_len=90, max_num_batched_tokens=32)
    with LLMEngine(llama, engine_config=config) as engine:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i if i % 3 else None,
                                                              max_tokens=20, ignore_eos=True))
        finished = 0
        while engine.has_unfinished_requests():
            finished += sum(o.finished for o in engine.step())
            check_block_invariants(engine)
        bm = engine.cache.block_manager
        assert finished == len(PROMPTS) and bm.num_free_blocks == bm.num_blocks


def test_sample_tokens_batch_matches_a_torch_reference_and_sample():
    """The sampler (``launch`` / ``collect``, what the engine calls): greedy rows are the argmax, a failing
    processor fails only its row (token None), logprobs rows carry log_softmax of the raw logits; the per-row
    view agrees row by row."""

    def broken(input_ids, scores):
        raise RuntimeError("boom")

    vocab = 50
    logits = torch.randn(4, vocab + 3, generator=torch.Generator().manual_seed(0))  # 3 padding columns
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0, logits_processors=[broken]), SamplingParams(temperature=0)]
    out = sample_tokens(logits, params, prompts=[[1, 2]] * len(params), vocab_size=vocab)
    expected = logits[:, :vocab].argmax(dim=-1).tolist()
    assert out.token_ids == [expected[0], expected[1], None, expected[3]]
    assert list(out.errors) == [2] and isinstance(out.errors[2], RuntimeError)
    ref = torch.log_softmax(logits[1, :vocab], dim=-1)
    logprob, top = out.logprobs[1]
    assert list(out.logprobs) == [1] and logprob == pytest.approx(float(ref[expected[1]]))
    assert sorted(top) == sorted(set(ref.topk(3).indices.tolist()) | {expected[1]})
    results = sample(logits, params, prompts=[[1, 2]] * len(params), vocab_size=vocab)
    assert [r.token_id for r in results] == out.token_ids
    assert isinstance(results[2].error, RuntimeError)
    assert results[1].top_logprobs == top and results[0].top_logprobs is None


# -- logits the sampler cannot draw from ------------------------------------------------------------
def plus_inf(token_id: int):
    """A logits processor that forces ``token_id`` with +inf (softmax of such a row is NaN)."""

    def processor(input_ids, scores):
        scores = scores.clone()
        scores[:, token_id] = float("inf")
        return scores

    return processor


def test_plus_inf_logit_under_sampling_fails_only_its_request(llama):
    """A +inf logit at temperature > 0 used to make every probability NaN, and the draw emitted token 0 at
    every step. The request fails alone ("abort", ``error``); greedy argmax still takes the +inf token (as
    stock greedy does); the other rows are untouched and no block is left allocated."""
    forced = 7
    params = {
        "inf": SamplingParams(temperature=0.8, top_p=0.9, max_tokens=5, ignore_eos=True, logits_processors=[plus_inf(forced)]),
        "inf-greedy": SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logits_processors=[plus_inf(forced)]),
        "seeded": SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True),
        "greedy": SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    }
    prompts = dict(zip(params, PROMPTS))
    alone = run(llama, [prompts["seeded"]], params["seeded"])[0].token_ids
    outs = {}
    with LLMEngine(llama, engine_config=EngineConfig(max_model_len=128)) as engine:
        for request_id, sp in params.items():
            engine.add_request(request_id, prompts[request_id], sp)
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
        assert engine.stats().num_used_blocks == 0
    bad = outs["inf"]
    assert bad.finish_reason == "abort" and bad.token_ids == [], bad
    assert isinstance(bad.error, ValueError) and "+inf" in str(bad.error), bad.error
    assert outs["inf-greedy"].token_ids == [forced] * 5
    assert outs["seeded"].token_ids == alone
    assert outs["greedy"].token_ids == stock_greedy(llama, prompts["greedy"], 5)[0]


@pytest.mark.parametrize("fill", [float("inf"), float("nan")], ids=["+inf", "nan"])
def test_sampler_never_draws_from_undefined_probabilities(fill):
    """Logits with +inf or NaN straight from the model (no processor, the device-only path) fail their
    sampled row instead of yielding the index the NaNs put first; greedy rows keep argmax's answer."""
    vocab = 40
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[[1, 3], 9] = fill
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=5),
              SamplingParams(temperature=0.0)]
    for batch in (params, params[:3]):  # a mixed greedy / sampled batch, and an all-sampled one
        out = sample_tokens(logits[: len(batch)], batch)
        assert list(out.errors) == [1] and isinstance(out.errors[1], ValueError), out.errors
        assert out.token_ids[1] is None and None not in out.token_ids[:1] + out.token_ids[2:]
    assert out.token_ids[0] is not None
    assert sample_tokens(logits, params).token_ids[3] == 9  # argmax: +inf / NaN first, as torch


def test_patched_generate_sampling_with_a_plus_inf_processor_raises(llama):
    """Stock ``generate(do_sample=True)`` raises on the NaN probabilities a +inf logit makes; the patched
    one raised nothing and returned token 0 at every step. It raises too, naming the +inf."""
    from transformers import LogitsProcessor, LogitsProcessorList

    import paged_transformers

    class PlusInf(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return plus_inf(7)(input_ids, scores)

    ids = torch.tensor([PROMPTS[0], PROMPTS[1][: len(PROMPTS[0])]])
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=4,
                  logits_processor=LogitsProcessorList([PlusInf()]))
    with pytest.raises(RuntimeError, match="inf"):
        llama.generate(ids, **kwargs)  # stock
    with paged_transformers.patch(), pytest.raises(ValueError, match=r"\+inf"):
        llama.generate(ids, **kwargs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_nan_logits_mid_decode_fail_the_request_without_a_placeholder(llama, async_scheduling):
    """Logits gone NaN in the model for one sampled row at a decode step (no processor, so the step is
    pipelined under async scheduling): that request fails with the tokens drawn before it, holding no
    placeholder; the other request decodes on; nothing is left allocated."""
    with LLMEngine(llama, engine_config=EngineConfig(max_model_len=128, async_scheduling=async_scheduling)) as engine:
        execute = engine.runner.execute
        calls = []

        def nan_at_fourth_step(plan, input_ids=None):
            logits = execute(plan, input_ids).clone()
            calls.append(len(plan.seqs))
            if len(calls) == 4:
                logits[0] = float("nan")
            return logits

        engine.runner.execute = nan_at_fourth_step
        for i in range(2):
            engine.add_request(str(i), PROMPTS[i], SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True))
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
        assert engine.stats().num_used_blocks == 0
        assert engine.num_pipelined_steps > 0 or not async_scheduling
    bad, good = outs["0"], outs["1"]
    assert bad.finish_reason == "abort" and isinstance(bad.error, ValueError), bad
    assert len(bad.token_ids) == 3 and min(bad.token_ids) >= 0, bad.token_ids
    assert good.finish_reason == "length" and len(good.token_ids) == 8
