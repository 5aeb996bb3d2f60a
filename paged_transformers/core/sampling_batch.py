"""The sampler's view of the batch: per-sequence sampling state, and each step's ``SamplingMetadata``.

The sampler never reads the scheduler's ``Sequence`` objects. What it needs of a sequence is registered here
when its request is added (``SamplingBatch.add``: parameters, random stream, prompt, the ids ``min_tokens``
masks), kept up to date from the plans (``prepare``: a plan's sampled rows, its finished sequences) and from
the tokens the sampler produced (``record``), and handed to the sampler one step at a time as a
``SamplingMetadata`` (vLLM's name), one entry per logits row::

    add_request --add--> SamplingBatch --prepare(plan)--> SamplingMetadata --> Sampler.launch / collect
                               ^                                                        |
                               +------------------ record(plan, ModelRunnerOutput) <----+

It lives where the sampler runs (rank 0 of a tensor-parallel engine); the other ranks only run the forward.

The token history (prompt + outputs) is kept only for sequences whose sampling reads it on the host
(penalties, logits processors: ``needs_host_work``). Such sequences are never in a step planned ahead of
the previous step's sampling (``Scheduler.schedule_ahead`` plans none while one runs), so when their row is
sampled every earlier token has been recorded. The outputs ``min_tokens`` counts are the ones sampled by
the earlier plans, read back or still in flight (``num_sampled``).
"""

from dataclasses import dataclass

import torch

from .messages import ModelRunnerOutput, SchedulerOutput
from ..sampling_params import SamplingParams


def needs_host_work(params: SamplingParams) -> bool:
    """Whether sampling a row of these parameters reads its token history on the host (penalties, logits
    processors), synchronizing with the device; a property of the request, fixed when it is added. Rows without
    it are sampled by device work only (an active ``min_tokens`` mask is device work, batched over the rows)."""
    return bool(params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
                or params.logits_processors)


def make_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator | None:
    """The random stream of a request's sequence ``index``: seeded from ``(params.seed, index)`` when the request
    is seeded, else None (the global stream)."""
    if params.seed is None:
        return None
    # NOTE: hash of an int tuple is not salted per process, so the stream is reproducible.
    return torch.Generator(device=device).manual_seed(hash((params.seed, index)) & (2**63 - 1))


@dataclass(slots=True)
class SeqSamplingState:
    """What the sampler needs of one sequence (``SamplingBatch.add``).

    Attributes:
        request_id: its request (named in error messages).
        params: its ``SamplingParams`` (its own ``PerRequest`` processor instances).
        generator: its random stream, or None.
        min_tokens_ids: ids masked until ``params.min_tokens`` outputs exist (``StopConditions.min_tokens_ids``).
        token_ids: prompt + outputs, for ``needs_host_work`` rows only (else None).
        num_prompt_tokens: prompt length in tokens.
        num_sampled: tokens sampled for it by the plans so far, counted while under ``min_tokens`` only.
    """

    request_id: str
    params: SamplingParams
    generator: torch.Generator | None
    min_tokens_ids: tuple[int, ...]
    token_ids: list[int] | None
    num_prompt_tokens: int
    num_sampled: int = 0


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """One step's sampling inputs, one entry per logits row (the plan's ``sampled_seq_ids`` order).

    Attributes:
        seq_ids: the sequence of each row.
        request_ids: its request (for error messages).
        params: its ``SamplingParams``. generators: its random stream or None.
        host_rows: the rows with penalties or logits processors (``needs_host_work``), ascending.
        token_ids: host row -> its prompt + output token ids, as of this step (read during ``Sampler.launch``).
        num_prompt_tokens: host row -> its prompt length (the outputs follow it in ``token_ids``).
        min_tokens_rows, min_tokens_ids: the (row, token id) pairs masked with -inf this step (``min_tokens``).
    """

    seq_ids: tuple[int, ...]
    request_ids: tuple[str, ...]
    params: tuple[SamplingParams, ...]
    generators: tuple[torch.Generator | None, ...]
    host_rows: tuple[int, ...] = ()
    token_ids: dict[int, list[int]] | None = None
    num_prompt_tokens: dict[int, int] | None = None
    min_tokens_rows: tuple[int, ...] = ()
    min_tokens_ids: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.seq_ids)


class SamplingBatch:
    """The sampling state of every unfinished sequence, keyed by sequence id (see the module docstring)."""

    def __init__(self):
        self.states: dict[int, SeqSamplingState] = {}
        self._histories: dict[int, list[int]] = {}  # seq_id -> token_ids, for the needs_host_work sequences

    def add(self, seq_id: int, request_id: str, params: SamplingParams, generator: torch.Generator | None,
            prompt_token_ids: list[int], min_tokens_ids: tuple[int, ...]) -> None:
        """Register a sequence when its request is added (each of its ``n`` sequences)."""
        history = list(prompt_token_ids) if needs_host_work(params) else None
        self.states[seq_id] = SeqSamplingState(request_id, params, generator, min_tokens_ids, history,
                                               len(prompt_token_ids))
        if history is not None:
            self._histories[seq_id] = history

    def prepare(self, plan: SchedulerOutput) -> SamplingMetadata | None:
        """Apply ``plan``'s diffs (its finished sequences are forgotten) and return the metadata of its sampled
        rows, or None when it samples none. Call once per plan, in plan order: each sampled row counts towards
        its sequence's ``min_tokens``."""
        for seq_id in plan.finished_seq_ids:
            if self.states.pop(seq_id, None) is not None:
                self._histories.pop(seq_id, None)
        seq_ids = plan.sampled_seq_ids
        if not seq_ids:
            return None
        states = [self.states[seq_id] for seq_id in seq_ids]
        host_rows = tuple(i for i, s in enumerate(states) if s.token_ids is not None)
        min_rows, min_ids = [], []
        for i in [i for i, s in enumerate(states) if s.num_sampled < s.params.min_tokens]:
            state = states[i]
            state.num_sampled += 1
            min_rows += [i] * len(state.min_tokens_ids)
            min_ids += state.min_tokens_ids
        return SamplingMetadata(
            tuple(seq_ids), tuple(s.request_id for s in states), tuple(s.params for s in states),
            tuple(s.generator for s in states), host_rows,
            {i: states[i].token_ids for i in host_rows} if host_rows else None,
            {i: states[i].num_prompt_tokens for i in host_rows} if host_rows else None,
            tuple(min_rows), tuple(min_ids),
        )

    def record(self, output: ModelRunnerOutput) -> None:
        """Append a step's sampled tokens to the histories kept (``needs_host_work`` sequences)."""
        if self._histories:
            sampled = output.sampled_token_ids
            for seq_id, history in self._histories.items():
                token = sampled.get(seq_id)
                if token is not None:
                    history.append(token)
