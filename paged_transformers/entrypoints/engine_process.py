"""The engine process of ``AsyncEngine.spawn``: ``run_engine_process`` loads the ``LLM`` and runs the ``StepLoop`` on
one end of a pipe; ``encode_message`` / ``decode_message`` are what the loop's messages look like on the pipe.

Each end hands what it sends to a ``PipeWriter`` thread, and the engine process reads its commands in a thread of
their own: the event loop never waits for a full pipe while the engine is inside a step, nor the stepping loop for
a server busy with its streams (vLLM's engine core does its socket I/O in threads likewise). Each pipe message is a
list of messages: a writer sends everything queued since its last send at once."""

import contextlib
import dataclasses
import gc
import logging
import operator
import pickle
import queue
import signal
import threading

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from .step_loop import IDLE_POLL_S, EngineLimits, StepLoop

logger = logging.getLogger("paged_transformers")


def configure_logging() -> None:
    """A server process's log lines (the API server's and the engine process's): ``paged_transformers`` loggers at
    INFO on stderr (per-request lines unless ``--disable-log-requests``, engine start-up, failures), unless the
    application configured them already."""
    package = logging.getLogger("paged_transformers")
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)


def freeze_gc_heap() -> None:
    """Collect, then move every object alive into the garbage collector's permanent generation
    (``gc.freeze``), so that the collections while serving scan only what requests create. Called once by each
    server process (the API server and the engine process) when its start-up is done: their start-up heaps (torch,
    transformers, the model, the tokenizer: some 400,000 tracked objects) made each full collection stall the
    process for 0.2-0.4 s (a CPU machine, a burst of 512 requests). vLLM's servers do the same (its
    ``freeze_gc_heap``). Not for a user's process: the freeze is process-wide."""
    gc.collect()
    gc.freeze()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # the server's to act on; the engine process ignores them


@contextlib.contextmanager
def stop_signals_held():
    """SIGINT and SIGTERM held back meanwhile (in the main thread; elsewhere nothing changes), as CPython starts its
    resource tracker. Blocked, so that a process started now starts with them blocked: one that comes while its
    interpreter starts and imports stays pending until ``run_engine_process`` ignores it (a KeyboardInterrupt
    traceback otherwise). And one that comes to this process meanwhile is neither lost nor raised half-way through
    the start: it reaches this process's own handler when the window ends (a thread that does not block it hands it
    to a recorder, and it is raised again then)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, frame: arrived.append(sig)) for sig in STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        # one pending here is delivered now: to the recorder, or (once restored) to the process's own handler
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in arrived[:1]:
            signal.raise_signal(sig)


def run_engine_process(conn, model, llm_kwargs: dict) -> None:
    """The engine process: load ``LLM(model, **llm_kwargs)``, send ``("ready", limits, tokenizer, default params)``
    (or ``("dead", exception)``), then run the ``StepLoop`` on the pipe ``conn`` until ``("stop",)`` or the pipe
    closes. The server process handles SIGINT and SIGTERM (a graceful shutdown ends with ``stop``), so this one
    ignores both (a terminal's Ctrl+C, or a SIGTERM to the process group, reaches both processes); it started with
    them blocked (``AsyncEngine.spawn``), and unblocks them once they are ignored (one that came meanwhile is dropped)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    configure_logging()
    from .llm import LLM

    commands: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(conn, commands), name="paged-transformers-commands", daemon=True).start()
    writer = PipeWriter(conn, "paged-transformers-outputs")

    def next_command(block: bool):
        try:
            return commands.get(timeout=IDLE_POLL_S) if block else commands.get_nowait()
        except queue.Empty:
            return None

    try:
        llm = LLM(model, **llm_kwargs)
        with llm.attached_engine() as engine:
            loop = StepLoop(engine, next_command, lambda message: writer.put(encode_message(message)))
            loop.prepare()
            freeze_gc_heap()
            writer.put(("ready", EngineLimits.of(engine), llm.tokenizer, llm.get_default_sampling_params()))
            loop.run()
        llm.close()
    except BaseException as e:  # noqa: BLE001 - reported to the server process, which fails its requests
        if isinstance(e, (ValueError, OSError)):  # a bad model or option: its message is the whole story
            logger.error("paged_transformers: the engine process could not start: %s", e)
        else:
            logger.exception("paged_transformers: the engine process failed")
        writer.put(("dead", _picklable(e)))
    finally:
        writer.close()


def _read_commands(conn, commands: queue.SimpleQueue) -> None:
    """The engine process's command reader: each pipe message's commands into ``commands``, then ``("stop",)`` once
    the server process is gone (the pipe closed)."""
    try:
        while True:
            for command in conn.recv():
                commands.put(command)
    except (EOFError, OSError):
        commands.put(("stop",))


class PipeWriter:
    """Sends messages to a pipe from a thread of its own: ``put`` never blocks, and a send carries everything queued
    since the last one, as a list (the reader iterates over it).

    Args:
        conn: a ``multiprocessing`` connection; name: the thread's name.
    """

    def __init__(self, conn, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(conn,), name=name, daemon=True)
        self._thread.start()

    def put(self, message: tuple) -> None:
        """Queue ``message`` (a picklable tuple) to be sent, in order. Thread-safe."""
        self._queue.put(message)

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is queued, then stop the thread (waiting up to ``timeout_s`` seconds for it)."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self, conn) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            messages = [m for m in batch if m is not None]
            if messages:
                try:
                    conn.send(messages)
                except OSError:  # the other end is gone: nothing more can be sent
                    return
                except Exception as e:  # noqa: BLE001 - a message that does not pickle: the other end learns why
                    logger.exception("paged_transformers: a message could not be sent to the other process")
                    try:
                        conn.send([("dead", RuntimeError(f"a message could not be sent: {type(e).__name__}: {e}"))])
                    except Exception:  # noqa: BLE001 - the other end is gone too
                        pass
                    return
            if len(messages) < len(batch):  # close() was called
                return


_completion_row = operator.attrgetter(*(f.name for f in dataclasses.fields(CompletionOutput)))
_metrics_row = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestMetrics)))


def encode_message(message: tuple) -> tuple:
    """A ``StepLoop`` message as it crosses the pipe: outputs as plain tuples (``decode_message`` rebuilds them; a
    step of 256 outputs pickles in a quarter of the dataclasses' time) without their prompt's token ids (the front
    has them), exceptions picklable. ``prompt_logprobs`` go with every output of their request (a known cost: a
    streamed request with them pickles its prompt's logprobs at each step)."""
    if message[0] == "outputs":
        rows = []
        for o in message[1]:
            completions = [_completion_row(c) if c.error is None else _completion_row(c)[:-1] + (_picklable(c.error),)
                           for c in o.outputs]  # fmt: skip
            metrics = None if o.metrics is None else _metrics_row(o.metrics)
            rows.append((o.request_id, o.prompt, completions, o.finished, metrics, o.prompt_logprobs))
        return ("outputs", rows)
    if message[0] == "failed":
        return (message[0], message[1], _picklable(message[2]))
    return message


def decode_message(message: tuple) -> tuple:
    """``encode_message``'s message as the ``StepLoop`` emitted it (outputs with ``prompt_token_ids`` None)."""
    if message[0] != "outputs":
        return message
    return ("outputs", [RequestOutput(request_id, prompt, None, [CompletionOutput(*c) for c in completions], finished,
                                      None if metrics is None else RequestMetrics(*metrics), prompt_logprobs)
                        for request_id, prompt, completions, finished, metrics, prompt_logprobs
                        in message[1]])  # fmt: skip


def _picklable(error: BaseException) -> BaseException:
    """``error`` if it pickles, else a ``RuntimeError`` with its text (it crosses the pipe to the server process)."""
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")
