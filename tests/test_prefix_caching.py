"""Prefix caching end to end: greedy tokens are identical with caching on, with caching off, and with
stock ``model.generate()`` (each prompt alone), while cached blocks are really reused.

fp32 on CPU, tiny random Llama (``conftest.make_tiny_model``: initializer_range 0.15), torch attention.
Workloads from issue 6: a 40-token shared prefix (not a multiple of block_size 16) with 5 suffixes,
run cold, then warm, then mixed with unrelated prompts; a prompt of exactly 2 blocks run twice (full
hit, last token recomputed in a copy); and the same under memory pressure, where preemption and
eviction interleave with cache hits. Near ties of the random model are handled as in
``test_engine_equivalence.py``: compare up to the reference's first step with a top-2 margin under
``TIE_TOL``.
"""

import itertools

import pytest
import torch

from conftest import assert_pool_whole, check_block_invariants, random_prompts, stock_greedy
from paged_transformers import EngineConfig, LLMEngine, SamplingParams

BLOCK_SIZE = 16
TIE_TOL = 1e-4
MAX_TOKENS = 12

_g = torch.Generator().manual_seed(6)
PREFIX = torch.randint(3, 128, (40,), generator=_g).tolist()
SUFFIXES = [torch.randint(3, 128, (n,), generator=_g).tolist() for n in (1, 5, 9, 13, 24)]
SHARED = [PREFIX + s for s in SUFFIXES]  # 41..64 tokens; 2 full prefix blocks in common
UNRELATED = random_prompts(4, 7, 50, seed=11)
ALIGNED = torch.randint(3, 128, (2 * BLOCK_SIZE,), generator=_g).tolist()  # exactly 2 blocks
ALL_PROMPTS = SHARED + UNRELATED + [ALIGNED]
_request_ids = itertools.count()


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model):
    """prompt tuple -> (tokens, margins) from stock generate, each prompt alone."""
    return {tuple(p): stock_greedy(model, p, MAX_TOKENS) for p in ALL_PROMPTS}


def engine_for(model, caching: bool, **overrides) -> LLMEngine:
    fields = dict(block_size=BLOCK_SIZE, num_gpu_blocks=64, max_model_len=128, attention_backend="torch",
                  enable_prefix_caching=caching)
    fields.update(overrides)
    return LLMEngine(model, engine_config=EngineConfig(**fields))


def run(engine: LLMEngine, prompts: list[list[int]], check=False) -> list[list[int]]:
    """Greedy completions of ``prompts``, all queued at once; token ids per prompt, in order."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = {f"r{next(_request_ids)}": i for i in range(len(prompts))}
    for request_id, i in ids.items():
        engine.add_request(request_id, prompts[i], params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.outputs[0].token_ids
        if check:
            check_block_invariants(engine)
    return [done[i] for i in range(len(prompts))]


def assert_matches_reference(outputs, prompts, reference):
    for i, (got, p) in enumerate(zip(outputs, prompts)):
        want, margins = reference[tuple(p)]
        tie = next((k for k, m in enumerate(margins) if m < TIE_TOL), len(want))
        assert got[:tie] == want[:tie], f"prompt {i} (len {len(p)}): paged {got} != stock {want}"


def test_shared_prefix_cold_warm_mixed(model, reference):
    mixed = [UNRELATED[0], SHARED[3], UNRELATED[1], SHARED[0], UNRELATED[2], SHARED[4], UNRELATED[3]]
    phases = {"cold": SHARED, "warm": SHARED[::-1], "mixed": mixed}
    results, hits = {}, {}
    for caching in (False, True):
        with engine_for(model, caching) as engine:
            for name, prompts in phases.items():
                before = engine.stats().num_cached_tokens
                results[caching, name] = run(engine, prompts, check=True)
                hits[caching, name] = engine.stats().num_cached_tokens - before
            assert_pool_whole(engine)
    for name, prompts in phases.items():
        assert results[True, name] == results[False, name], name
        assert_matches_reference(results[True, name], prompts, reference)
    assert hits[False, "cold"] == hits[False, "warm"] == hits[False, "mixed"] == 0
    # warm: every shared prompt finds the 2 full prefix blocks (its suffix's full blocks too: they
    # were cached in the cold run)
    assert hits[True, "warm"] >= 5 * 2 * BLOCK_SIZE
    assert hits[True, "mixed"] >= 3 * 2 * BLOCK_SIZE


def test_block_aligned_prompt_full_hit(model, reference):
    results = {}
    for caching in (False, True):
        with engine_for(model, caching) as engine:
            first = run(engine, [ALIGNED])
            stats = engine.stats()
            second = run(engine, [ALIGNED])
            results[caching] = (first, second, engine.stats().num_cached_tokens - stats.num_cached_tokens)
            assert_pool_whole(engine)
    assert results[True][:2] == results[False][:2]
    assert results[True][0] == results[True][1]
    assert_matches_reference(results[True][1], [ALIGNED], reference)
    assert results[True][2] == len(ALIGNED) - 1  # everything but the last token, which is recomputed
    assert results[False][2] == 0


def test_memory_pressure_preemption_and_eviction(model, reference):
    """A pool of 10 blocks (160 tokens) for 9 prompts of up to 76 tokens: sequences are preempted,
    resume from their cached blocks or after those were evicted, and still give the same tokens."""
    prompts = SHARED + UNRELATED
    results, stats = {}, {}
    for caching in (False, True):
        with engine_for(model, caching, num_gpu_blocks=10, max_model_len=96) as engine:
            results[caching] = run(engine, prompts, check=True) + run(engine, SHARED[:3], check=True)
            stats[caching] = engine.stats()
            bm = engine.cache.block_manager
            # free + cached-evictable == total: every cached block is free to evict
            assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
            assert_pool_whole(engine)
    assert stats[True].num_preemptions > 0 and stats[True].num_evicted_blocks > 0 and stats[True].num_cached_tokens > 0
    assert results[True] == results[False]
    assert_matches_reference(results[True], prompts + SHARED[:3], reference)


def test_reset_prefix_cache(model):
    with engine_for(model, True) as engine:
        run(engine, [SHARED[0]])
        # full blocks of the computed tokens, output included (the last sampled token is never computed)
        assert engine.stats().num_cached_blocks == (len(SHARED[0]) + MAX_TOKENS - 1) // BLOCK_SIZE == 3
        engine.add_request("busy", UNRELATED[0], SamplingParams(max_tokens=4))
        engine.step()
        assert engine.reset_prefix_cache() is False  # a request holds blocks
        engine.abort_request("busy")
        assert engine.reset_prefix_cache() is True
        assert engine.stats().num_cached_blocks == 0
        before = engine.stats().num_cached_tokens
        run(engine, [SHARED[1]])
        assert engine.stats().num_cached_tokens == before  # nothing left to hit


def test_stats_hit_rate(model):
    with engine_for(model, True) as engine:
        run(engine, [SHARED[0]])
        run(engine, [SHARED[1]])
        stats = engine.stats()
    assert stats.num_requests == 2
    assert stats.num_prompt_tokens == len(SHARED[0]) + len(SHARED[1])
    assert stats.num_cached_tokens == 2 * BLOCK_SIZE
    assert stats.prefix_cache_hit_rate == pytest.approx(32 / (len(SHARED[0]) + len(SHARED[1])))
    assert stats.peak_num_shared_blocks == 0  # the second request ran after the first had finished


def test_prefix_caching_is_on_by_default():
    assert EngineConfig().enable_prefix_caching is True
