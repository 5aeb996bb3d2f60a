"""``AsyncEngine``: an asyncio front over a model's warm ``LLMEngine``, for servers.

The engine is not thread-safe, so exactly one thread touches it: the stepping loop (``StepLoop``), which holds the
engine attached for the front's whole life. Everything else talks to it through messages::

    event loop                                   stepping loop (a thread, or the engine process)
    ----------                                   -----------------------------------------------
    add_request(): check_request() on the    ->  commands: ("add", id, ids, params) / ("abort", id) / ("stop",)
    read-only limits, add_checked_request()      apply the commands; engine.step(); snapshot the counters
    per-request OutputSlot (latest output) <---  ("outputs", [RequestOutput, ...]) / ("snapshot", ...) / ...

The loop runs in one of two places:

* ``AsyncEngine(llm)``: a thread of this process, on an ``LLM`` loaded here (tests, ``bench serve --model``, a model
  split over ``tensor_parallel_size`` ranks). The event loop and the stepping thread share the GIL, so under many
  streams the event loop's per-token work (detokenizing, JSON, socket writes) delays the steps: at saturation such
  a server made about a quarter of the offline engine's tokens/s (docs/benchmark-history.md).
* ``AsyncEngine.spawn(model, llm_kwargs)``: a child process that loads the ``LLM`` itself (``multiprocessing``'s
  spawn start), as vLLM runs its engine core in a process of its own; commands and outputs go through a pipe. The
  server (``paged-transformers serve``) runs this way: the steps no longer wait for the HTTP side's Python, and a
  stream that falls behind gets several tokens in one event.

A ``RequestOutput`` is a cumulative snapshot of its request (all tokens so far), so a consumer that falls behind
reads only the latest one and loses nothing: the loop never queues more than one output per request.
Detokenizing deltas and encoding JSON happen in the request handlers on the event loop, never in the stepping loop,
which only steps the engine and hands its outputs over.

A server hands each request over in its handler (``add_request``), not where its streamed body first runs: uvicorn
runs that body as a task of its own, after every task already ready, so in a burst a request handed over there
waited until the event loop had validated the whole clump of requests that came with it (150-400 ms;
docs/benchmark-history.md).
"""

import asyncio
import copy
import logging
import multiprocessing
import queue
import threading
from multiprocessing import resource_tracker

from ..core.engine_inputs import check_sampling_params, validate_prompt
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .engine_process import PipeWriter, decode_message, run_engine_process, stop_signals_held
from .request_stream import CheckedRequest, EngineDeadError, OutputSlot, QueueFullError, RequestStream
from .step_loop import IDLE_POLL_S, EngineLimits, EngineSnapshot, StepLoop

__all__ = ["AsyncEngine", "CheckedRequest", "EngineDeadError", "EngineLimits", "EngineSnapshot", "QueueFullError",
           "RequestStream"]

logger = logging.getLogger("paged_transformers")


class AsyncEngine:
    """Serve a model's warm engine to asyncio code: ``add_request`` hands a request over at once and returns its
    ``RequestStream``, which yields the request's outputs as they come.

    ``AsyncEngine(llm)`` steps the engine in a thread of this process; ``AsyncEngine.spawn(model, llm_kwargs)`` in a
    process of its own (the module docstring says when each fits).

    Args:
        llm: the loaded ``LLM``; the front holds its engine attached while it runs (``LLM.attached_engine``: the
            model's warm engine, which another call on the model waits for until ``shutdown``, or rank 0's engine
            of a model split over ``tensor_parallel_size`` ranks). The front keeps its own copy of the tokenizer for
            the event loop's side (tokenizing prompts, detokenizing deltas), so the two threads never share one
            tokenizer object.
        max_num_queued_requests: most requests waiting for a seat before ``check_admission`` refuses new ones
            with ``QueueFullError``; None: no limit.

    Attributes:
        tokenizer: the event loop's tokenizer; default_sampling_params: the model's (``LLM.get_default_sampling_params``);
        limits: ``EngineLimits`` (set once the engine is ready); snapshot: the latest ``EngineSnapshot``.

    Raises:
        ValueError: a bad ``max_num_queued_requests``.

    Call ``start()`` on the event loop that will call ``add_request``, and ``shutdown()`` at the end.
    """

    def __init__(self, llm, max_num_queued_requests: int | None = None):
        self._init_front(max_num_queued_requests)
        self._attached_engine = llm.attached_engine
        self.tokenizer = copy.deepcopy(llm.tokenizer) if llm.tokenizer is not None else None
        self.default_sampling_params = llm.get_default_sampling_params()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()

    @classmethod
    def spawn(cls, model, llm_kwargs: dict | None = None, max_num_queued_requests: int | None = None) -> "AsyncEngine":
        """A front whose engine runs in a child process (``multiprocessing`` spawn; vLLM's engine-core process),
        which loads ``LLM(model, **llm_kwargs)`` and captures its decode CUDA graphs; returns once it is ready.

        Args:
            model: what ``LLM`` takes as ``model`` (a checkpoint folder or a cached hub id; it must pickle).
            llm_kwargs: ``LLM``'s other arguments (``tokenizer``, ``dtype``, ``max_model_len``, ...).
            max_num_queued_requests: as ``AsyncEngine``.

        Raises:
            ValueError: a bad ``max_num_queued_requests`` (before the process starts).
            whatever ``LLM`` raised in the child (a missing model, a bad option), or RuntimeError when the child
            exited before it was ready.
        """
        front = cls.__new__(cls)
        front._init_front(max_num_queued_requests)
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        process = context.Process(target=run_engine_process, args=(child_conn, model, dict(llm_kwargs or {})),
                                  name="paged-transformers-engine", daemon=True)  # fmt: skip
        # the child's start is shielded from a terminal's Ctrl+C or a SIGTERM to the process group (timeout,
        # systemd), which stop the server alone: it drains its requests, then stops the child (kill() when it must:
        # the child ignores SIGTERM). The resource tracker (which CPython starts on the first spawn) first: its own
        # start would end the hold early.
        resource_tracker.ensure_running()
        try:
            with stop_signals_held():
                process.start()
            child_conn.close()
            message = None
            while message is None:
                try:
                    messages = conn.recv()
                except (EOFError, OSError):
                    process.join(30)
                    messages = [("dead", RuntimeError(f"the engine process exited (code {process.exitcode}) before "
                                                      "it was ready"))]  # fmt: skip
                for m in messages:  # snapshots, then "ready" (or "dead"), which is the last message until requests come
                    if m[0] == "snapshot":
                        front.snapshot = m[1]
                    else:
                        message = m
        except BaseException:  # interrupted while the model loads (a signal): the process goes too
            if process.pid is not None:
                process.kill()
                process.join(30)
            child_conn.close()
            conn.close()
            raise
        if message[0] != "ready":
            process.join(30)
            conn.close()
            raise message[1]
        _, front.limits, front.tokenizer, front.default_sampling_params = message
        front._process, front._conn = process, conn
        front._writer = PipeWriter(conn, "paged-transformers-commands")
        return front

    def _init_front(self, max_num_queued_requests) -> None:
        if max_num_queued_requests is not None and (
            isinstance(max_num_queued_requests, bool) or not isinstance(max_num_queued_requests, int) or max_num_queued_requests < 0
        ):
            raise ValueError(f"max_num_queued_requests must be a non-negative integer or None, got {max_num_queued_requests!r}")
        self.max_num_queued_requests = max_num_queued_requests
        self.limits: EngineLimits | None = None
        self.snapshot = EngineSnapshot()
        self._process = None  # the engine process (spawn), or None: the stepping thread
        self._streams: dict[str, OutputSlot] = {}
        self._num_unadded = 0  # requests handed to the stepping loop and not yet added (event-loop side)
        self._counter = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None  # the stepping thread, or the engine process's reader
        self._ready = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # why the stepping loop died, if it did

    # -- life ----------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the stepping thread (it attaches the engine and captures its decode CUDA graphs; an engine process
        already has: this starts the thread that reads its messages); returns once the engine is ready.

        Raises:
            whatever attaching the engine raised (e.g. a ValueError for a KV pool too small).
        """
        self._loop = loop or asyncio.get_running_loop()
        target = self._read_process if self._process is not None else self._run
        self._thread = threading.Thread(target=target, name="paged-transformers-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the stepping loop: unfinished requests are aborted (their blocks freed), the engine detached (an
        engine process exits). Safe to call twice."""
        self._stop.set()
        self._send(("stop",))
        if self._process is not None:
            self._writer.close(timeout_s)
            self._process.join(timeout_s)
            if self._process.is_alive():
                logger.warning("paged_transformers: the engine process did not stop within %.0f s; killing it", timeout_s)
                self._process.kill()
                self._process.join(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._process is not None:
            self._conn.close()

    def fail_in_flight(self, reason: str) -> None:
        """End every request in flight with ``EngineDeadError(reason)`` (a 503, or an error event and ``[DONE]``
        when streaming) and abort it in the engine, freeing its blocks. Thread-safe: the server's shutdown calls
        it from a timer thread."""
        if self._loop is not None:
            self._post(self._fail_all, EngineDeadError(reason))

    @property
    def is_running(self) -> bool:
        """The stepping loop is alive and accepting requests."""
        alive = self._thread is not None and self._thread.is_alive()
        if self._process is not None:
            alive = alive and self._process.is_alive()
        return alive and not self._stop.is_set()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a seat: in the engine's queue at the last snapshot, or handed over and not yet
        added (event loop)."""
        return self.snapshot.num_waiting + self._num_unadded

    # -- requests (event loop) -----------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> CheckedRequest:
        """What ``LLMEngine.add_request`` would refuse, checked here (on the engine's fixed limits) so that a bad
        request is refused before it is handed to the stepping loop. Returns the request's checked copies, for
        ``add_checked_request``: a server checks every prompt of a call before it hands any over, then hands them
        over without checking again.

        Raises:
            ValueError: a bad prompt (``engine_inputs.validate_prompt``) or sampling parameters
                (``engine_inputs.check_sampling_params``).
        """
        limits = self.limits
        prompt_token_ids = list(prompt_token_ids)
        validate_prompt(prompt_token_ids, limits.vocab_size, limits.max_model_len, limits.config)
        return CheckedRequest(prompt_token_ids,
                              check_sampling_params(sampling_params, limits.config, limits.vocab_size, self.tokenizer))

    def check_admission(self) -> None:
        """Whether a new request is taken now. A server calls it as a request arrives, before its response starts
        (a streamed response cannot turn into a 503 later); ``add_request`` itself only checks that the engine runs.
        So the queue limit is checked at arrival: requests that arrive together may pass it together.

        Raises:
            EngineDeadError: the stepping loop is not running.
            QueueFullError: ``max_num_queued_requests`` requests are waiting.
        """
        self._check_running()
        limit = self.max_num_queued_requests
        if limit is not None and self.num_waiting >= limit:
            raise QueueFullError(f"{limit} requests are already waiting (max_num_queued_requests={limit})")

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self.error!r})" if self.error else "the engine is not running")

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> "RequestStream":
        """Check one request (``check_request``) and hand it to the stepping loop now (``add_checked_request``); its
        outputs come through the returned ``RequestStream`` (vLLM's ``AsyncLLM.add_request`` and its output
        collector). Whoever holds the stream must ``close`` it.

        Raises:
            ValueError: as ``check_request``, before anything is queued.
            EngineDeadError: the stepping loop is not running.
        """
        return self.add_checked_request(self.check_request(prompt_token_ids, sampling_params))

    def add_checked_request(self, request: CheckedRequest) -> "RequestStream":
        """Hand a request that ``check_request`` returned to the stepping loop now, without checking it again. A
        server hands a request over in its handler, so that the engine has it while the event loop is still taking in
        the rest of a burst (the streamed response's body runs later, as a task of its own).

        Raises:
            TypeError: ``request`` is not a ``CheckedRequest``.
            EngineDeadError: the stepping loop is not running.
        """
        if not isinstance(request, CheckedRequest):
            raise TypeError(f"add_checked_request takes what check_request returns, got {type(request).__name__}")
        self._check_running()
        self._counter += 1
        request_id = str(self._counter)
        stream = self._streams[request_id] = OutputSlot(request.prompt_token_ids)
        self._num_unadded += 1
        self._send(("add", request_id, *request))
        return RequestStream(self, request_id, stream)

    def _release(self, request_id: str, finished: bool) -> None:
        """A ``RequestStream`` is done with: forget it, and abort the request unless it finished."""
        self._streams.pop(request_id, None)
        if not finished:
            self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        """Hand a command to the stepping loop (its queue, or the engine process's pipe)."""
        if self._process is None:
            self._commands.put(command)
        else:  # sent by the writer thread; when the process is gone, its reader fails the requests in flight
            self._writer.put(command)

    # -- the stepping thread, or the engine process's reader ------------------------------------------
    def _run(self) -> None:
        try:
            with self._attached_engine() as engine:
                self.limits = EngineLimits.of(engine)
                step_loop = StepLoop(engine, self._next_command, self._deliver, self._stop.is_set)
                step_loop.prepare()
                self._ready.set()
                step_loop.run()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request, then logged
            self.error = e
            logger.exception("paged_transformers: the engine's stepping thread failed")
        finally:
            self._stop.set()
            self._ready.set()
            self._post(self._fail_all, self.error or EngineDeadError("the engine was shut down"))

    def _next_command(self, block: bool) -> tuple | None:
        try:
            return self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return None

    def _read_process(self) -> None:
        """The reader thread of an engine process: deliver its messages until it dies or closes the pipe."""
        self._ready.set()
        try:
            while True:
                for message in self._conn.recv():
                    if message[0] == "dead":
                        self.error = message[1]
                        logger.error("paged_transformers: the engine process failed: %r", self.error)
                        return
                    self._deliver(decode_message(message))
        except (EOFError, OSError):
            if not self._stop.is_set():  # not a shutdown: the process died (killed, out of memory, a crash)
                self._process.join(5)  # reaped, for its exit code
                self.error = EngineDeadError(f"the engine process exited unexpectedly (exit code {self._process.exitcode})")
                logger.error("paged_transformers: %s", self.error)
        finally:
            self._stop.set()
            self._post(self._fail_all, self.error or EngineDeadError("the engine was shut down"))

    def _deliver(self, message: tuple) -> None:
        """A ``StepLoop`` message, in the thread that received it: counters set here, the rest posted to the loop."""
        kind = message[0]
        if kind == "snapshot":
            self.snapshot = message[1]
        elif kind == "outputs":
            self._post(self._dispatch, message[1])
        elif kind == "added":
            self._post(self._added, message[1])
        else:
            assert kind == "failed", message
            self._post(self._fail, message[1], message[2])

    def _post(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except (RuntimeError, AttributeError):  # the event loop is closed (or never started): nobody is waiting
            pass

    # -- callbacks on the event loop ------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                if output.prompt_token_ids is None:  # an engine process sends outputs without the prompt
                    output.prompt_token_ids = stream.prompt_token_ids
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
