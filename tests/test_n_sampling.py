"""n > 1 sampling: the n sequences share the prompt's blocks by reference (fork), copy the partially
filled last block on their first write, and sample independently.

fp32 on CPU, tiny random Llama, torch attention. References: stock ``model.generate()`` for greedy
(n copies of the n = 1 output), the K/V that stock transformers computes for the prompt (its
``DynamicCache``) for the shared blocks, and the same seeded request run again, alone or in another
batch or under memory pressure, for reproducibility.
"""

import itertools

import pytest
import torch

from conftest import assert_pool_whole, check_block_invariants, random_prompts, stock_greedy
from paged_transformers import EngineConfig, LLMEngine, SamplingParams

BLOCK_SIZE = 16
PROMPT = random_prompts(1, 40, 40, seed=21)[0]  # 2 full blocks + 8 tokens in a shared partial block
OTHERS = random_prompts(3, 10, 60, seed=22)
_ids = itertools.count()


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


def engine_for(model, **overrides) -> LLMEngine:
    fields = dict(block_size=BLOCK_SIZE, num_gpu_blocks=64, max_model_len=128, attention_backend="torch")
    fields.update(overrides)
    return LLMEngine(model, engine_config=EngineConfig(**fields))


def run(engine, requests, on_step=None, completions=None) -> list[list[list[int]]]:
    """``requests``: (prompt, SamplingParams) pairs, queued at once. Returns per request its n outputs'
    tokens; fills ``completions`` (a list) with the ``CompletionOutput``s, when given."""
    ids = {f"n{next(_ids)}": i for i in range(len(requests))}
    for request_id, i in ids.items():
        engine.add_request(request_id, *requests[i])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs = sorted(out.outputs, key=lambda c: c.index)
                done[ids[out.request_id]] = [c.token_ids for c in outputs]
                if completions is not None:
                    completions.append(outputs)
        check_block_invariants(engine)
        if on_step is not None:
            on_step(engine)
    return [done[i] for i in range(len(requests))]


def seeded(n=4, seed=7, max_tokens=10, **kw):
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kw)


@torch.inference_mode()
def stock_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Stock transformers' log-probability of each output token given everything before it: ``[len(output)]``."""
    ids = torch.tensor([prompt + output])
    logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return logprobs[len(prompt) - 1 : -1].gather(1, torch.tensor(output)[:, None])[:, 0]


def prompt_kv(engine, table: list[int], num_tokens: int) -> list[torch.Tensor]:
    """Per layer, the cached keys and values of positions ``0 .. num_tokens - 1`` through ``table``:
    ``[2, num_tokens, num_kv_heads, head_dim]``."""
    pos = torch.arange(num_tokens)
    blocks, offsets = torch.tensor(table)[pos // BLOCK_SIZE], pos % BLOCK_SIZE
    return [torch.stack([k[blocks, offsets], v[blocks, offsets]]).clone()
            for k, v in zip(engine.cache.key_cache, engine.cache.value_cache)]


def test_seeded_samples_differ_are_reproducible_and_leave_the_prompt_blocks_unchanged(model):
    P = len(PROMPT)
    with torch.inference_mode():  # reference prompt K/V from stock transformers (post-RoPE, like ours)
        past = model(torch.tensor([PROMPT]), use_cache=True).past_key_values
    stock_kv = [torch.stack([layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)]) for layer in past.layers]

    snapshot, checks, prompt_tables = {}, [0], {}

    def read_back(engine):
        request = next(iter(engine.requests.values()), None)
        if request is None:
            return
        for seq in request.seqs:
            table = engine.cache.block_manager.block_tables.get(seq.seq_id)
            if table is None or seq.num_computed_tokens < P:
                continue
            prompt_tables[seq.index] = list(table[: -(-P // BLOCK_SIZE)])
            kv = prompt_kv(engine, table, P)
            if "kv" not in snapshot:
                snapshot["kv"] = kv
            for got, want in zip(kv, snapshot["kv"]):
                assert torch.equal(got, want), f"sequence {seq.index} sees changed prompt K/V"
            checks[0] += 1

    completions = []
    with engine_for(model) as engine:
        first = run(engine, [(PROMPT, seeded(logprobs=0))], on_step=read_back, completions=completions)[0]
        stats = engine.stats()
        bm = engine.cache.block_manager
        # after the request: the full prompt blocks are still cached and still hold the prompt's K/V
        full = prompt_tables[0][: P // BLOCK_SIZE]
        assert all(bm.block_hash[b] is not None for b in full)
        for got, want in zip(prompt_kv(engine, full, len(full) * BLOCK_SIZE), snapshot["kv"]):
            assert torch.equal(got, want[:, : len(full) * BLOCK_SIZE])
        assert_pool_whole(engine)
    assert checks[0] >= 4 * 5  # all four sequences were read back over several steps
    for got, want in zip(snapshot["kv"], stock_kv):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # all four share the two full prompt blocks; each got its own copy of the partial block
    assert all(t[:2] == prompt_tables[0][:2] for t in prompt_tables.values())
    assert len({t[2] for t in prompt_tables.values()}) == 4
    assert stats.peak_num_shared_blocks == 3  # 2 full + the partial block, before the first write

    assert len({tuple(o) for o in first}) == 4, f"the 4 samples are not all different: {first}"
    # each sample is a correct continuation: its tokens' logprobs match stock transformers on it
    # (a fork writing into a block another fork reads would corrupt the K/V behind them)
    for c in completions[0]:
        got = torch.tensor([lp[t] for lp, t in zip(c.logprobs, c.token_ids)])
        torch.testing.assert_close(got, stock_logprobs(model, PROMPT, c.token_ids), rtol=1e-4, atol=1e-4)
    with engine_for(model) as engine:
        again = run(engine, [(PROMPT, seeded())])[0]
        batched = run(engine, [(OTHERS[0], seeded(n=2, seed=1)), (PROMPT, seeded()), (OTHERS[1], seeded(seed=3))])[1]
    assert again == first and batched == first
    with engine_for(model) as engine:
        assert run(engine, [(PROMPT, seeded(seed=8))])[0] != first


def test_greedy_n4_is_four_copies_of_n1(model):
    want, margins = stock_greedy(model, PROMPT, 10)
    assert min(margins) > 1e-4, "the reference has a near tie; pick another prompt"
    params = SamplingParams(n=4, temperature=0.0, max_tokens=10, ignore_eos=True)
    with engine_for(model) as engine:
        outs = run(engine, [(PROMPT, params), (PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))])
        assert_pool_whole(engine)
    assert outs[0] == [want] * 4 and outs[1] == [want]


def test_n4_holds_less_kv_than_four_independent_requests(model):
    greedy = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    with engine_for(model, enable_prefix_caching=False) as engine:
        run(engine, [(PROMPT, SamplingParams(n=4, **greedy))])
        forked = engine.stats()
    with engine_for(model, enable_prefix_caching=False) as engine:
        run(engine, [(PROMPT, SamplingParams(**greedy))] * 4)
        independent = engine.stats()
    # 49 tokens each: 4 independent sequences hold 4 x 4 blocks; forks share the 2 full prompt blocks
    assert independent.peak_num_used_blocks == 16 and independent.peak_num_shared_blocks == 0
    assert forked.peak_num_used_blocks == 2 + 4 * 2 and forked.peak_num_shared_blocks == 3


def test_forks_survive_preemption_and_immediate_finish(model):
    reqs = [(PROMPT, seeded(max_tokens=24)), (OTHERS[2], seeded(n=3, seed=5, max_tokens=24))]
    with engine_for(model) as engine:
        want = run(engine, reqs)
    # 12 blocks of 16 tokens for 7 sequences of up to 64 tokens: forks are preempted and recomputed
    with engine_for(model, num_gpu_blocks=12, max_model_len=96) as engine:
        got = run(engine, reqs)
        assert engine.stats().num_preemptions > 0
        assert_pool_whole(engine)
    assert got == want
    with engine_for(model) as engine:  # every fork finishes at its first token
        outs = run(engine, [(PROMPT, seeded(max_tokens=1))])[0]
        assert_pool_whole(engine)
    assert [len(o) for o in outs] == [1] * 4


def test_n_over_max_num_seqs_is_rejected(model):
    with engine_for(model, max_num_seqs=2) as engine:
        with pytest.raises(ValueError, match="n=3"):
            engine.add_request("x", PROMPT, SamplingParams(n=3))
        assert not engine.has_unfinished_requests()


def test_forks_hold_their_max_num_seqs_seats_from_admission(model):
    reqs = [(PROMPT, seeded()), (OTHERS[0], seeded(seed=2)), (OTHERS[1], seeded(n=1, seed=4))]
    with engine_for(model) as engine:
        want = run(engine, reqs)
    seats = []

    def count(engine):
        seats.append(sum(1 + len(s.pending_forks) for s in engine.scheduler.running))

    with engine_for(model, max_num_seqs=5) as engine:
        got = run(engine, reqs, on_step=count)
    assert max(seats) == 5 and got == want  # never 4 + 4: the second n = 4 request waited
