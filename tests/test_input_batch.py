"""``InputBatch`` on its own: hand-built plans in, the step buffers and persistent block tables checked against
values written out by hand (block size 4, so slot = block id * 4 + position % 4)."""

import pytest
import torch

from paged_transformers.core.input_batch import InputBatch
from paged_transformers.core.messages import ForkedSeq, PromptLogprobRows, ScheduledSeq, SchedulerOutput

BS = 4  # tokens per block


def batch(max_num_tokens=32, max_num_seqs=4, width=6) -> InputBatch:
    return InputBatch(max_num_tokens, max_num_seqs, width, BS, torch.device("cpu"))


def entry(seq_id, start, tokens, blocks, replace=False, samples=True):
    """A ``ScheduledSeq``: ``tokens`` computed from position ``start`` (``tokens`` an int: that many unknown ids)."""
    n = tokens if isinstance(tokens, int) else len(tokens)
    ids = () if isinstance(tokens, int) else tuple(tokens)
    return ScheduledSeq(seq_id, f"r{seq_id}", start, n, ids, tuple(blocks), replace, samples)


def buffers(b: InputBatch, num_tokens: int, num_seqs: int, num_logits: int) -> dict:
    """The device buffers' first rows, as lists."""
    return {
        "input_ids": b.input_ids[:num_tokens].tolist(), "positions": b.positions[:num_tokens].tolist(),
        "slot_mapping": b.slot_mapping[:num_tokens].tolist(), "seq_lens": b.seq_lens[:num_seqs].tolist(),
        "query_start_loc": b.query_start_loc[: num_seqs + 1].tolist(),
        "logits_indices": b.logits_indices[:num_logits].tolist(),
    }


def tables(b: InputBatch) -> dict[int, list[int]]:
    """The persistent block table of each sequence in the batch."""
    return {seq_id: b.tables[row, : int(b.table_lens[row])].tolist() for seq_id, row in b.row_of.items()}


def test_prefill_then_decode_from_the_diffs():
    b = batch()
    # step 1: seq 0's prompt of 6 tokens in blocks (3, 7); seq 1's first chunk of 3 of its prompt, block (2,)
    plan1 = SchedulerOutput(1, (entry(0, 0, [10, 11, 12, 13, 14, 15], [3, 7], replace=True),
                                entry(1, 0, [20, 21, 22], [2], replace=True, samples=False)))
    assert b.prepare(plan1) == (9, 1, 6, 6)
    assert buffers(b, 9, 2, 1) == {
        "input_ids": [10, 11, 12, 13, 14, 15, 20, 21, 22],
        "positions": [0, 1, 2, 3, 4, 5, 0, 1, 2],
        "slot_mapping": [12, 13, 14, 15, 28, 29, 8, 9, 10],
        "seq_lens": [6, 3], "query_start_loc": [0, 6, 9], "logits_indices": [5],  # seq 1 is not sampled yet
    }
    assert b.block_tables[:2, :2].tolist() == [[3, 7], [2, 0]]
    # step 2: seq 0 decodes position 6 (block 7); seq 1 finishes its prompt: positions 3..4, a new block 9
    plan2 = SchedulerOutput(2, (entry(0, 6, [16], []), entry(1, 3, [23, 24], [9])))
    assert b.prepare(plan2) == (3, 2, 2, 7)
    assert buffers(b, 3, 2, 2) == {
        "input_ids": [16, 23, 24], "positions": [6, 3, 4], "slot_mapping": [30, 11, 36],
        "seq_lens": [7, 5], "query_start_loc": [0, 1, 3], "logits_indices": [0, 2],
    }
    assert tables(b) == {0: [3, 7], 1: [2, 9]}
    assert b.block_tables[:2, :2].tolist() == [[3, 7], [2, 9]]


def test_finished_and_preempted_rows_are_reused_and_tables_replaced():
    b = batch(max_num_seqs=2)
    b.prepare(SchedulerOutput(1, (entry(0, 0, [1, 2], [5], replace=True), entry(1, 0, [3], [6], replace=True))))
    row1 = b.row_of[1]
    # seq 0 finished, seq 1 preempted; seq 2 takes a freed row
    plan = SchedulerOutput(2, (entry(2, 0, [4, 5, 6, 7, 8], [1, 4], replace=True),), preempted_seq_ids=(1,),
                           finished_seq_ids=(0,))
    b.prepare(plan)
    assert tables(b) == {2: [1, 4]}
    assert buffers(b, 5, 1, 1)["slot_mapping"] == [4, 5, 6, 7, 16]
    # seq 1 resumes (recompute of its 2 tokens) with a whole new table; the batch holds both rows again
    b.prepare(SchedulerOutput(3, (entry(1, 0, [3, 9], [8], replace=True), entry(2, 5, [9], []))))
    assert tables(b) == {1: [8], 2: [1, 4]} and sorted(b.row_of.values()) == [0, 1]
    assert buffers(b, 3, 2, 2)["slot_mapping"] == [32, 33, 17]
    assert row1 in b.row_of.values()


def test_a_plan_is_applied_once():
    b = batch()
    plan = SchedulerOutput(1, (entry(0, 0, [1, 2, 3, 4, 5], [3, 7], replace=True),))
    b.prepare(plan)
    b.prepare(plan)  # the same plan again (e.g. executed after its diffs were applied): the table is not extended
    assert tables(b) == {0: [3, 7]}
    with pytest.raises(AssertionError):
        b.update(SchedulerOutput(0, ()))  # an older plan


def test_unknown_decode_ids_are_staged_as_zero():
    """A step planned ahead knows no input ids: they are staged as 0, the caller copies the device ids in."""
    b = batch()
    b.prepare(SchedulerOutput(1, (entry(0, 0, [1, 2, 3], [4], replace=True), entry(1, 0, [5], [6], replace=True))))
    assert b.prepare(SchedulerOutput(2, (entry(0, 3, 1, []), entry(1, 1, 1, [])))) == (2, 2, 1, 4)
    assert buffers(b, 2, 2, 2) == {"input_ids": [0, 0], "positions": [3, 1], "slot_mapping": [19, 25],
                                   "seq_lens": [4, 2], "query_start_loc": [0, 1, 2], "logits_indices": [0, 1]}


def test_padded_decode_rows_write_nothing():
    b = batch()
    b.prepare(SchedulerOutput(1, (entry(0, 0, [1, 2], [4], replace=True),)))
    assert b.prepare(SchedulerOutput(2, (entry(0, 2, [7], []),)), pad_to=4) == (4, 4, 1, 3)
    assert buffers(b, 4, 4, 4) == {"input_ids": [7, 0, 0, 0], "positions": [2, 0, 0, 0], "slot_mapping": [18, -1, -1, -1],
                                   "seq_lens": [3, 1, 1, 1], "query_start_loc": [0, 1, 2, 3, 4],
                                   "logits_indices": [0, 1, 2, 3]}


def test_forks_and_prompt_logprob_rows():
    """A fork takes its parent's table and a copy of its parent's logits row, after the sampled rows; the
    prompt-logprob rows (positions 1..3 of seq 0's prompt) follow in ``logits_indices``."""
    b = batch()
    plan = SchedulerOutput(
        1, (entry(0, 0, [1, 2, 3, 4, 5], [3, 7], replace=True), entry(1, 0, [8, 9], [2], replace=True)),
        forked=(ForkedSeq(5, "r0", 0, (3, 7)),), prompt_logprob_rows=(PromptLogprobRows(0, 1, (3, 4, 5)),))
    assert b.prepare(plan) == (7, 2, 5, 5)
    assert buffers(b, 7, 2, 5)["logits_indices"] == [4, 6, 1, 2, 3]
    assert b.fork_rows == [0, 1, 0, 2, 3, 4]  # sampled rows, the parent's row for the fork, the prompt rows
    assert tables(b) == {0: [3, 7], 1: [2], 5: [3, 7]}
