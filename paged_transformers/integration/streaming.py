"""Streaming to users: per engine step, the new token ids and the new text of each touched request.

``stream(engine)`` yields, after every engine step, what each sequence gained. Text is detokenized
incrementally (``output_processor.IncrementalDetokenizer``), so a multi-byte character split across
tokens is emitted once, whole, when its last byte arrives, and text that could still begin a stop string
is held back.
"""

from dataclasses import dataclass
from typing import Iterator

from ..core.engine import run_engine
from ..core.output_processor import IncrementalDetokenizer, cut_at_stop, omits_stop_token

__all__ = ["IncrementalDetokenizer", "StreamDelta", "TextStream", "stream"]


@dataclass(slots=True)
class StreamDelta:
    """What one sequence of a request gained in one engine step.

    Attributes:
        request_id, index: the request and which of its ``n`` sequences.
        token_ids: the new token ids (usually one).
        text: the new text ('' while a multi-byte character is incomplete, or without a tokenizer).
        finished, finish_reason: as in ``CompletionOutput``; on the last delta the remaining text is flushed.
        error: the exception that aborted the sequence (e.g. from its logits processor), if any.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    error: BaseException | None = None


def stream(engine, skip_special_tokens: bool = True) -> Iterator[StreamDelta]:
    """Run ``engine`` until idle, yielding per sequence the tokens and text each step added.

    Each token and each character is yielded once: a finished sequence yields one last delta (with
    ``finished=True``) and nothing after it, even while its request's other sequences run. Text that
    could still be the start of one of the request's ``stop`` strings is held back until the next
    tokens show it is not (at most ``len(stop) - 1`` characters, as vLLM's detokenizer holds back), and
    the last delta ends where the final ``CompletionOutput.text`` is cut. So per sequence the texts join
    to exactly the final text, and the token ids to ``CompletionOutput.token_ids``.

    Args:
        engine: an ``LLMEngine`` with requests added (requests may be added while iterating).
        skip_special_tokens: as in ``tokenizer.decode``.

    Yields:
        ``StreamDelta``s in step order.

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from paged_transformers import LLMEngine, SamplingParams
        >>> from paged_transformers.integration.streaming import stream
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <...>
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
        >>> with LLMEngine(model) as engine:
        ...     engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        ...     deltas = list(stream(engine))
        >>> [len(d.token_ids) for d in deltas], deltas[-1].finish_reason
        ([1, 1, 1], 'length')
    """
    texts: dict[tuple[str, int], TextStream] = {}
    seen: dict[tuple[str, int], int] = {}  # (request_id, index) -> output tokens yielded; -1 once finished
    params: dict[str, tuple] = {}  # request_id -> (SamplingParams, has criteria), noted before each step
    _note_requests(engine, params)
    for outputs in run_engine(engine):
        for out in outputs:
            sp, has_criteria = params[out.request_id]
            for comp in out.outputs:
                key = (out.request_id, comp.index)
                start = seen.get(key, 0)
                if start < 0:
                    continue  # finished at an earlier step; the request still carries it for its siblings
                new_ids = comp.token_ids[start:]
                if not new_ids and not comp.finished:
                    continue
                seen[key] = -1 if comp.finished else len(comp.token_ids)
                text = ""
                if engine.tokenizer is not None:
                    if key not in texts:
                        texts[key] = TextStream(engine.tokenizer, skip_special_tokens, sp)
                    text = texts[key].add(new_ids, comp if comp.finished else UNFINISHED, has_criteria)
                    if comp.finished:
                        del texts[key]
                yield StreamDelta(out.request_id, comp.index, new_ids, text, comp.finished, comp.finish_reason, comp.error)
            if out.finished:  # the engine forgets the request; its id may be used again
                params.pop(out.request_id)
                for comp in out.outputs:
                    seen.pop((out.request_id, comp.index), None)
        _note_requests(engine, params)


def _note_requests(engine, params: dict) -> None:
    """Record each unfinished request's ``SamplingParams`` and whether it has stopping criteria: the engine forgets
    a request with its last output, whose text still needs them (requests added meanwhile are noted before the
    step that runs them)."""
    for request_id, request in engine.requests.items():
        if request_id not in params:
            params[request_id] = (request.sampling_params, bool(request.stops.stopping_criteria))


UNFINISHED = object()  # TextStream.add: the sequence goes on (how it ends is not known yet)


def _held_back(text: str, stops) -> int:
    """Length of the longest end of ``text`` that begins some stop string (< the longest stop's length)."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held


class TextStream:
    """One sequence's streamed text: decoded incrementally, released only where no stop string can begin.

    Args:
        tokenizer: a transformers tokenizer.
        skip_special_tokens: as in ``tokenizer.decode``.
        params: the request's ``SamplingParams`` (its ``stop`` strings and ``include_stop_str_in_output``).
    """

    __slots__ = ("detokenizer", "params", "text", "num_sent")

    def __init__(self, tokenizer, skip_special_tokens: bool, params):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.params = params
        self.text = ""  # decoded so far
        self.num_sent = 0  # characters of ``text`` already yielded

    def add(self, token_ids: list[int], finished, has_criteria: bool = False) -> str:
        """Append tokens; return the text now safe to release. ``finished``: ``UNFINISHED``, or the finished
        sequence's ``CompletionOutput``: the text then ends where the engine's final text ends (the stop token or
        EOS that ended it left out, ``omits_stop_token``; cut at its stop string). ``has_criteria``: the request
        had ``StoppingCriteria``."""
        if finished is not UNFINISHED and omits_stop_token(finished.finish_reason, finished.stop_reason, self.params,
                                                           has_criteria):  # fmt: skip
            token_ids = token_ids[:-1]  # the stop token arrives with the sequence's last output, never before
        self.text += self.detokenizer.add(token_ids)
        if finished is UNFINISHED:
            end = len(self.text) - _held_back(self.text, self.params.stop)
        else:
            self.text += self.detokenizer.flush()
            end = len(cut_at_stop(self.text, finished.stop_reason, self.params.include_stop_str_in_output))
        assert end >= self.num_sent, f"stream released {self.num_sent} characters, the text ends at {end}: {self.text!r}"
        delta, self.num_sent = self.text[self.num_sent : end], end
        return delta
