"""``SamplingBatch`` on its own: the metadata of hand-built plans against expectations written out by hand."""

import torch

from paged_transformers import SamplingParams
from paged_transformers.core.messages import ForkedSeq, ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from paged_transformers.core.sampling import Sampler
from paged_transformers.core.sampling_batch import SamplingBatch, needs_host_work
from sampler_helpers import Rows


def decode(step_id, *seq_ids, finished=(), forked=()):
    """A plan of one sampled decode token per sequence (token ids unknown: planned ahead)."""
    entries = tuple(ScheduledSeq(s, f"r{s}", 10, 1, (), (), False, True) for s in seq_ids)
    return SchedulerOutput(step_id, entries, forked=forked, finished_seq_ids=finished)


def test_min_tokens_counts_the_plans_in_flight():
    """A row is masked at exactly its first ``min_tokens`` sampled plans, whether or not their tokens were read
    back (two plans prepared before any record: a step planned ahead)."""
    batch = SamplingBatch()
    batch.add(0, "a", SamplingParams(min_tokens=3), None, [1, 2], (2, 5))
    batch.add(1, "b", SamplingParams(), None, [1], ())
    masks = []
    for step in range(1, 6):
        md = batch.prepare(decode(step, 0, 1))
        masks.append((md.min_tokens_rows, md.min_tokens_ids))
        if step >= 2:  # step N's tokens are read after step N + 1 was prepared
            batch.record(ModelRunnerOutput({0: 9, 1: 9}, {}, {}))
    assert masks == [((0, 0), (2, 5))] * 3 + [((), ())] * 2


def test_histories_are_kept_for_host_rows_only_and_finished_sequences_are_forgotten():
    batch = SamplingBatch()
    penalized = SamplingParams(repetition_penalty=1.3)
    assert needs_host_work(penalized) and not needs_host_work(SamplingParams(temperature=0.5, top_k=3))
    batch.add(0, "a", SamplingParams(), None, [4, 5], ())
    batch.add(1, "b", penalized, None, [6], ())
    md = batch.prepare(decode(1, 0, 1))
    assert (md.seq_ids, md.request_ids, md.host_rows) == ((0, 1), ("a", "b"), (1,))
    assert md.token_ids == {1: [6]} and md.num_prompt_tokens == {1: 1}
    batch.record(ModelRunnerOutput({0: 7, 1: 8}, {}, {}))
    batch.record(ModelRunnerOutput({1: 3}, {}, {}))
    assert batch.states[1].token_ids == [6, 8, 3] and batch.states[0].token_ids is None
    md = batch.prepare(decode(2, 1, finished=(0,)))
    assert md.seq_ids == (1,) and md.host_rows == (0,) and md.token_ids == {0: [6, 8, 3]} and set(batch.states) == {1}


def test_forked_rows_follow_the_sampled_rows():
    batch = SamplingBatch()
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=1), SamplingParams()]
    generators = [torch.Generator(), torch.Generator(), None]
    for seq_id, (sp, g) in enumerate(zip(params, generators)):
        batch.add(seq_id, "a" if seq_id < 2 else "b", sp, g, [1], ())
    md = batch.prepare(decode(1, 0, 2, forked=(ForkedSeq(1, "a", 0, ()),)))
    assert md.seq_ids == (0, 2, 1) and md.generators == (generators[0], None, generators[1])
    assert md.params == (params[0], params[2], params[1])


def test_the_sampler_masks_min_tokens_ids():
    """Argmax is EOS (id 2): masked while under min_tokens, the next-best id (3) is taken; then EOS again."""
    logits = torch.tensor([[0.0, 0.1, 5.0, 4.0]])
    rows = Rows([SamplingParams(temperature=0, min_tokens=2)], min_tokens_ids=(2,))
    sampler = Sampler(4)
    assert [rows.sample_tokens(sampler, logits).token_ids[0] for _ in range(3)] == [3, 3, 2]
