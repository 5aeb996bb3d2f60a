"""Tensor parallelism on CPU (gloo, 2 and 4 processes): greedy tokens equal stock ``generate()`` and the one-process
engine with chunked prefill, preemption, prefix caching and n > 1; logits processors see the same histories; aborts
and bad requests leave every rank's batch and pool whole; bad configurations are refused before a worker starts;
no process outlives its engine.

Each engine is started once per module (``tp_llm``): its worker processes are spawned, which dominates the time.
"""

import multiprocessing
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import assert_pool_whole, make_tiny_model, random_prompts, stock_greedy
from paged_transformers import LLM, PerRequest, SamplingParams, paged_generate

# 5 prompts of up to 50 tokens in 24 blocks of 8 tokens: preemption; prompts over 32 tokens: chunked prefill
ENGINE = dict(skip_tokenizer_init=True, max_model_len=128, max_num_batched_tokens=32, block_size=8, num_gpu_blocks=24)
GREEDY = SamplingParams(temperature=0, max_tokens=10)
PROMPTS = random_prompts(5, 3, 40, seed=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(arch, **overrides) -> (model, folder)``: a tiny model and its checkpoint folder, once per module."""
    cache = {}

    def get(arch, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            model = make_tiny_model(arch, **overrides)
            folder = tmp_path_factory.mktemp(arch)
            model.save_pretrained(folder)
            cache[key] = model, str(folder)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def tp_llm(saved):
    """``tp_llm(arch, tp, **engine_kwargs)``: an ``LLM`` over the saved tiny model, kept while the following tests
    ask for the same arguments (one tensor-parallel engine per process at a time: the tests are ordered so)."""
    current = {}

    def get(arch, tp, **kwargs):
        key = (arch, tp, repr(sorted(kwargs.items())))
        if key not in current:
            for llm in current.values():
                llm.close()
            current.clear()
            current[key] = LLM(saved(arch)[1], tensor_parallel_size=tp, **{**ENGINE, **kwargs})
        return current[key]

    yield get
    for llm in current.values():
        llm.close()


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_ranks_agree(llm) -> None:
    """Rank 0's pool is whole and every rank's persistent batch holds the same block tables as rank 0's."""
    engine = llm.llm_engine
    assert_pool_whole(engine)
    tables = engine.worker_tables()
    assert all(t == tables[0] for t in tables), tables


def test_preemption_prefix_caching_and_n(tp_llm, saved):
    model = saved("llama")[0]
    llm = tp_llm("llama", 2)
    shared = [PROMPTS[-1][:24] + p for p in PROMPTS[:3]]  # a 3-block common prefix
    want = [stock_greedy(model, p, GREEDY.max_tokens)[0] for p in PROMPTS + shared]
    assert tokens(llm.generate(PROMPTS + shared, GREEDY, use_tqdm=False)) == want
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0, stats
    outs = llm.generate(shared, SamplingParams(temperature=0, max_tokens=10, n=2), use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == [[w, w] for w in want[len(PROMPTS):]]
    assert_ranks_agree(llm)


class Recorder:
    """A per-request processor recording each call's history; bans the last token (so it changes the output)."""

    def __init__(self):
        self.histories = []

    def __call__(self, input_ids, scores):
        self.histories.append(input_ids.tolist())
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), input_ids[:, -1]] = float("-inf")
        return scores


def recorded(generate, prompts):
    instances = []

    def make():
        instances.append(Recorder())
        return instances[-1]

    params = SamplingParams(temperature=0, max_tokens=6, logits_processors=[PerRequest(make)])
    outs = generate(prompts, params)
    return tokens(outs), sorted(h for r in instances for h in r.histories)


def test_logits_processor_sees_tp1_histories(tp_llm, saved):
    model = saved("llama")[0]
    want = recorded(lambda p, sp: paged_generate(model, p, sp, use_tqdm=False), PROMPTS)
    got = recorded(lambda p, sp: tp_llm("llama", 2).generate(p, sp, use_tqdm=False), PROMPTS)
    assert got == want and len(got[1]) == 6 * len(PROMPTS)


def test_abort_and_bad_request_leave_every_rank_whole(tp_llm, saved):
    llm = tp_llm("llama", 2)
    with llm.llm_engine.for_call() as engine:
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, GREEDY)
        engine.step()
        engine.step()
        engine.abort_request("1")
        with pytest.raises(ValueError):
            engine.add_request("bad", [1, 10_000], GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
    with llm.llm_engine.for_call() as engine:  # a call that fails midway: its requests are aborted on exit
        engine.add_request("x", PROMPTS[0], GREEDY)
        engine.step()
    llm.llm_engine.reset_prefix_cache()
    assert_ranks_agree(llm)
    model = saved("llama")[0]
    assert tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == [stock_greedy(model, p, 10)[0] for p in PROMPTS[:2]]


def test_sleep_wake_up_every_rank(tp_llm, saved):
    llm = tp_llm("llama", 2)
    llm.sleep()
    assert llm.llm_engine.stats().num_blocks == 0
    llm.wake_up()
    model = saved("llama")[0]
    assert tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == [stock_greedy(model, p, 10)[0] for p in PROMPTS[:2]]


@pytest.mark.parametrize("arch,tp", [("llama", 2), ("qwen2", 2), ("llama", 4)])
def test_greedy_equals_stock(tp_llm, saved, arch, tp):
    """Chunked prefill (prompts up to 40 tokens, 32-token budget); llama at tp=4 replicates its 2 KV heads."""
    model = saved(arch)[0]
    want = [stock_greedy(model, p, GREEDY.max_tokens)[0] for p in PROMPTS]
    llm = tp_llm(arch, tp)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert tokens(paged_generate(model, PROMPTS, GREEDY, use_tqdm=False)) == want  # tp=1
    assert_ranks_agree(llm)
