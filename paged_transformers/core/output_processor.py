"""Stop checks and request outputs: what the engine makes of a step's new tokens.

Each request carries its ``StopConditions``, resolved once at ``LLMEngine.add_request`` (the EOS ids the engine
knew then, the request's stop ids and strings, its transformers ``StoppingCriteria``, its lengths). After
``Scheduler.update_from_output`` has appended a step's tokens, ``OutputProcessor.check_stops`` says which
sequences end, in this order: a ``stop_token_ids`` token, an EOS token (unless ``ignore_eos``), a ``stop``
string, ``max_tokens`` outputs or ``max_model_len`` tokens, and last the ``StoppingCriteria``. ``min_tokens``
is enforced by the sampler, which masks ``StopConditions.min_tokens_ids`` until then. The engine ends those
sequences (``Scheduler.finish``) and ``make_outputs`` turns the touched requests into ``RequestOutput``s,
forgetting the finished ones.

Stop strings are searched in text decoded incrementally (``IncrementalDetokenizer``: the two-offset scheme
of Hugging Face TGI's ``decode_token`` and vLLM's ``detokenize_incrementally``), only where the new tokens'
text can complete one, so a step costs O(new tokens), not O(output length).
"""

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams
from .sequence import Sequence, SequenceStatus

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    The new tokens are decoded together with a few tokens of left context, and text is released only once
    it no longer ends in U+FFFD, the replacement character a byte-level tokenizer produces for an
    incomplete UTF-8 sequence. So a multi-byte character split across tokens is emitted once, whole, when
    its last byte arrives.

    Args:
        tokenizer: a transformers tokenizer.
        skip_special_tokens: as in ``tokenizer.decode``.

    Examples:
        >>> class ByteTok:  # a toy byte-level tokenizer: one token per UTF-8 byte
        ...     def decode(self, ids, skip_special_tokens=True):
        ...         return bytes(ids).decode("utf-8", errors="replace")
        >>> d = IncrementalDetokenizer(ByteTok())
        >>> [d.add([b]) for b in "aé".encode()]  # 'é' is two bytes
        ['a', '', 'é']
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the context window re-decoded with the new tokens
        self.read_offset = 0  # tokens before it were already released as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete ('' while a character is still incomplete)."""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return delta
        return ""

    def pending(self) -> str:
        """The text of the tokens not released yet, as ``flush`` would return it, without releasing it."""
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        return self._decode(self.token_ids[self.prefix_offset :])[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is left at the end of the sequence (an incomplete character decodes as U+FFFD)."""
        text = self.pending()
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return text


def first_stop(text: str, stops) -> str | None:
    """The stop string that occurs earliest in ``text`` (ties: the first listed), or None."""
    found = [(text.find(stop), i) for i, stop in enumerate(stops) if stop in text]
    return stops[min(found)[1]] if found else None


def cut_at_stop(text: str, stop_reason, include_stop_str: bool = False) -> str:
    """``text`` up to the first occurrence of the stop string ``stop_reason``, the stop string itself kept when
    ``include_stop_str`` (vLLM's ``include_stop_str_in_output``); unchanged for a token id or None."""
    if not isinstance(stop_reason, str) or stop_reason not in text:
        return text
    start = text.find(stop_reason)
    return text[: start + len(stop_reason) if include_stop_str else start]


def omits_stop_token(finish_reason: str | None, stop_reason, params: SamplingParams, has_criteria: bool) -> bool:
    """Whether a finished sequence's text leaves out its last token: the ``stop_token_ids`` id (``stop_reason``)
    or the EOS token that ended it. vLLM's detokenizer leaves a stop-terminated sequence's last token out of the
    text (it stays in ``token_ids``) unless ``include_stop_str_in_output``. A sequence ended by a transformers
    ``StoppingCriteria`` has no ``stop_reason`` either: a request with criteria (``has_criteria``) keeps the text
    of such a last token, as ``generate()`` keeps it (its EOS ids are ``stop_token_ids``, named by ``stop_reason``).
    """
    if finish_reason != "stop" or params.include_stop_str_in_output or isinstance(stop_reason, str):
        return False
    return stop_reason is not None or not has_criteria


class _StopStrings:
    """One sequence's output text, decoded incrementally, searched for its stop strings where the new text
    can complete one: a stop that began earlier would have been found earlier."""

    __slots__ = ("detokenizer", "stops", "max_len", "text", "num_tokens")

    def __init__(self, tokenizer, stops: list[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stops = stops
        self.max_len = max(map(len, stops))
        self.text = ""  # released so far
        self.num_tokens = 0  # output tokens given to the detokenizer

    def find(self, output_token_ids: list[int]) -> str | None:
        """The earliest stop string in the output text (the one a full decode would show), or None."""
        start = max(0, len(self.text) - self.max_len + 1)
        self.text += self.detokenizer.add(output_token_ids[self.num_tokens :])
        self.num_tokens = len(output_token_ids)
        return first_stop(self.text[start:] + self.detokenizer.pending(), self.stops)


@dataclass(frozen=True, slots=True)
class StopConditions:
    """When the sequences of one request end, fixed when the request is added (``resolve``).

    Attributes:
        eos_token_ids: the model's EOS ids when the request was added; empty with ``ignore_eos``.
        stop_token_ids: ``SamplingParams.stop_token_ids`` (the token is kept, and is the ``stop_reason``).
        stop: ``SamplingParams.stop`` strings (searched in the output text; need a tokenizer).
        stopping_criteria: transformers ``StoppingCriteria``-like callables, called after every new token as
            ``criterion(input_ids [1, num_tokens] int64, None)`` on prompt + output; a true result ends the
            sequence (``finish_reason="stop"``, the token kept, as ``generate()`` keeps it).
        min_tokens: outputs before EOS or a stop id may be sampled (the sampler masks ``min_tokens_ids``).
        max_tokens: outputs at most. max_model_len: prompt + output tokens at most.
    """

    eos_token_ids: frozenset[int]
    stop_token_ids: frozenset[int]
    stop: tuple[str, ...]
    stopping_criteria: tuple[Callable, ...]
    min_tokens: int
    max_tokens: int
    max_model_len: int

    @classmethod
    def resolve(cls, params: SamplingParams, eos_token_ids, max_model_len: int,
                stopping_criteria=None) -> "StopConditions":
        """The stop conditions of a request with ``params``, given the engine's EOS ids now.

        Raises:
            ValueError: ``stopping_criteria`` for a request with ``n > 1``.
        """
        criteria = tuple(stopping_criteria or ())
        if criteria and params.n != 1:
            raise ValueError(f"stopping criteria need n == 1, got n={params.n}")
        return cls(frozenset() if params.ignore_eos else frozenset(eos_token_ids), frozenset(params.stop_token_ids),
                   tuple(params.stop), criteria, params.min_tokens, params.max_tokens, max_model_len)

    def min_tokens_ids(self, vocab_size: int) -> tuple[int, ...]:
        """The ids the sampler masks until ``min_tokens`` outputs exist: the stop ids and EOS ids under
        ``vocab_size`` (an id past the vocabulary can never be sampled), ascending; empty without ``min_tokens``."""
        if not self.min_tokens:
            return ()
        return tuple(sorted(t for t in self.stop_token_ids | self.eos_token_ids if t < vocab_size))

    def at_length_limit(self, num_prompt_tokens: int, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens (``num_prompt_tokens`` of them the prompt) is as long as
        allowed: ``max_tokens`` outputs or ``max_model_len`` tokens."""
        return num_tokens - num_prompt_tokens >= self.max_tokens or num_tokens >= self.max_model_len


@dataclass(slots=True)
class EngineRequest:
    """A request while the engine serves it: its ``n`` sequences (``sequence.fan_out``), its stop conditions
    and its metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    stops: StopConditions
    stop_strings: dict[int, _StopStrings] = field(default_factory=dict)  # seq index -> its stop-string search


class OutputProcessor:
    """The stop checks and the ``RequestOutput``s of the engine's requests.

    Args:
        tokenizer: optional; for ``stop`` strings and output text.
        device: where ``StoppingCriteria`` get their ``input_ids``.
    """

    def __init__(self, tokenizer, device: torch.device):
        self.tokenizer = tokenizer
        self.device = device
        self.requests: dict[str, EngineRequest] = {}  # unfinished requests, in arrival order

    def add_request(self, request: EngineRequest) -> None:
        self.requests[request.request_id] = request

    def check_stops(self, seqs: list[Sequence]) -> list[tuple[Sequence, SequenceStatus]]:
        """The unfinished ones of ``seqs`` (each just got a token) that end now, with how (see the module
        docstring); sets their ``stop_reason``."""
        stopped = []
        for seq in seqs:
            if not seq.is_finished:
                status = self._check_stop(seq)
                if status is not None:
                    stopped.append((seq, status))
        return stopped

    def _check_stop(self, seq: Sequence) -> SequenceStatus | None:
        request = self.requests[seq.request_id]
        stops = request.stops
        token = seq.token_ids[-1]
        if token in stops.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if token in stops.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if stops.stop and self.tokenizer is not None:
            search = request.stop_strings.get(seq.index)
            if search is None:
                search = request.stop_strings[seq.index] = _StopStrings(self.tokenizer, list(stops.stop))
            stop = search.find(seq.output_token_ids)
            if stop is not None:
                seq.stop_reason = stop
                return SequenceStatus.FINISHED_STOPPED
        if stops.at_length_limit(seq.num_prompt_tokens, seq.num_tokens):
            return SequenceStatus.FINISHED_LENGTH
        if stops.stopping_criteria:
            ids = torch.tensor([seq.token_ids], dtype=torch.int64, device=self.device)
            if any(bool(torch.as_tensor(c(ids, None)).any()) for c in stops.stopping_criteria):
                return SequenceStatus.FINISHED_STOPPED
        return None

    def make_outputs(self, seqs: list[Sequence], now: float) -> list[RequestOutput]:
        """One ``RequestOutput`` per request of ``seqs`` (in first-seen order); finished requests are
        returned once and forgotten."""
        outputs = []
        for request_id in dict.fromkeys(seq.request_id for seq in seqs):
            request = self.requests[request_id]
            metrics = request.metrics
            if not metrics.first_token_time:
                metrics.first_token_time = now
            output = self.make_output(request)
            if output.finished:
                metrics.finished_time = now
                del self.requests[request_id]
            outputs.append(output)
        return outputs

    def make_output(self, request: EngineRequest) -> RequestOutput:
        """The request's state as a ``RequestOutput`` (a snapshot: its lists are copies). Text comes with the
        finished output only (``streaming.stream`` yields text as it is generated)."""
        seqs = request.seqs
        finished = all(seq.status.is_finished for seq in seqs)
        completions = []
        for seq in seqs:
            # NOTE: decoding the whole output is O(length): done once, when the request finishes.
            text = self.final_text(seq, bool(request.stops.stopping_criteria)) if finished else ""
            logprobs = seq.logprobs
            completions.append(CompletionOutput(
                seq.index, text, seq.token_ids[seq.num_prompt_tokens :],
                seq.cumulative_logprob if logprobs is not None else None,
                list(logprobs) if logprobs is not None else None,
                seq.status.finish_reason, seq.stop_reason, seq.error,
            ))
        prompt_logprobs = seqs[0].prompt_logprobs  # the first sequence computes the prompt for all n
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                             request.metrics, list(prompt_logprobs) if prompt_logprobs is not None else None)

    def final_text(self, seq: Sequence, has_criteria: bool) -> str:
        """A finished sequence's text: its output decoded, without the stop token or EOS that ended it
        (``omits_stop_token``), cut at its stop string (``cut_at_stop``)."""
        sp = seq.sampling_params
        token_ids = seq.output_token_ids
        if omits_stop_token(seq.status.finish_reason, seq.stop_reason, sp, has_criteria):
            token_ids = token_ids[:-1]
        return cut_at_stop(self.decode(token_ids), seq.stop_reason, sp.include_stop_str_in_output)

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` ('' without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
