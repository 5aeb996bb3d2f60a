"""The OpenAI-compatible HTTP server: FastAPI routes over an ``AsyncEngine``, run by uvicorn.

Launch it as ``paged-transformers serve MODEL [options]`` or, with vLLM's module path,
``python -m paged_transformers.entrypoints.openai.api_server --model MODEL [options]`` (``cli_args.py``).

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (JSON, or server-sent events with ``stream``),
``/v1/models`` and ``/v1/models/{id}``, ``/tokenize``, ``/detokenize``, ``/health``, ``/version``, ``/metrics``
(Prometheus, vLLM's names).
Errors use OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request, 401 for a
missing or wrong API key, 404 for an unknown model, 413 for a body over ``--max-request-body-bytes``, 503 (with
``Retry-After``) while ``--max-num-queued-requests`` requests wait. SIGTERM stops accepting connections, lets the
requests in flight finish (up to ``SHUTDOWN_TIMEOUT_S``; then they end as 503s, an error event and ``[DONE]`` when
streamed, and are aborted: ``GracefulServer``), stops the engine and exits 0. An engine that dies on its own ends
the requests in flight as 503s and the server exits 1.
"""

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from ...default_model import DEFAULT_MODEL_NAME, default_model_path
from ...hub import resolve_model_path
from ..async_engine import AsyncEngine, EngineDeadError, QueueFullError
from ..engine_process import configure_logging, freeze_gc_heap
from ..llm import LLM
from .cli_args import DEFAULT_MAX_BODY_BYTES, llm_arguments, make_arg_parser
from .metrics import CONTENT_TYPE, ServerMetrics
from .middleware import RequestGuard
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_engine import ClientDisconnected, ServingError, check_text

logger = logging.getLogger("paged_transformers.serve")

SHUTDOWN_TIMEOUT_S = 10.0  # seconds a SIGTERM waits for requests in flight before aborting them
FLUSH_TIMEOUT_S = 5.0  # then seconds the aborted requests get to send their 503 / last event before uvicorn cancels


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGTERM, SIGINT, ``should_exit``) gives the requests in flight
    ``SHUTDOWN_TIMEOUT_S`` to finish, then ends the rest through the engine (``AsyncEngine.fail_in_flight``: a 503
    envelope, or an error event and ``[DONE]`` when streaming, their blocks freed) and only after ``FLUSH_TIMEOUT_S``
    more lets uvicorn cancel what is left.

    With ``exit_on_engine_death`` (the CLI server), an engine that stops by itself (its process killed, a failed
    step) shuts the server down too, and ``engine_died`` is set: a server that can only answer 503 exits, so that a
    supervisor restarts it (vLLM's server does the same).
    """

    def __init__(self, app: FastAPI, exit_on_engine_death: bool = False, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S + FLUSH_TIMEOUT_S, **config))
        self._front = app.state.front
        self._timer: threading.Timer | None = None
        self.exit_on_engine_death = exit_on_engine_death
        self.engine_died = False

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's check, every 0.1 s, whether to exit; here also whether the engine died (when watched)."""
        if (self.exit_on_engine_death and not self.engine_died and not self.should_exit
                and self._front.error is not None and not self._front.is_running):  # fmt: skip
            self.engine_died = True
            logger.error("paged_transformers: the engine stopped (%s); shutting the server down", self._front.error)
            self.begin_shutdown()
        return await super().on_tick(counter)

    def begin_shutdown(self) -> None:
        """Stop accepting and start the drain (idempotent)."""
        self.should_exit = True
        if self._timer is None:
            self._timer = threading.Timer(SHUTDOWN_TIMEOUT_S, self._front.fail_in_flight,
                                          args=("the server is shutting down",))  # fmt: skip
            self._timer.daemon = True
            self._timer.start()

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self.begin_shutdown()


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _respond(result) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return _SSEResponse(result, media_type="text/event-stream")


class _SSEResponse(StreamingResponse):
    """A streamed response that closes its body (``SSEStream.aclose``: its engine requests aborted unless they
    finished) however it ends, also when it never sent a byte (the client left first)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def build_app(llm: LLM | AsyncEngine, served_model_names: list[str] | None = None, *, api_key: str | None = None,
              chat_template: str | None = None, max_num_queued_requests: int | None = None, log_requests: bool = True,
              max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:  # fmt: skip
    """The server's ASGI app: its engine's stepping loop starts with the app (lifespan) and stops with it.

    Args:
        llm: a loaded ``LLM`` (its engine steps in a thread of this process: ``AsyncEngine(llm)``), or an
            ``AsyncEngine`` not started yet (``AsyncEngine.spawn``: the engine in a process of its own). It needs a
            tokenizer.
        served_model_names: names a request's ``model`` may take; default ``[DEFAULT_MODEL_NAME]``.
        api_key: when set, ``/v1`` endpoints need ``Authorization: Bearer <api_key>``.
        chat_template: a Jinja template replacing the tokenizer's.
        max_num_queued_requests: see ``AsyncEngine`` (with an ``AsyncEngine``: given to it instead).
        log_requests: log each request at INFO.
        max_request_body_bytes: larger bodies get a 413.

    Raises:
        ValueError: no tokenizer, a bad ``max_num_queued_requests``, or one given with an ``AsyncEngine``.
    """
    if isinstance(llm, AsyncEngine) and max_num_queued_requests is not None:
        raise ValueError("max_num_queued_requests is the AsyncEngine's: give it to AsyncEngine.spawn / AsyncEngine()")
    if llm.tokenizer is None:
        raise ValueError("the server needs a tokenizer (an LLM built with skip_tokenizer_init=True has none)")
    names = list(served_model_names or [DEFAULT_MODEL_NAME])
    front = llm if isinstance(llm, AsyncEngine) else AsyncEngine(llm, max_num_queued_requests)
    metrics = ServerMetrics(front, names[0])
    common = (front, names, front.default_sampling_params, metrics, log_requests)
    completion = OpenAIServingCompletion(*common)
    chat = OpenAIServingChat(*common, chat_template=chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        front.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            front.shutdown()

    app = FastAPI(title="paged-transformers", version=__version__, lifespan=lifespan)
    app.state.front, app.state.metrics = front, metrics
    _add_error_handlers(app)
    _add_routes(app, front, names, completion, chat, metrics)
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_request_body_bytes)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServingError)
    async def serving_error(request, e: ServingError):
        return _error(e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":  # its loc is the byte offset, not a field
            position = first.get("loc", ("body", "?"))[-1]
            return _error(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')} "
                               f"at byte {position})")  # fmt: skip
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: {err.get('msg')}"
                            for err in errors[:5])  # fmt: skip
        return _error(400, message or "invalid request", loc[0] if loc else None)

    @app.exception_handler(QueueFullError)
    async def queue_full(request, e: QueueFullError):
        return _error(503, str(e), None, {"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request, e: EngineDeadError):
        return _error(503, str(e), None, {"Retry-After": "5"})

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request, e: ClientDisconnected):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), None, getattr(e, "headers", None))


def _add_routes(app: FastAPI, front: AsyncEngine, names: list[str], completion, chat, metrics: ServerMetrics) -> None:
    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        front.check_admission()
        return _respond(await completion.create_completion(request, raw_request, raw_request.headers.get("x-request-id")))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        front.check_admission()
        return _respond(await chat.create_chat_completion(request, raw_request, raw_request.headers.get("x-request-id")))

    created = int(time.time())  # the models' "created": when this app was built (the server's start), seconds

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "paged-transformers", "root": names[0],
                "max_model_len": front.limits.max_model_len}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(name) for name in names]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):  # OpenAI's "retrieve model" (``client.models.retrieve``); ids may hold "/"
        if model not in names:
            raise ServingError(404, f"The model `{model}` does not exist.", "model")
        return model_card(model)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        if (request.prompt is None) == (request.messages is None):
            raise ServingError(400, "give exactly one of prompt and messages", "prompt")
        check_text(request)
        if request.messages is not None:
            ids = chat.render(request.messages, request.add_generation_prompt)
        else:
            ids = list(completion.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens).input_ids)
        return {"count": len(ids), "max_model_len": front.limits.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        vocab_size = front.limits.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ServingError(400, f"tokens outside the vocabulary [0, {vocab_size}): {bad[:5]}", "tokens")
        return {"prompt": completion.tokenizer.decode(request.tokens)}

    @app.get("/health")
    async def health():
        return Response(status_code=200 if front.is_running else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's contents, or the value itself when it is no file."""
    if value is not None and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def served_model(args) -> tuple[str, list[str]]:
    """The model the parsed options name (the embedded default when none) and the served model names
    (``--served-model-name``, else the model argument, else ``DEFAULT_MODEL_NAME``)."""
    model = args.model if args.model is not None else str(default_model_path())
    return model, args.served_model_name or [args.model or DEFAULT_MODEL_NAME]


def load_front(args) -> tuple[AsyncEngine, list[str]]:
    """The engine front of the parsed options, not started, and the served model names (``served_model``). The
    model (``LLM``: GPTQ/AWQ folders natively) loads in an engine process of its own (``AsyncEngine.spawn``), or,
    with ``--tensor-parallel-size`` > 1 (whose ranks are processes already), here, stepped by a thread.

    Raises:
        ValueError, OSError: as ``LLM`` (a bad option, a missing model, a ``--tensor-parallel-size`` the model's
            heads or the devices do not allow).
    """
    model, names = served_model(args)
    if args.tensor_parallel_size > 1:
        return AsyncEngine(LLM(model, **llm_arguments(args)), args.max_num_queued_requests), names
    model = resolve_model_path(model)  # a missing folder or uncached id fails here, before a process starts
    return AsyncEngine.spawn(model, llm_arguments(args), args.max_num_queued_requests), names


def app_from_args(args) -> FastAPI:
    """The app of the parsed options (``load_front``, then ``build_app``)."""
    front, names = load_front(args)
    return build_app(front, names, api_key=args.api_key, chat_template=_chat_template(args.chat_template),
                     log_requests=not args.disable_log_requests, max_request_body_bytes=args.max_request_body_bytes)


class _StoppedDuringStartUp(Exception):
    """SIGTERM or SIGINT arrived while the model was loading (before uvicorn handles the signals)."""


def _stop_start_up(sig, frame):
    raise _StoppedDuringStartUp(signal.Signals(sig).name)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one), for uvicorn to listen on. Raises an OSError naming
    ``host:port`` when the address cannot be bound (a port in use, an address not of this machine)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free again
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e} (another server there? --port picks "
                      "another port, --host another address)") from e
    return sock


def run_server(args) -> int:
    """Serve until SIGTERM or SIGINT (graceful: see the module docstring); one that arrives while the model loads
    stops the engine process and exits too. Returns the exit status: 0, or 1 when the server did not start or
    stopped because its engine died.

    Raises:
        OSError: ``--host``/``--port`` cannot be bound (``listen_socket``), raised before the model loads.
    """
    sock = listen_socket(args.host, args.port)  # as vLLM: the address is taken before the model loads
    configure_logging()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_start_up)
    try:
        app = app_from_args(args)  # AsyncEngine.spawn ends its process when this is interrupted
    except _StoppedDuringStartUp as e:
        logger.info("paged_transformers: %s during start-up; stopped", e)
        sock.close()
        return 0
    # uvicorn re-raises the signal it stopped on once it is done; the shutdown is complete by then, so let that
    # raise be a no-op and exit 0 (the default SIGTERM action would end the process with -15)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    freeze_gc_heap()
    server = GracefulServer(app, exit_on_engine_death=True, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level)
    server.run(sockets=[sock])
    return 0 if server.started and not server.engine_died else 1


class ServerThread:
    """The server on a free port in a background thread of this process (tests; ``bench serve --model``)::

        with ServerThread(build_app(llm)) as server:
            openai.OpenAI(base_url=server.url + "/v1", api_key="-")...

    Args:
        app: the ASGI app (``build_app``).
        host: the address to listen on; ``port`` 0: a free port (``.port`` says which).
        log_level: uvicorn's.

    Raises (on entering):
        RuntimeError: the server did not start (its lifespan failed: the log says why) within ``start_timeout_s``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 start_timeout_s: float = 300.0):  # fmt: skip
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = GracefulServer(app, log_level=log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True,
                                       name="paged-transformers-server")  # fmt: skip
        self.start_timeout_s = start_timeout_s

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start (see its log)")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Shut down as on SIGTERM (graceful), and wait for it."""
        self.server.begin_shutdown()
        self.thread.join()
        self.socket.close()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m paged_transformers.entrypoints.openai.api_server --model MODEL [options]``."""
    args = make_arg_parser("python -m paged_transformers.entrypoints.openai.api_server").parse_args(argv)
    return run_server(args)


if __name__ == "__main__":
    sys.exit(main())
