"""The messages of one step, which flows one way::

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute (+ SamplingBatch, Sampler) -> ModelRunnerOutput
        -> Scheduler.update_from_output -> OutputProcessor (stops, RequestOutputs)

Both messages are plain, frozen data keyed by sequence id (a request has ``n`` sequences): neither the runner
nor the sampler reads the scheduler's ``Sequence`` objects or the block manager, and nothing in a message changes
after it is made. The plan carries each sequence's NEW block ids only; the runner keeps every running
sequence's block table in its persistent batch (``input_batch.InputBatch``) and applies these diffs
(vLLM V1's ``SchedulerOutput`` / ``NewRequestData`` / ``CachedRequestData`` and ``ModelRunnerOutput``).
``StepTrace`` is the runner's record of an executed step, for the bench.
"""

from dataclasses import dataclass, field

import torch

from .block_manager import BlockCopy


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's work in a step: tokens ``num_computed_tokens .. + num_scheduled_tokens - 1``.

    Attributes:
        seq_id, request_id: the sequence and its request.
        num_computed_tokens: tokens already in the KV cache before this step (the first scheduled position).
        num_scheduled_tokens: tokens the step computes for it (>= 1).
        token_ids: the ids of the scheduled tokens that are known on the host; shorter than
            ``num_scheduled_tokens`` only in a step scheduled ahead of the previous step's sampling (async
            scheduling), where the missing ids are that step's sampled tokens on the device.
        new_block_ids: block ids appended to its block table by this step; with ``replace_table``, the
            whole table (a sequence new to the batch, resumed after preemption, or after a copy-on-write).
        replace_table: see ``new_block_ids``.
        samples: its last row is sampled (the step catches it up with its tokens).
    """

    seq_id: int
    request_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    token_ids: tuple[int, ...]
    new_block_ids: tuple[int, ...]
    replace_table: bool
    samples: bool


@dataclass(frozen=True, slots=True)
class ForkedSeq:
    """An n > 1 sequence that joins the batch sharing its parent's blocks (by reference, copy-on-write):
    it computes nothing this step and samples its first token from a copy of its parent's logits row.

    Attributes:
        seq_id, request_id: the sequence and its request.
        parent_seq_id: the sequence whose prompt it shares (sampled in the same step).
        block_ids: its whole block table (the parent's, at the fork).
    """

    seq_id: int
    request_id: str
    parent_seq_id: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PromptLogprobRows:
    """The rows of one sequence's prompt chunk whose logits score its next prompt tokens
    (``SamplingParams.prompt_logprobs``): the logits at position ``p`` score prompt token ``p + 1``.

    Attributes:
        seq_id: the sequence (an entry of the plan's ``seqs``).
        first_position: the first of the positions, in tokens of the sequence (``>= num_computed_tokens`` of its
            entry); the positions run on, one per token of ``token_ids``.
        token_ids: the prompt tokens scored, ``prompt[first_position + 1 : first_position + 1 + len(token_ids)]``.
    """

    seq_id: int
    first_position: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan (``Scheduler.schedule``); the runner turns it into tensors.

    Attributes:
        step_id: increases by one per plan (the runner applies each plan's diffs once).
        seqs: the scheduled sequences, in batch order.
        forked: n > 1 sequences forked in this step (``ForkedSeq``); their logits rows come after the
            sampled rows of ``seqs``, in this order.
        block_copies: copy-on-write copies to make before the forward.
        preempted_seq_ids: sequences preempted while planning (their blocks are freed).
        finished_seq_ids: sequences that finished since the previous plan (their blocks are freed).
        prompt_logprob_rows: the rows kept for prompt logprobs (``PromptLogprobRows``); their logits rows come
            after the sampled and forked rows, in this order. Empty unless a request asked for them.
    """

    step_id: int
    seqs: tuple[ScheduledSeq, ...]
    forked: tuple[ForkedSeq, ...] = ()
    block_copies: tuple[BlockCopy, ...] = ()
    preempted_seq_ids: tuple[int, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()
    prompt_logprob_rows: tuple[PromptLogprobRows, ...] = ()

    @property
    def num_scheduled_tokens(self) -> tuple[int, ...]:
        """Per entry of ``seqs``, the tokens it computes."""
        return tuple(s.num_scheduled_tokens for s in self.seqs)

    @property
    def sample_mask(self) -> tuple[bool, ...]:
        """Per entry of ``seqs``, whether its last row is sampled."""
        return tuple(s.samples for s in self.seqs)

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens in the step; <= max_num_batched_tokens."""
        return sum(s.num_scheduled_tokens for s in self.seqs)

    @property
    def num_prompt_logprob_rows(self) -> int:
        """Logits rows kept for prompt logprobs: ``sum(len(r.token_ids) for r in prompt_logprob_rows)``."""
        return sum(len(r.token_ids) for r in self.prompt_logprob_rows)

    @property
    def sampled_seq_ids(self) -> list[int]:
        """The sequences of the logits rows, in row order: the sampled entries of ``seqs``, then ``forked``."""
        return [s.seq_id for s in self.seqs if s.samples] + [f.seq_id for f in self.forked]


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """What one step produced, keyed by sequence id: the only input of ``Scheduler.update_from_output``.

    Attributes:
        sampled_token_ids: seq_id -> its sampled token, for each row that sampled.
        logprobs: seq_id -> (logprob of the sampled token, {token_id: logprob} of it and the top-k), for
            the rows that asked for logprobs.
        errors: seq_id -> the exception that failed its row (a logits processor's, an undrawable row).
        prompt_logprobs: seq_id -> ``{token_id: logprob}`` of each prompt token its ``PromptLogprobRows`` scored (the
            token and the top-k), in order.
    """

    sampled_token_ids: dict[int, int]
    logprobs: dict[int, tuple[float, dict[int, float]]]
    errors: dict[int, BaseException]
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)


@dataclass(slots=True)
class StepTrace:
    """One executed step, recorded when ``ModelRunner.record_steps`` is set (for the bench).

    ``start``/``end`` are CUDA events around the step's device work (metadata copies to logits); on CPU
    they are None and the host times stand in.
    """

    kind: str  # "graph" (decode replay) or "eager"
    num_tokens: int  # tokens in the step (unpadded)
    num_seqs: int  # sequences in the step
    num_context_tokens: int  # sum of seq_lens: KV tokens the attention reads
    host_start: float  # time.perf_counter() at the start of execute (seconds)
    host_end: float  # after the logits were produced (enqueued) (seconds)
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None

    def device_time_s(self) -> float | None:
        """Device time between the two events in seconds (synchronizes on ``end``); None on CPU."""
        if self.start is None:
            return None
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3
