"""The iteration-level scheduler on its own (no model): token budget, max_num_seqs, chunked prefill,
preemption by recompute, and the pool after each step.

Each step is simulated: ``schedule()``, then ``update_from_output`` with a made-up token for every
sequence that catches up (a ``ModelRunnerOutput``), and a sequence ends after ``max_tokens`` outputs (as
the output processor ends it: ``Scheduler.finish``). The expected
plans are written out by hand from the rules in the scheduler's module docstring (vLLM V1's).
"""

import random

import pytest
import torch

from paged_transformers.core.batch_defaults import DeviceDescription, resolve_batch_limits
from paged_transformers.core.block_manager import BlockManager
from paged_transformers.config import EngineConfig
from paged_transformers.core.messages import ModelRunnerOutput
from paged_transformers.sampling_params import SamplingParams
from paged_transformers.core.scheduler import Scheduler
from paged_transformers.core.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks: int, block_size: int = 4, **config) -> Scheduler:
    """A scheduler on the limits the engine would run it with on CPU (step limits left None resolved as
    ``LLMEngine`` resolves them: ``batch_defaults.resolve_batch_limits``)."""
    config.setdefault("enable_prefix_caching", False)
    resolved = resolve_batch_limits(EngineConfig(block_size=block_size, **config),
                                    DeviceDescription.of(torch.device("cpu")), 4096)
    return Scheduler(resolved, BlockManager(num_blocks, block_size), max_model_len=4096)


def add(scheduler: Scheduler, prompt_len: int, max_tokens: int, name: str = "r") -> Sequence:
    seq = Sequence(name, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler):
    """One simulated step; returns the plan as ``[(request_id, num_tokens, samples)]`` and the plan."""
    out = scheduler.schedule()
    plan = [(seq.request_id, n, seq.samples) for seq, n in zip(out.seqs, out.num_scheduled_tokens)]
    sampled = {seq_id: 7 for seq_id in out.sampled_seq_ids}
    for seq in scheduler.update_from_output(out, ModelRunnerOutput(sampled, {}, {})):
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:
            scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
    return plan, out


def check_pool(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    live = list(scheduler.running) + list(scheduler.waiting)
    held = [b for seq in live for b in bm.block_tables.get(seq.seq_id, [])]
    assert len(held) == len(set(held)) == bm.num_used_blocks
    for seq in scheduler.running:
        assert len(bm.block_tables[seq.seq_id]) == bm.blocks_for(seq.num_computed_tokens)
    for seq in scheduler.waiting:
        assert seq.seq_id not in bm.block_tables


def test_running_first_then_waiting_in_arrival_order_within_budget():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=10)
    add(s, 6, 3, "a")
    add(s, 3, 3, "b")
    add(s, 5, 3, "c")
    assert step(s)[0] == [("a", 6, True), ("b", 3, True), ("c", 1, False)]  # c gets the 1 token left
    assert step(s)[0] == [("a", 1, True), ("b", 1, True), ("c", 4, True)]  # decodes first, then c's rest
    add(s, 2, 1, "d")
    assert step(s)[0] == [("a", 1, True), ("b", 1, True), ("c", 1, True), ("d", 2, True)]


def test_chunked_prefill_splits_and_samples_only_the_last_chunk():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=8)
    add(s, 20, 2, "a")
    add(s, 3, 2, "b")
    plans = [step(s)[0] for _ in range(5)]
    assert plans == [
        [("a", 8, False)],
        [("a", 8, False)],
        [("a", 4, True), ("b", 3, True)],  # the last chunk of a, then b joins with the budget left
        [("a", 1, True), ("b", 1, True)],
        [],
    ]
    assert not s.has_unfinished()
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_budget_split_mid_prompt_when_chunking():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=10)
    add(s, 6, 1, "a")
    add(s, 7, 1, "b")
    assert step(s)[0] == [("a", 6, True), ("b", 4, False)]
    assert step(s)[0] == [("b", 3, True)]


def test_no_chunking_waits_for_a_step_with_room():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=10, enable_chunked_prefill=False)
    add(s, 6, 2, "a")
    add(s, 7, 2, "b")
    assert step(s)[0] == [("a", 6, True)]  # b (7) does not fit the 4 left and may not be split
    assert step(s)[0] == [("a", 1, True), ("b", 7, True)]


def test_max_num_seqs():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=100, max_num_seqs=2)
    for name in "abc":
        add(s, 3, 2, name)
    assert [r for r, _, _ in step(s)[0]] == ["a", "b"]
    assert [r for r, _, _ in step(s)[0]] == ["a", "b"]  # both finish here (2 tokens)
    assert [r for r, _, _ in step(s)[0]] == ["c"]


def test_preempts_the_most_recent_and_resumes_by_recompute():
    # 6 blocks of 4 tokens. a: 8-token prompt (2 blocks), b: 8 (2 blocks), c: 8 (2 blocks) -> pool full.
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    a, b, c = add(s, 8, 3, "a"), add(s, 8, 3, "b"), add(s, 8, 3, "c")
    assert step(s)[0] == [("a", 8, True), ("b", 8, True), ("c", 8, True)]
    assert s.block_manager.num_free_blocks == 0
    # Each now has 9 tokens and needs a third block: a preempts c (the most recent), b takes c's blocks.
    plan, out = step(s)
    assert plan == [("a", 1, True), ("b", 1, True)]
    assert out.preempted_seq_ids == (c.seq_id,) and c.num_preemptions == 1 and c.num_computed_tokens == 0
    assert list(s.waiting) == [c] and c.seq_id not in s.block_manager.block_tables
    assert c.output_token_ids == [7]  # its sampled token is kept: the recompute covers prompt + outputs
    check_pool(s)
    # a and b finish at their 3rd token and free their blocks; c then recomputes all 9 tokens at once.
    assert step(s)[0] == [("a", 1, True), ("b", 1, True)]
    assert a.is_finished and b.is_finished and s.block_manager.num_free_blocks == 6
    assert step(s)[0] == [("c", 9, True)]
    assert step(s)[0] == [("c", 1, True)]
    assert c.is_finished and c.output_token_ids == [7, 7, 7]
    assert s.block_manager.num_free_blocks == 6


def test_finish_frees_blocks_at_once():
    s = make_scheduler(num_blocks=16)
    seq = add(s, 10, 5)
    step(s)
    assert s.block_manager.num_used_blocks == 3
    s.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert s.block_manager.num_free_blocks == 16 and not s.has_unfinished()


@pytest.mark.parametrize("seed", range(10))
def test_random_workload_invariants(seed):
    """Random prompts, outputs, arrivals and limits: every step keeps the budget, max_num_seqs and the
    block invariants; every request finishes with exactly max_tokens outputs; the pool ends whole."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    max_len = 64
    needed = -(-max_len // block_size)  # one max-length sequence must fit
    num_blocks = rng.randint(needed, needed + needed // 2)
    # Odd seeds turn chunked prefill off: prompts then fit the budget, but a preempted sequence's
    # recompute (prompt + outputs) may not, and must still resume.
    chunked = seed % 2 == 0
    config = dict(max_num_batched_tokens=rng.choice([5, 16, 64] if chunked else [16, 32]),
                  max_num_seqs=rng.choice([4, 8]), enable_chunked_prefill=chunked)
    s = make_scheduler(num_blocks, block_size, **config)
    pending = []
    for i in range(20):
        prompt_len = rng.randint(1, 48 if chunked else config["max_num_batched_tokens"])
        pending.append((rng.randint(0, 10), prompt_len, rng.randint(1, max_len - prompt_len), str(i)))
    seqs = []
    preemptions = 0
    for t in range(5000):
        for arrival in [p for p in pending if p[0] <= t]:
            pending.remove(arrival)
            seqs.append(add(s, arrival[1], arrival[2], arrival[3]))
        if not pending and not s.has_unfinished():
            break
        plan, out = step(s)
        preemptions += len(out.preempted_seq_ids)
        assert sum(n for _, n, _ in plan) <= config["max_num_batched_tokens"]
        assert len(s.running) <= config["max_num_seqs"]
        assert len({r for r, _, _ in plan}) == len(plan)
        check_pool(s)
    else:
        pytest.fail("the workload did not finish: the scheduler stalled")
    assert all(seq.is_finished and seq.num_output_tokens == seq.sampling_params.max_tokens for seq in seqs)
    assert preemptions > 0, "the workload should be tight enough to preempt"
    assert s.block_manager.num_free_blocks == num_blocks


def test_plans_advance_at_schedule_time_and_schedule_ahead_counts_placeholders():
    """A plan advances num_computed_tokens and counts each sampled token as a placeholder; the next plan can be
    made before the tokens are known (one decode token per sequence, ids unknown, only new blocks in the
    entries); a sequence that stops by length with the token being sampled sits that plan out, and when every
    sequence does there is none; update_from_output fills the placeholders."""
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    a, b = add(s, 4, 4, "a"), add(s, 6, 2, "b")
    first = s.schedule()
    assert [(e.num_computed_tokens, e.num_scheduled_tokens, e.samples, e.replace_table) for e in first.seqs] == [
        (0, 4, True, True), (0, 6, True, True)]
    assert [len(e.new_block_ids) for e in first.seqs] == [1, 2] and first.sampled_seq_ids == [a.seq_id, b.seq_id]
    assert (a.num_computed_tokens, a.num_output_placeholders, b.num_computed_tokens) == (4, 1, 6)
    ahead = s.schedule_ahead()
    assert [(e.num_computed_tokens, e.num_scheduled_tokens, e.token_ids) for e in ahead.seqs] == [(4, 1, ()), (6, 1, ())]
    # a's position 4 opens a second block, b's position 6 lands in the block it holds
    assert [(len(e.new_block_ids), e.replace_table) for e in ahead.seqs] == [(1, False), (0, False)]
    assert s.block_manager.block_tables[a.seq_id][1:] == list(ahead.seqs[0].new_block_ids)
    assert (a.num_output_placeholders, b.num_output_placeholders) == (2, 2)
    assert s.update_from_output(first, ModelRunnerOutput({a.seq_id: 7, b.seq_id: 8}, {}, {})) == [a, b]
    assert (a.output_token_ids, b.output_token_ids, a.num_output_placeholders) == ([7], [8], 1)
    # the engine launches the next plan before it reads `ahead`, whose token is b's 2nd and last (max_tokens=2)
    ahead2 = s.schedule_ahead()
    assert [(e.seq_id, e.num_computed_tokens, e.num_scheduled_tokens) for e in ahead2.seqs] == [(a.seq_id, 5, 1)]
    assert (a.num_output_placeholders, b.num_output_placeholders, b.num_computed_tokens) == (2, 1, 7)
    s.update_from_output(ahead, ModelRunnerOutput({a.seq_id: 9}, {}, {b.seq_id: ValueError("row failed")}))
    assert a.output_token_ids == [7, 9] and b.status == SequenceStatus.FINISHED_ABORTED and str(b.error) == "row failed"
    ahead3 = s.schedule_ahead()
    assert ahead3.finished_seq_ids == (b.seq_id,)  # the runner hears of it with the next plan
    assert [(e.seq_id, e.num_computed_tokens) for e in ahead3.seqs] == [(a.seq_id, 6)]
    s.update_from_output(ahead2, ModelRunnerOutput({a.seq_id: 11}, {}, {}))
    assert s.schedule_ahead() is None  # ahead3 samples a's 4th and last token (max_tokens=4): every sequence stops
