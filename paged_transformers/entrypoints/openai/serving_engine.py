"""What completions and chat share: the model-name check, ``SamplingParams`` from a request, running requests
on the ``AsyncEngine`` with metrics and client-disconnect aborts, SSE framing, usage and logprobs helpers."""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from ...integration.streaming import UNFINISHED, TextStream
from ...outputs import RequestOutput
from ...sampling_params import SamplingParams
from ..async_engine import AsyncEngine, CheckedRequest, EngineDeadError, RequestStream
from .metrics import ServerMetrics
from .protocol import OpenAIBaseModel, SamplingFields, error_body

logger = logging.getLogger("paged_transformers.serve")

SSE_DONE = "data: [DONE]\n\n"
_PASSED_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "min_tokens",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "include_stop_str_in_output")  # fmt: skip


class ServingError(Exception):
    """A request the server refuses: an HTTP status, a message and the request field at fault (OpenAI's envelope)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def bad_request(error: ValueError, fields=()) -> ServingError:
    """A 400 for a ``ValueError`` of our checks; ``param`` is the field the message starts with, if any."""
    message = str(error)
    first = message.split(" ", 1)[0].split("=", 1)[0]
    return ServingError(400, message, first if first in fields else None)


def check_text(request: OpenAIBaseModel) -> None:
    """Raises ``ServingError``: 400 naming the field of a string that is not valid Unicode (a lone UTF-16 surrogate,
    ``OpenAIBaseModel.invalid_text``), which the tokenizer would fail on with a ``TypeError``."""
    invalid = request.invalid_text()
    if invalid is not None:
        raise ServingError(400, invalid[1], invalid[0])


def sse(payload: dict) -> str:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse_frames(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """A streamed response's frames: each chunk as an SSE event, then ``data: [DONE]``, also after an error (sent as
    an ``{"error": ...}`` event: the response status is already 200). A cancellation (the client left) ends it."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except EngineDeadError as e:  # the server shuts down (or its engine died): a 503, as before a response starts
        yield sse(error_body(503, str(e)))
    except Exception as e:  # noqa: BLE001 - the stream has started: the error goes in an event
        logger.exception("a streamed request failed")
        yield sse(error_body(500, str(e)))
    yield SSE_DONE


class SSEStream:
    """A streamed response's body: ``sse_frames`` of ``chunks``, with the engine requests it streams. ``aclose``
    (which the server's response calls however it ends) aborts those that did not finish, also when the body never
    started (a client that left before its response began), then closes the frames.

    Args:
        chunks: the response's chunks (dicts); close_requests: closes its requests (``close_streams``).
    """

    def __init__(self, chunks: AsyncIterator[dict], close_requests: Callable[[], None]):
        self._frames = sse_frames(chunks)
        self._close_requests = close_requests

    def __aiter__(self) -> AsyncIterator[str]:
        return self._frames

    async def aclose(self) -> None:
        self._close_requests()
        await self._frames.aclose()


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}  # fmt: skip


def random_id(prefix: str, request_id: str | None) -> str:
    """``prefix-<X-Request-Id>`` when the client sent one, else ``prefix-<random hex>`` (vLLM's ids)."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained in one engine step, for a streamed response.

    Attributes:
        index: the choice's index in the response: ``prompt_index * n + sequence index``.
        prompt_index: which prompt of the request.
        text: the new text (held back while it could begin a stop string; cut at the stop at the end).
        token_ids: the new token ids.
        logprobs: per new token ``{token id: logprob}`` (the top-k and the sampled token), or None.
        finish_reason, stop_reason: set on the choice's last delta only.
        prompt_logprobs: the request's ``RequestOutput.prompt_logprobs`` (complete in every delta), or None.
    """

    index: int
    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: list[dict[int, float] | None] | None = None


class OpenAIServing:
    """The shared half of the completion and chat handlers.

    Args:
        front: the running ``AsyncEngine``.
        served_model_names: names a request's ``model`` may take (the first is reported).
        default_sampling_params: the server's defaults (``LLM.get_default_sampling_params()``).
        metrics: the server's ``ServerMetrics``.
        log_requests: log each request's id, prompt length and parameters at INFO.
    """

    def __init__(self, front: AsyncEngine, served_model_names: list[str], default_sampling_params: SamplingParams,
                 metrics: ServerMetrics, log_requests: bool = True):  # fmt: skip
        self.front = front
        self.tokenizer = front.tokenizer
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.defaults = default_sampling_params
        self.metrics = metrics
        self.log_requests = log_requests

    @property
    def max_model_len(self) -> int:
        return self.front.limits.max_model_len

    def check_request(self, request: SamplingFields) -> None:
        """Raises ``ServingError``: 404 for another model's name, 400 for a field this server does not serve or a
        string that is not valid Unicode (``check_text``)."""
        if request.model is not None and request.model not in self.served_model_names:
            raise ServingError(404, f"The model `{request.model}` does not exist.", "model")
        check_text(request)
        unserved = request.unserved_fields()
        if unserved:
            raise ServingError(400, "; ".join(unserved), unserved[0].split(":", 1)[0])
        ignored = request.ignored_fields()
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s", ignored)

    def sampling_params(self, request: SamplingFields, num_prompt_tokens: int, max_tokens: int | None,
                        logprobs: int | None, max_tokens_field: str = "max_tokens",
                        prompt_logprobs: int | None = None) -> SamplingParams:  # fmt: skip
        """The request's ``SamplingParams``: its fields over the server defaults. ``max_tokens`` None: up to
        ``max_model_len`` (vLLM's rule for chat); ``max_tokens_field``: the request field it came from, which errors
        about it name (chat's ``max_completion_tokens``); ``prompt_logprobs``: ``SamplingParams.prompt_logprobs``
        (completions' echo with logprobs).

        Raises:
            ServingError: 400 for a field out of range (named), or a prompt plus ``max_tokens`` over ``max_model_len``.
        """
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is not None and max_tokens > room > 0:
            raise ServingError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                    f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                                    f"prompt, {max_tokens} in the completion). Please reduce the prompt or "
                                    f"{max_tokens_field}.", max_tokens_field)  # fmt: skip
        fields = {name: getattr(self.defaults, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        fields.update({name: getattr(request, name) for name in _PASSED_FIELDS if getattr(request, name) is not None})
        fields["max_tokens"] = max_tokens if max_tokens is not None else max(room, 1)
        fields["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        fields["logprobs"] = logprobs
        fields["prompt_logprobs"] = prompt_logprobs
        if request.logit_bias:
            fields["logits_processors"] = [self._logit_bias(request.logit_bias)]
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            error = bad_request(e, list(fields) + ["max_tokens"])
            if error.param == "max_tokens":
                error.param = max_tokens_field
            raise error from e

    def _logit_bias(self, logit_bias: dict[str, float]):
        """A logits processor adding each bias (in [-100, 100]: ``protocol.Bias``) to its token's logit.

        Raises:
            ServingError: 400 for a key that is not a token id of the vocabulary.
        """
        vocab_size = self.front.limits.vocab_size
        try:
            ids = [int(key) for key in logit_bias]
        except ValueError:
            raise ServingError(400, f"logit_bias keys must be token ids, got {sorted(logit_bias)[:5]}", "logit_bias") from None
        if any(not 0 <= i < vocab_size for i in ids):
            raise ServingError(400, f"logit_bias has token ids outside the vocabulary [0, {vocab_size})", "logit_bias")
        return LogitBias(ids, list(logit_bias.values()))

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> CheckedRequest:
        """The engine's own checks on one prompt, as a 400 (``AsyncEngine.check_request``); the checked request is
        handed over as it is (``add_requests``)."""
        try:
            return self.front.check_request(prompt_token_ids, params)
        except ValueError as e:
            error = bad_request(e, _PASSED_FIELDS + ("stop", "logprobs", "max_tokens"))
            error.param = error.param or ("prompt" if error.message.startswith("prompt") else None)
            raise error from e

    def add_requests(self, requests: list[CheckedRequest], log_id: str) -> list[RequestStream]:
        """Hand requests that ``check_prompt`` passed to the engine now, without checking them again, from the
        request's handler: the engine has them while the event loop takes in the rest of a burst, before the streamed
        response's body (a task of its own) runs. The caller closes the streams (``close_streams``) however the
        response ends.

        Raises:
            EngineDeadError: the engine stopped (the requests handed over before it are aborted).
        """
        streams: list[RequestStream] = []
        try:
            for i, request in enumerate(requests):
                if self.log_requests:
                    logger.info("request %s-%d: %d prompt tokens, %s", log_id, i, len(request.prompt_token_ids),
                                request.sampling_params)
                streams.append(self.front.add_checked_request(request))
        except BaseException:
            self.close_streams(streams, log_id)
            raise
        return streams

    def close_streams(self, streams: list[RequestStream], log_id: str) -> None:
        """Close the streams of ``add_requests``: a request that did not finish is aborted (its blocks freed) and
        logged. Safe to call again."""
        for i, stream in enumerate(streams):
            if not stream.closed:
                if self.log_requests and not stream.finished:
                    logger.info("request %s-%d aborted (its client disconnected, or the server is stopping)", log_id, i)
                stream.close()

    async def outputs(self, stream: RequestStream, num_prompt_tokens: int) -> AsyncIterator[RequestOutput]:
        """A handed-over request's outputs (they end early when its stream is closed). The token counters go up as
        outputs come (the prompt's with the first, as vLLM counts them per step); the latency histograms are
        observed when it finishes."""
        first, last, counted = None, None, 0
        async for output in stream:
            generated = sum(len(c.token_ids) for c in output.outputs)
            self.metrics.record_tokens(0 if first else num_prompt_tokens, generated - counted)
            first, last, counted = first or time.perf_counter(), output, generated
            yield output
        if stream.finished:  # not when it was closed (aborted) first
            self.metrics.record_finished(last, stream.arrival_time, first, time.perf_counter())

    async def stream_choices(self, requests: list[CheckedRequest],
                             streams: list[RequestStream]) -> AsyncIterator[ChoiceDelta]:  # fmt: skip
        """The deltas of ``requests`` handed over as ``streams`` (``add_requests``), as
        the engine makes them, interleaved across choices; each choice's last delta has its ``finish_reason``
        (exactly once). Texts are detokenized here, on the event loop, by one ``TextStream`` per choice.

        Raises:
            RuntimeError: the engine failed a request or a sequence (its error as the cause).
        """
        texts: dict[int, TextStream] = {}
        sent: dict[int, int] = {}  # choice index -> output tokens sent; -1 once finished
        iterators = [self.outputs(stream, len(ids)) for stream, (ids, _) in zip(streams, requests)]
        async for i, output in merge(iterators):
            params = requests[i][1]
            for comp in output.outputs:
                index = i * params.n + comp.index
                start = sent.get(index, 0)
                new_ids = comp.token_ids[start:] if start >= 0 else []
                if not new_ids and (start < 0 or not comp.finished):
                    continue
                if comp.error is not None:
                    raise RuntimeError(f"sequence {index} failed: {comp.error}") from comp.error
                if index not in texts:
                    texts[index] = TextStream(self.tokenizer, True, params)
                text = texts[index].add(new_ids, comp if comp.finished else UNFINISHED)
                sent[index] = -1 if comp.finished else len(comp.token_ids)
                logprobs = comp.logprobs[start : start + len(new_ids)] if comp.logprobs is not None else None
                yield ChoiceDelta(index, i, text, new_ids, logprobs, comp.finish_reason,
                                  comp.stop_reason if comp.finished else None, output.prompt_logprobs)  # fmt: skip

    def stream_response(self, requests: list[CheckedRequest], log_id: str,
                        chunks: Callable[[list[RequestStream]], AsyncIterator[dict]]) -> "SSEStream":  # fmt: skip
        """A streamed response: the requests handed over now (``add_requests``), and its body, ``chunks(streams)``'s
        dicts as SSE frames (``sse_frames``), which closes the streams however it ends (``SSEStream``).

        Raises:
            EngineDeadError: as ``add_requests``.
        """
        streams = self.add_requests(requests, log_id)
        return SSEStream(chunks(streams), lambda: self.close_streams(streams, log_id))

    async def run_to_end(self, requests: list[CheckedRequest], log_id: str, raw_request) -> list[RequestOutput]:
        """The final ``RequestOutput`` of each request, in order (a disconnect aborts them all).

        Raises:
            ClientDisconnected: the client went away first.
            EngineDeadError: the engine stopped.
            RuntimeError: the engine failed a request or a sequence.
        """
        streams = self.add_requests(requests, log_id)

        async def last_output(i: int, stream: RequestStream) -> RequestOutput:
            async for output in self.outputs(stream, len(requests[i][0])):
                last = output
            for comp in last.outputs:
                if comp.error is not None:
                    raise RuntimeError(f"sequence {comp.index} of prompt {i} failed: {comp.error}") from comp.error
            return last

        tasks = [asyncio.ensure_future(last_output(i, stream)) for i, stream in enumerate(streams)]
        try:
            return await unless_disconnected(asyncio.gather(*tasks), raw_request)
        finally:  # one failed, or the client left: the others stop too
            for task in tasks:
                task.cancel()
            self.close_streams(streams, log_id)

    def token_text(self, token_id: int) -> str:
        """One token's text, as the logprobs report it."""
        return self.tokenizer.decode([token_id])


class LogitBias:
    """A logits processor adding ``bias[i]`` to the logit of token ``token_ids[i]`` (OpenAI's ``logit_bias``); a
    plain object, so that it pickles into an engine process.

    Args: token_ids: int token ids; bias: floats, one per token id.
    """

    def __init__(self, token_ids: list[int], bias: list[float]):
        self.index = torch.tensor(token_ids)
        self.bias = torch.tensor(bias)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # [1, num_tokens], [1, vocab]
        scores[:, self.index.to(scores.device)] += self.bias.to(scores.device, scores.dtype)
        return scores


async def merge(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of several async iterators as they come, as ``(iterator index, item)``. Leaving early, or an error in
    one of them (raised here), cancels and closes them all. One iterator (a request of one prompt, the common case)
    is iterated in place: no task and no queue between its items and the response."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, iterator) -> None:
        try:
            async for item in iterator:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((i, done, e))

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for iterator in iterators:
            await iterator.aclose()


async def until_disconnected(raw_request) -> None:
    """Return once the client of ``raw_request`` (a starlette ``Request`` whose body was read) disconnects."""
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


class ClientDisconnected(Exception):
    """The client went away before its response was ready (its requests were aborted)."""


async def unless_disconnected(coro, raw_request):
    """Await ``coro``, cancelling it (which aborts its engine requests) if the client disconnects first.

    Raises:
        ClientDisconnected: the client disconnected first.
    """
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(until_disconnected(raw_request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientDisconnected()
    return task.result()


def top_logprobs(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` likeliest ``(token id, logprob)`` of one position, likeliest first (the engine's dict holds the
    top ``k`` and the sampled token), logprobs clamped at -9999 as vLLM does (JSON has no -inf)."""
    return [(t, clamp_logprob(lp)) for t, lp in sorted(logprobs.items(), key=lambda item: -item[1])[:k]]


def clamp_logprob(logprob: float) -> float:
    return max(logprob, -9999.0)
