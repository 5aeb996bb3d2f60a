"""Greedy outputs of the paged engine are token-identical to stock ``model.generate()``.

Reference: transformers' own ``generate()`` (do_sample=False, fp32, CPU) on the same weights, each
prompt alone. Workload: 16 prompts of lengths 1..300 with max_tokens 4..20 on tiny random Llama,
Qwen2, Mistral (sliding window 48 < prompt lengths), Gemma-2 (soft-capping, alternating sliding
window), Phi-3 and StableLM (whose layers drop keyword arguments); then the same batch with requests
arriving while others decode, with chunked prefill forced by a small token budget, and with
preemption forced by a small pool.

Near ties: a random model can put two logits within float noise of each other, and then either
token is a correct greedy choice (see shared/fixtures/README.md, section 5). ``assert_same_greedy``
compares each output with the reference up to the first step whose reference top-2 margin is under
``TIE_TOL`` and requires that such cut-offs skip at most a few tokens, so the comparison stays strict.
"""

import pytest

from conftest import MAX_POSITIONS, TINY_ARCHS, assert_pool_whole, check_block_invariants, random_prompts, stock_greedy
from paged_transformers import EngineConfig, LLMEngine, SamplingParams, paged_generate

NUM_PROMPTS = 16
PROMPTS = random_prompts(NUM_PROMPTS, 1, 300, seed=0)
MAX_TOKENS = [4 + (i * 7) % 17 for i in range(NUM_PROMPTS)]  # 4..20, not sorted like the prompt lengths
TIE_TOL = 1e-4  # logits; fp32 paged vs. SDPA/eager attention differ by ~1e-6 here


@pytest.fixture(scope="module")
def reference():
    """``reference(model)`` -> per prompt ``(tokens, margins)`` from stock generate, computed once per model."""
    cache = {}

    def get(model):
        if id(model) not in cache:
            cache[id(model)] = [stock_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
        return cache[id(model)]

    return get


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]


def assert_same_greedy(outputs: list[list[int]], refs: list[tuple[list[int], list[float]]]) -> None:
    """Each output equals its reference, up to the reference's first near tie (see the module docstring)."""
    assert len(outputs) == len(refs)
    skipped = total = 0
    for i, (got, (want, margins)) in enumerate(zip(outputs, refs)):
        tie = next((k for k, m in enumerate(margins) if m < TIE_TOL), len(want))
        total += len(want)
        skipped += len(want) - tie
        if tie == len(want):
            assert got == want, f"prompt {i} (len {len(PROMPTS[i])}): paged {got} != stock {want}"
        else:
            assert got[:tie] == want[:tie], f"prompt {i}: paged {got} != stock {want} before the near tie at step {tie}"
    assert skipped <= total // 10, f"near ties cut {skipped} of {total} tokens from the comparison"


def finished_tokens(outs) -> list[list[int]]:
    assert all(o.finished for o in outs)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_greedy_matches_stock_generate(arch, tiny_model, reference, engine_spy):
    model = tiny_model(arch)
    outs = paged_generate(model, PROMPTS, greedy_params(), use_tqdm=False)
    assert [o.request_id for o in outs] == [str(i) for i in range(NUM_PROMPTS)]
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert_same_greedy(finished_tokens(outs), reference(model))
    (engine,) = engine_spy
    assert_pool_whole(engine)
    assert model.config._attn_implementation != "paged_transformers", "the model's attention was not restored"


@pytest.mark.parametrize(
    "arch, override",
    [("mistral", {"sliding_window": None}), ("gemma2", {"attn_logit_softcapping": None}),
     ("gemma2", {"layer_types": ["full_attention"] * 2})],
    ids=["mistral-window", "gemma2-softcap", "gemma2-window"],
)
def test_workload_exercises_the_feature(arch, override, tiny_model, reference):
    """Control: with the sliding window or soft-capping removed, stock generate gives other tokens for
    most prompts, so the equivalence test above would catch a backend that ignored them."""
    with_feature = [tokens for tokens, _ in reference(tiny_model(arch))]
    without = [tokens for tokens, _ in reference(tiny_model(arch, **override))]
    assert sum(a != b for a, b in zip(with_feature, without)) >= NUM_PROMPTS // 2


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_requests_arrive_while_others_decode(arch, tiny_model, reference):
    """LLMEngine API: four requests start; each later one is added between steps while others decode."""
    model = tiny_model(arch)
    params = greedy_params()
    results: dict[str, list[int]] = {}
    added_while_decoding = 0
    with LLMEngine(model) as engine:
        pending = list(range(NUM_PROMPTS))
        for i in pending[:4]:
            engine.add_request(str(i), PROMPTS[i], params[i])
        pending = pending[4:]
        steps = 0
        while engine.has_unfinished_requests() or pending:
            if pending and steps % 3 == 2:
                decoding = [s for s in engine.scheduler.running if s.num_output_tokens > 0]
                added_while_decoding += bool(decoding)
                i = pending.pop(0)
                engine.add_request(str(i), PROMPTS[i], params[i])
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.outputs[0].token_ids
            check_block_invariants(engine)
            steps += 1
        assert_pool_whole(engine)
    assert added_while_decoding >= NUM_PROMPTS // 2
    assert_same_greedy([results[str(i)] for i in range(NUM_PROMPTS)], reference(model))


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_chunked_prefill_small_token_budget(arch, tiny_model, reference, engine_spy):
    """A 40-token budget splits every prompt over 41 tokens into chunks (and chunks cross the window)."""
    model = tiny_model(arch)
    config = EngineConfig(max_num_batched_tokens=40, max_num_seqs=8)
    outs = paged_generate(model, PROMPTS, greedy_params(), engine_config=config, use_tqdm=False)
    assert_same_greedy(finished_tokens(outs), reference(model))
    (engine,) = engine_spy
    assert engine.chunked, "no prompt was prefilled in chunks"
    assert_pool_whole(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_preemption_small_pool(arch, tiny_model, reference, engine_spy):
    """A pool of 22 blocks (352 tokens) for 16 requests forces preemption by recompute; results stay identical."""
    model = tiny_model(arch)
    config = EngineConfig(block_size=16, num_gpu_blocks=22, max_model_len=336, max_num_batched_tokens=128)
    outs = paged_generate(model, PROMPTS, greedy_params(), engine_config=config, use_tqdm=False)
    (engine,) = engine_spy
    preemptions = sum(seq.num_preemptions for seq in engine.seen_seqs.values())
    assert preemptions > 0, "the small pool forced no preemption"
    assert_same_greedy(finished_tokens(outs), reference(model))
    assert_pool_whole(engine)


def test_block_size_not_dividing_lengths(tiny_model, reference, engine_spy):
    """An odd block size (5): slots cross block boundaries at every offset."""
    model = tiny_model("phi3")
    config = EngineConfig(block_size=5, max_num_batched_tokens=64)
    outs = paged_generate(model, PROMPTS, greedy_params(), engine_config=config, use_tqdm=False)
    assert_same_greedy(finished_tokens(outs), reference(model))
    assert_pool_whole(engine_spy[0])
    assert MAX_POSITIONS >= max(map(len, PROMPTS)) + max(MAX_TOKENS)


def test_preemption_without_chunked_prefill(tiny_model, engine_spy):
    """Chunked prefill off: prompts fit the 64-token budget, but a preempted sequence's recompute
    (prompt + outputs) does not; it must still resume (it used to wait forever) with identical tokens."""
    model = tiny_model("llama")
    prompts = random_prompts(4, 60, 64, seed=4)
    config = EngineConfig(block_size=4, num_gpu_blocks=36, max_model_len=100, max_num_batched_tokens=64,
                          enable_chunked_prefill=False)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    outs = paged_generate(model, prompts, params, engine_config=config, use_tqdm=False)
    (engine,) = engine_spy
    assert sum(seq.num_preemptions for seq in engine.seen_seqs.values()) > 0
    refs = [stock_greedy(model, p, 20) for p in prompts]
    assert_same_greedy(finished_tokens(outs), refs)
    assert_pool_whole(engine)
