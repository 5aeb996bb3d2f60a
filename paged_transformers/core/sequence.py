"""Per-sequence state: the tokens, how many of them are in the KV cache, and how it finished."""

import dataclasses
import enum
import itertools

from ..logits_process import PerRequest, instantiate_per_request
from ..sampling_params import SamplingParams
from .sampling_batch import needs_host_work


class SequenceStatus(enum.Enum):
    """Where a sequence is. ``is_finished`` is the terminal test."""

    # NOTE: explicit values, the finished ones after the live ones: ``is_finished`` is read for every
    # sequence at every step, and comparing the value avoids Enum's Python-level ``__hash__``.
    WAITING = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self._value_ >= 3

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"``, or None while unfinished (vLLM's strings)."""
        return _FINISH_REASONS.get(self._value_)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED.value: "stop",
    SequenceStatus.FINISHED_LENGTH.value: "length",
    SequenceStatus.FINISHED_ABORTED.value: "abort",
}

_seq_ids = itertools.count()


class Sequence:
    """One token sequence (a request has ``n`` of them).

    The scheduler follows one rule for prompts and outputs alike: each step gives a sequence tokens
    so that ``num_computed_tokens`` (tokens whose K/V is in the cache, or written by a scheduled step: it
    advances when a step is planned) catches up with ``num_tokens + num_output_placeholders`` (prompt +
    output, plus the tokens being sampled by planned steps whose ids are not on the host yet).
    Preemption by recompute sets ``num_computed_tokens`` back to 0.

    Args:
        request_id: the owning request.
        index: this sequence's index among the request's ``n``.
        prompt_token_ids: the prompt, at least one token.
        sampling_params: the request's parameters (this sequence's own ``PerRequest`` processor instances).
    """

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], sampling_params: SamplingParams):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # tokens sampled by planned steps, not appended yet
        self.sampling_params = sampling_params
        # its sampling reads its tokens on the host (penalties, processors): no step is planned ahead of it
        self.needs_host_sampling = needs_host_work(sampling_params)
        self.status = SequenceStatus.WAITING
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        # prompt logprobs so far (``RequestOutput.prompt_logprobs``): [None, then one per scored prompt token]; only
        # the request's first sequence computes the prompt, so only it has them
        wants = sampling_params.prompt_logprobs is not None and index == 0
        self.prompt_logprobs: list[dict[int, float] | None] | None = [None] if wants else None
        self.cumulative_logprob = 0.0
        self.stop_reason: int | str | None = None
        self.error: BaseException | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_hashes: list[bytes] = []  # hashes of the full blocks of token_ids (prefix caching)
        # n > 1: the request's other sequences (``fan_out``); they fork from this one at the step that
        # samples its first token (``Scheduler.schedule``)
        self.pending_forks: list[Sequence] = []

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are asked for and not complete: the prompt's logits are still needed, so the
        sequence takes no prefix-cache hits."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def at_length_limit(self, max_model_len: int, num_ahead: int = 0) -> bool:
        """Whether the sequence has reached ``max_tokens`` outputs or ``max_model_len`` tokens once
        ``num_ahead`` more tokens are appended (the stop check: 0; the scheduler planning past a step whose
        tokens are not read yet: its placeholders)."""
        num_tokens = len(self.token_ids) + num_ahead
        return num_tokens - self.num_prompt_tokens >= self.sampling_params.max_tokens or num_tokens >= max_model_len

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})"
        )


def fan_out(request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[Sequence]:
    """A request's ``params.n`` sequences, made once at ``add_request``.

    Each sequence gets its own instances of the ``PerRequest`` logits processors (its random stream is the
    sampling batch's: ``sampling_batch.make_generator``). Only the first computes the prompt: the
    others wait in its ``pending_forks`` and join the batch at the step that samples its first token,
    taking its blocks by reference (copy-on-write) and sampling their first token from the same logits.
    """
    per_request = any(isinstance(p, PerRequest) for p in params.logits_processors)
    seqs = []
    for index in range(params.n):
        seq_params = params
        if per_request:  # each sequence gets its own instances of the PerRequest processors
            seq_params = dataclasses.replace(params, logits_processors=instantiate_per_request(params.logits_processors))
        seqs.append(Sequence(request_id, index, prompt_token_ids, seq_params))
    seqs[0].pending_forks = seqs[1:]
    return seqs
