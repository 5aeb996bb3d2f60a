"""Per-sequence state: the tokens, how many of them are in the KV cache, and how it finished."""

import enum
import itertools

import torch

from .sampling_params import SamplingParams


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

# NOTE(async scheduling): the token a sequence holds at its end while the step that samples it is still
# on the device (engine.step pipelines the next step before reading it back). It lives only inside one
# ``LLMEngine.step()`` call: replaced by the sampled token before anything hashes, detokenizes or
# returns the sequence's tokens. Negative, so that an embedding lookup of it fails loudly.
PLACEHOLDER_TOKEN_ID = -1


class Sequence:
    """One token sequence (a request has ``n`` of them).

    The scheduler follows one rule for prompts and outputs alike: each step gives a sequence tokens
    so that ``num_computed_tokens`` (tokens whose K/V is in the cache) catches up with ``num_tokens``
    (prompt + output). Preemption by recompute sets ``num_computed_tokens`` back to 0.

    Args:
        request_id: the owning request.
        index: this sequence's index among the request's ``n``.
        prompt_token_ids: the prompt, at least one token.
        sampling_params: the request's parameters.
        generator: this sequence's own random stream when the request is seeded, else None.
    """

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        generator: torch.Generator | None = None,
    ):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.sampling_params = sampling_params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.stop_reason: int | str | None = None
        self.error: BaseException | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_hashes: list[bytes] = []  # hashes of the full blocks of token_ids (prefix caching)
        # n > 1: the request's other sequences; they fork from this one when its prompt is done
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
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})"
        )
