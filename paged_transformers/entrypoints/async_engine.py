"""``AsyncEngine``: an asyncio front over a model's warm ``LLMEngine``, for servers.

The engine is not thread-safe, so exactly one thread touches it: the stepping thread, which holds the engine
attached (``LLM.attached_engine``) for the front's whole life. Everything else talks to it
through messages::

    event loop                                   stepping thread
    ----------                                   ---------------
    generate(): checks (read-only limits) ---->  commands queue: ("add", id, ids, params) / ("abort", id)
                                                 drain commands; engine.step(); snapshot the counters
    per-request _Stream (latest output) <------  loop.call_soon_threadsafe(dispatch, step's outputs)

A ``RequestOutput`` is a cumulative snapshot of its request (all tokens so far), so a consumer that falls behind
reads only the latest one and loses nothing: the loop never queues more than one output per request.
Detokenizing deltas and encoding JSON happen in the request handlers on the event loop, never on the stepping
thread, which only steps the engine and hands its outputs over.
"""

import asyncio
import copy
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator

from ..core.engine_inputs import check_sampling_params, validate_prompt
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

logger = logging.getLogger("paged_transformers")

_IDLE_POLL_S = 0.5  # how often an idle stepping thread wakes up to look for a stop (seconds)


class QueueFullError(RuntimeError):
    """``max_num_queued_requests`` requests are already waiting; try again later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The stepping thread stopped (it failed, or the front was shut down)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's counters after a step, published by the stepping thread for metrics and admission.

    Attributes:
        num_running: requests with a sequence in the running batch.
        num_waiting: requests queued (in the engine's waiting queue, or handed over and not yet added).
        kv_cache_usage: KV blocks held by sequences / blocks in the pool, 0.0 to 1.0.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in the prefix cache / found there.
        num_preemptions: sequences preempted since the engine started.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class _Stream:
    """One request's outputs as the event loop sees them: the latest snapshot, an error, or the end."""

    __slots__ = ("latest", "error", "event")

    def __init__(self):
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()


class AsyncEngine:
    """Serve a model's warm engine to asyncio code: ``generate`` yields a request's outputs as they come.

    Args:
        llm: the loaded ``LLM``; the front holds its engine attached while it runs (``LLM.attached_engine``: the
            model's warm engine, which another call on the model waits for until ``shutdown``, or rank 0's engine
            of a model split over ``tensor_parallel_size`` ranks). The front keeps its own copy of the tokenizer for
            the event loop's side (tokenizing prompts, detokenizing deltas), so the two threads never share one
            tokenizer object.
        max_num_queued_requests: most requests waiting for a seat before ``check_admission`` refuses new ones
            with ``QueueFullError``; None: no limit.

    Call ``start()`` on the event loop that will call ``generate``, and ``shutdown()`` at the end.
    """

    def __init__(self, llm, max_num_queued_requests: int | None = None):
        if max_num_queued_requests is not None and (
            isinstance(max_num_queued_requests, bool) or not isinstance(max_num_queued_requests, int) or max_num_queued_requests < 0
        ):
            raise ValueError(f"max_num_queued_requests must be a non-negative integer or None, got {max_num_queued_requests!r}")
        self._attached_engine = llm.attached_engine
        self.tokenizer = copy.deepcopy(llm.tokenizer) if llm.tokenizer is not None else None
        self.max_num_queued_requests = max_num_queued_requests
        self.engine = None  # set by the stepping thread once attached; read-only (limits) elsewhere
        self.snapshot = EngineSnapshot()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._num_unadded = 0  # requests handed to the stepping thread and not yet added (event-loop side)
        self._counter = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # why the stepping thread died, if it did

    # -- life ----------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the stepping thread (it attaches the engine); returns once the engine is ready.

        Raises:
            whatever attaching the engine raised (e.g. a ValueError for a KV pool too small).
        """
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="paged-transformers-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the stepping thread: unfinished requests are aborted (their blocks freed), the engine detached.
        Safe to call twice."""
        self._stop.set()
        self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout_s)

    def fail_in_flight(self, reason: str) -> None:
        """End every request in flight with ``EngineDeadError(reason)`` (a 503, or an error event and ``[DONE]``
        when streaming) and abort it in the engine, freeing its blocks. Thread-safe: the server's shutdown calls
        it from a timer thread."""
        if self._loop is not None:
            self._post(self._fail_all, EngineDeadError(reason))

    @property
    def is_running(self) -> bool:
        """The stepping thread is alive and accepting requests."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a seat: in the engine's queue at the last snapshot, or handed over and not yet
        added (event loop)."""
        return self.snapshot.num_waiting + self._num_unadded

    # -- requests (event loop) -----------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> SamplingParams:
        """What ``LLMEngine.add_request`` would refuse, checked here (on the engine's fixed limits) so that a bad
        request is refused before it is handed to the stepping thread. Returns the request's own checked copy.

        Raises:
            ValueError: a bad prompt (``engine_inputs.validate_prompt``) or sampling parameters
                (``engine_inputs.check_sampling_params``).
        """
        engine = self.engine
        validate_prompt(prompt_token_ids, engine.vocab_size, engine.max_model_len, engine.config)
        return check_sampling_params(sampling_params, engine.config, engine.vocab_size, self.tokenizer)

    def check_admission(self) -> None:
        """Whether a new request is taken now. A server calls it as a request arrives, before its response starts
        (a streamed response cannot turn into a 503 later); ``generate`` itself only checks that the engine runs.
        So the queue limit is checked at arrival: requests that arrive together may pass it together.

        Raises:
            EngineDeadError: the stepping thread is not running.
            QueueFullError: ``max_num_queued_requests`` requests are waiting.
        """
        self._check_running()
        limit = self.max_num_queued_requests
        if limit is not None and self.num_waiting >= limit:
            raise QueueFullError(f"{limit} requests are already waiting (max_num_queued_requests={limit})")

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self.error!r})" if self.error else "the engine is not running")

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Queue one request and yield its ``RequestOutput``s (cumulative snapshots; the last one has
        ``finished=True``). Leaving the iteration early (a client gone, a cancelled task) aborts the request.

        Raises:
            ValueError: as ``check_request``, before anything is queued.
            EngineDeadError: the stepping thread is not running, or stopped (or the server shut down) mid-request.
            RuntimeError: the engine failed the request (the exception it raised, as the cause).
        """
        self._check_running()
        params = self.check_request(prompt_token_ids, sampling_params)
        self._counter += 1
        request_id = str(self._counter)
        stream = self._streams[request_id] = _Stream()
        self._num_unadded += 1
        self._commands.put(("add", request_id, list(prompt_token_ids), params))
        finished = False
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if isinstance(stream.error, EngineDeadError):  # shut down, or the engine died: as is (a 503)
                    raise stream.error
                if stream.error is not None:
                    raise RuntimeError(f"the engine failed this request: {stream.error}") from stream.error
                output, stream.latest = stream.latest, None
                if output is not None:
                    finished = output.finished
                    yield output
                    if finished:
                        return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    # -- the stepping thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with self._attached_engine() as engine:
                self.engine = engine
                self._publish_snapshot(engine)
                self._ready.set()
                self._step_loop(engine)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request, then logged
            self.error = e
            logger.exception("paged_transformers: the engine's stepping thread failed")
        finally:
            self._stop.set()
            self._ready.set()
            self._post(self._fail_all, self.error or EngineDeadError("the engine was shut down"))

    def _step_loop(self, engine) -> None:
        while True:
            if not self._apply_commands(engine, block=not engine.has_unfinished_requests()):
                return
            if not engine.has_unfinished_requests():
                continue
            outputs = engine.step()
            self._publish_snapshot(engine)
            if outputs:
                self._post(self._dispatch, outputs)

    def _apply_commands(self, engine, block: bool) -> bool:
        """Apply the queued commands (waiting for one when ``block``). Returns False on ``stop``."""
        added = applied = 0
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
            while command[0] != "stop":
                applied += 1
                if command[0] == "add":
                    added += 1
                    self._add(engine, *command[1:])
                else:
                    engine.abort_request(command[1])
                command = self._commands.get_nowait()
            return False
        except queue.Empty:
            return not self._stop.is_set()
        finally:
            if applied:  # published before the loop stops counting the added ones as handed over: never undercounted
                self._publish_snapshot(engine)
            if added:
                self._post(self._added, added)

    def _add(self, engine, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            engine.add_request(request_id, prompt_token_ids, params)
        except Exception as e:  # noqa: BLE001 - checked before (check_request): a failure here is this request's alone
            self._post(self._fail, request_id, e)

    def _publish_snapshot(self, engine) -> None:
        stats = engine.stats()
        running = {seq.request_id for seq in engine.scheduler.running}
        self.snapshot = EngineSnapshot(
            num_running=len(running), num_waiting=len(engine.requests) - len(running),
            kv_cache_usage=stats.num_used_blocks / stats.num_blocks if stats.num_blocks else 0.0,
            prefix_cache_queries=stats.num_prompt_tokens, prefix_cache_hits=stats.num_cached_tokens,
            num_preemptions=stats.num_preemptions,
        )  # fmt: skip

    def _post(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    # -- callbacks on the event loop ------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.latest = output
                stream.event.set()

    def _added(self, count: int) -> None:
        self._num_unadded -= count

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.error = error
            stream.event.set()

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, error)
