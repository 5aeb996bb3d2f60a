"""What ``AsyncEngine`` hands the event loop for one request: the checked request (``CheckedRequest``), the
stream of its outputs (``RequestStream``, over an ``OutputSlot`` the stepping side fills), and the front's errors."""

import asyncio
import time
from typing import NamedTuple

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

__all__ = ["CheckedRequest", "EngineDeadError", "OutputSlot", "QueueFullError", "RequestStream"]


class QueueFullError(RuntimeError):
    """``max_num_queued_requests`` requests are already waiting; try again later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The stepping loop stopped (it failed, or the front was shut down)."""


class CheckedRequest(NamedTuple):
    """A request that ``AsyncEngine.check_request`` passed, for ``AsyncEngine.add_checked_request`` (as vLLM's front
    hands its engine a processed ``EngineCoreRequest``): its own copies, so changing the caller's list or params
    later cannot reach it.

    Fields:
        prompt_token_ids: the prompt, token ids (``int``) inside the vocabulary, shorter than ``max_model_len``.
        sampling_params: the checked copy of the request's ``SamplingParams``.
    """

    prompt_token_ids: list[int]
    sampling_params: SamplingParams


class OutputSlot:
    """One request's outputs as the event loop sees them: the latest snapshot, an error, or the end."""

    __slots__ = ("prompt_token_ids", "latest", "error", "event")

    def __init__(self, prompt_token_ids: list[int]):
        self.prompt_token_ids = prompt_token_ids
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()


class RequestStream:
    """One request's outputs, as ``AsyncEngine.add_request`` returns them: ``async for`` yields its
    ``RequestOutput``s (cumulative snapshots; the last one has ``finished=True``); ``close()``, on any path, before or
    after iterating, aborts the request unless it finished (its blocks are freed). Closing twice is safe.

    Raises (while iterating):
        EngineDeadError: the stepping loop stopped (or the server shut down) mid-request.
        RuntimeError: the engine failed the request (the exception it raised, as the cause).
    """

    __slots__ = ("_front", "request_id", "arrival_time", "_stream", "_finished", "_closed")

    def __init__(self, front: "AsyncEngine", request_id: str, stream: OutputSlot):
        self._front, self.request_id, self._stream = front, request_id, stream
        self.arrival_time = time.perf_counter()  # when it was handed over (seconds, perf_counter)
        self._finished = self._closed = False

    @property
    def finished(self) -> bool:
        """Its last output (``finished=True``) was taken."""
        return self._finished

    @property
    def closed(self) -> bool:
        return self._closed

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        stream = self._stream
        while not self._finished and not self._closed:
            await stream.event.wait()
            stream.event.clear()
            if isinstance(stream.error, EngineDeadError):  # shut down, or the engine died: as is (a 503)
                raise stream.error
            if stream.error is not None:
                raise RuntimeError(f"the engine failed this request: {stream.error}") from stream.error
            output, stream.latest = stream.latest, None
            if output is not None:
                self._finished = output.finished
                return output
        raise StopAsyncIteration

    def close(self) -> None:
        """Stop taking outputs; abort the request in the engine unless it finished."""
        if not self._closed:
            self._closed = True
            self._front._release(self.request_id, self._finished)
            self._stream.event.set()  # an iteration waiting for an output ends
