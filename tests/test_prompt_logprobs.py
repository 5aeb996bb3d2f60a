"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against stock transformers: for every prompt position ``i >= 1``
the engine's ``{token_id: logprob}`` must hold the prompt token and the top-k of
``torch.log_softmax(model(prompt).logits[0, i - 1])``, the first entry is None, and nothing is appended twice.

fp32 on CPU, tiny random Llama (``conftest.make_tiny_model``), torch attention. Covered: whole and chunked prefill
(prompts over ``max_num_batched_tokens``, mixed in one batch with requests that want none), n > 1, a second request
on a prefix-cache-warm prompt (it takes no hits and still gets every position), preemption by recompute, the
offline ``LLM.generate``, and the refused values.
"""

import pytest
import torch

from conftest import VOCAB_SIZE, assert_pool_whole, check_block_invariants, random_prompts
from paged_transformers import LLM, EngineConfig, LLMEngine, SamplingParams, paged_generate
from paged_transformers.core.execution_plan import LayerPath

TOL = 1e-4  # fp32: the engine's torch attention against stock SDPA
PROMPTS = random_prompts(5, 1, 70, seed=21)  # 1, 18, 36, 53, 70 tokens


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model):
    """prompt tuple -> stock ``log_softmax(logits)`` ``[num_prompt_tokens, vocab_size]`` float32, each prompt alone."""
    with torch.inference_mode():
        return {tuple(p): torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in PROMPTS}


def engine_for(model, **overrides) -> LLMEngine:
    fields = dict(block_size=16, num_gpu_blocks=64, max_model_len=128, attention_backend="torch")
    fields.update(overrides)
    return LLMEngine(model, engine_config=EngineConfig(**fields))


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """The finished ``RequestOutput`` of each prompt, all queued at once, checking the pool after every step."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check_block_invariants(engine)
    return [done[str(i)] for i in range(len(prompts))]


def assert_equals_reference(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """``prompt_logprobs`` is ``[None, {prompt token and top-k of ref[i - 1]} for i >= 1]``, values within ``TOL``."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt), "one entry per prompt token"
    assert prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        row, token = ref[i - 1], prompt[i]
        top = row.topk(k)
        want = {token: row[token].item(), **dict(zip(top.indices.tolist(), top.values.tolist()))}
        got = prompt_logprobs[i]
        assert set(got) == set(want), f"position {i}: tokens {sorted(got)} != {sorted(want)}"
        assert [got[t] for t in want] == pytest.approx(list(want.values()), abs=TOL), f"position {i}"


@pytest.mark.parametrize("max_num_batched_tokens", [128, 16], ids=["whole", "chunked"])
@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_stock_log_softmax(model, reference, max_num_batched_tokens, k):
    """Every prompt wants them; chunked: prompts of up to 70 tokens in chunks of at most 16 (the position at a chunk's
    end scores the next chunk's first token)."""
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k, ignore_eos=True)
    with engine_for(model, max_num_batched_tokens=max_num_batched_tokens) as engine:
        outs = run(engine, PROMPTS, [params] * len(PROMPTS))
        assert_pool_whole(engine)
    for out, prompt in zip(outs, PROMPTS):
        assert_equals_reference(out.prompt_logprobs, prompt, reference[tuple(prompt)], k)
        assert out.outputs[0].logprobs is None and len(out.outputs[0].token_ids) == 3


def test_mixed_batch_keeps_the_other_requests_unchanged(model, reference):
    """Half the requests want prompt logprobs (with output logprobs too), chunked: their rows sit between the others'
    sampled rows; the others get none and the same greedy tokens and logprobs as in a batch where nobody wants any."""
    plain = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    wanting = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    params = [wanting if i % 2 else plain for i in range(len(PROMPTS))]
    with engine_for(model, max_num_batched_tokens=24) as engine:
        outs = run(engine, PROMPTS, params)
        alone = run(engine, PROMPTS, [plain] * len(PROMPTS))
    for i, (out, ref_out, prompt) in enumerate(zip(outs, alone, PROMPTS)):
        assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids, f"prompt {i}"
        for got, want in zip(out.outputs[0].logprobs, ref_out.outputs[0].logprobs):
            assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=TOL)
        if i % 2:
            assert_equals_reference(out.prompt_logprobs, prompt, reference[tuple(prompt)], 2)
        else:
            assert out.prompt_logprobs is None and ref_out.prompt_logprobs is None


def test_n_sequences_share_one_computation(model, reference):
    """n = 3 (sampled): the prompt is computed once, by the first sequence, and the request's outputs carry it."""
    prompt = PROMPTS[3]
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, prompt_logprobs=1)
    with engine_for(model, max_num_batched_tokens=16) as engine:
        (out,) = run(engine, [prompt], [params])
        assert_pool_whole(engine)
    assert len(out.outputs) == 3
    assert_equals_reference(out.prompt_logprobs, prompt, reference[tuple(prompt)], 1)


def test_prefix_cache_warm_prompt_takes_no_hits_but_publishes(model, reference):
    """A prompt cached by an earlier request: a request wanting prompt logprobs computes it whole (no hit) and gets
    every position; the blocks of a prompt first seen by such a request serve a later plain request."""
    cached, fresh = PROMPTS[4], PROMPTS[3]
    plain = SamplingParams(temperature=0, max_tokens=2)
    wanting = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    with engine_for(model, enable_prefix_caching=True) as engine:
        run(engine, [cached], [plain])
        hits = engine.stats().num_cached_tokens
        (warm,) = run(engine, [cached], [wanting])
        assert engine.stats().num_cached_tokens == hits, "a request wanting prompt logprobs took prefix-cache hits"
        run(engine, [fresh], [wanting])
        run(engine, [fresh], [plain])
        assert engine.stats().num_cached_tokens - hits == len(fresh) // 16 * 16, "its blocks were not published"
        assert_pool_whole(engine)
    assert_equals_reference(warm.prompt_logprobs, cached, reference[tuple(cached)], 2)


def test_preemption_recomputes_without_appending_twice(model, engine_spy):
    """A pool too small for the batch preempts sequences, some in the middle of their chunked prompt: each request's
    prompt logprobs still have one entry per prompt token, equal to stock."""
    prompts = random_prompts(12, 40, 90, seed=5)
    with torch.inference_mode():
        refs = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
    config = EngineConfig(block_size=8, num_gpu_blocks=30, max_model_len=128, max_num_batched_tokens=32,
                          attention_backend="torch")
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=1, ignore_eos=True)
    outs = paged_generate(model, prompts, params, engine_config=config, use_tqdm=False)
    (engine,) = engine_spy
    assert sum(seq.num_preemptions for seq in engine.seen_seqs.values()) > 0, "the small pool forced no preemption"
    for out, prompt, ref in zip(outs, prompts, refs):
        assert_equals_reference(out.prompt_logprobs, prompt, ref, 1)
    assert_pool_whole(engine)


def test_preempted_mid_prompt_skips_the_scored_positions(model, reference):
    """A sequence preempted after its first chunk recomputes from position 0; the plans then list only the positions
    not scored yet (none in the recomputed first chunk), and the result equals stock."""
    prompt = PROMPTS[4]  # 70 tokens
    with engine_for(model, max_num_batched_tokens=32) as engine:
        plans = []
        execute = engine.runner.execute
        engine.runner.execute = lambda plan, input_ids=None: plans.append(plan) or execute(plan, input_ids)
        engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
        engine.step()  # positions 0..31 computed; they scored tokens 1..32
        (seq,) = engine.scheduler.running
        assert len(seq.prompt_logprobs) == 33
        engine.scheduler.running.remove(seq)
        engine.scheduler._preempt(seq)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
        assert_pool_whole(engine)
    listed = [(r.first_position, len(r.token_ids)) for plan in plans for r in plan.prompt_logprob_rows]
    assert listed == [(0, 32), (32, 32), (64, 5)], "the recomputed chunk 0..31 must list nothing"
    assert [plan.seqs[0].num_computed_tokens for plan in plans[:4]] == [0, 0, 32, 64]
    assert_equals_reference(done["a"].prompt_logprobs, prompt, reference[tuple(prompt)], 0)


def test_one_token_prompt_and_default_none(model):
    with engine_for(model) as engine:
        one, plain = run(engine, [[5], PROMPTS[1]], [SamplingParams(max_tokens=1, prompt_logprobs=4),
                                                     SamplingParams(max_tokens=1)])
    assert one.prompt_logprobs == [None] and plain.prompt_logprobs is None


def test_offline_llm_generate(model, reference):
    prompt = PROMPTS[2]
    with LLM(model, kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=16) as llm:
        (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5), use_tqdm=False)
    assert_equals_reference(out.prompt_logprobs, prompt, reference[tuple(prompt)], 5)


@pytest.mark.parametrize("value", [-1, True, 1.5, "2"])
def test_bad_values_are_refused_naming_them(value):
    with pytest.raises(ValueError, match=f"prompt_logprobs must be an integer >= 0, got {value!r}"):
        SamplingParams(prompt_logprobs=value)


def test_over_the_vocabulary_is_refused_before_any_state_changes(model):
    with engine_for(model) as engine:
        match = f"prompt_logprobs={VOCAB_SIZE + 1} exceeds the vocabulary size {VOCAB_SIZE}"
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", PROMPTS[1], SamplingParams(prompt_logprobs=VOCAB_SIZE + 1))
        assert not engine.requests and not engine.scheduler.has_unfinished()
        (full,) = run(engine, [PROMPTS[1]], [SamplingParams(max_tokens=1, prompt_logprobs=VOCAB_SIZE)])
        assert_pool_whole(engine)
    assert all(len(entry) == VOCAB_SIZE for entry in full.prompt_logprobs[1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine's CUDA path: fused layers, decode graphs, Triton")
def test_cuda_engine_with_graphs_equals_stock(model):
    """The default engine on CUDA (the fused eager Llama layers, CUDA graphs, Triton attention; fp32 model): chunked prompts wanting
    prompt logprobs mixed with plain decodes give stock's log-softmax at every position (TF32-level tolerance), and
    the plain requests' greedy tokens equal those of a run where nobody wants any."""
    import copy

    gpu = copy.deepcopy(model).cuda()
    with torch.inference_mode():
        ref = {tuple(p): torch.log_softmax(gpu(torch.tensor([p], device="cuda")).logits[0].float(), -1).cpu()
               for p in PROMPTS}  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    wanting = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2, ignore_eos=True)
    config = EngineConfig(block_size=16, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8)
    with LLMEngine(gpu, engine_config=config) as engine:
        plan = engine.execution_plan
        assert plan.cuda_graphs and plan.layers is LayerPath.FUSED, "not the CUDA path of record"
        outs = run(engine, PROMPTS, [wanting if i % 2 else plain for i in range(len(PROMPTS))])
        alone = run(engine, PROMPTS, [plain] * len(PROMPTS))
        assert_pool_whole(engine)
    for i, (out, ref_out, prompt) in enumerate(zip(outs, alone, PROMPTS)):
        assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids, f"prompt {i}"
        if i % 2 == 0:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            row = ref[tuple(prompt)][j - 1]
            assert out.prompt_logprobs[j][prompt[j]] == pytest.approx(row[prompt[j]].item(), abs=2e-2), f"{i}, {j}"
