"""Helpers of the server tests: a server on the embedded model in a thread, SSE parsing, metrics reading."""

import contextlib
import importlib.util
import json
import re
import time

import pytest

SERVER_DEPS = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "openai", "httpx", "aiohttp")
MODEL = "smol"  # the served model name of the test servers


def skip_without_server_deps() -> None:
    missing = [name for name in SERVER_DEPS if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the server tests need {missing} (pip install 'paged-transformers[test]')")


@contextlib.contextmanager
def running_server(llm_kwargs: dict | None = None, engine_process: bool = False, **app_kwargs):
    """A ``ServerThread`` serving the embedded SmolLM2 (a model object of its own, so the session's ``smollm2``
    fixture stays free) as ``MODEL``; ``engine_process``: its engine in a process of its own (``AsyncEngine.spawn``,
    how ``paged-transformers serve`` runs), else stepped by a thread of this process on an ``LLM`` loaded here."""
    from paged_transformers import LLM
    from paged_transformers.default_model import default_model_path
    from paged_transformers.entrypoints.async_engine import AsyncEngine
    from paged_transformers.entrypoints.openai.api_server import ServerThread, build_app

    kwargs = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512, device="cpu")
    kwargs.update(llm_kwargs or {})
    if engine_process:
        front = AsyncEngine.spawn(str(default_model_path()), kwargs, app_kwargs.pop("max_num_queued_requests", None))
        with ServerThread(build_app(front, [MODEL], **{"log_requests": False, **app_kwargs})) as server:
            yield server
        return
    llm = LLM(str(default_model_path()), **kwargs)
    try:
        with ServerThread(build_app(llm, [MODEL], **{"log_requests": False, **app_kwargs})) as server:
            yield server
    finally:
        llm.close()


def sse_events(lines) -> list:
    """The ``data:`` payloads of an SSE stream (``[DONE]`` kept as the string), checking the framing: every
    event is one ``data: ...`` line followed by a blank line."""
    events, expect_blank = [], False
    for line in lines:
        if expect_blank:
            assert line == "", f"an event line not followed by a blank line: {line!r}"
            expect_blank = False
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
        expect_blank = True
    return events


def metric(text: str, name: str) -> float:
    """The value of the one sample ``name{...}`` in Prometheus exposition ``text`` (summed over label sets)."""
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"no metric {name}"
    return sum(values)


def wait_idle(client, timeout_s: float = 60.0) -> str:
    """Poll ``/metrics`` until no request runs or waits and no KV block is held; the last exposition text."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = client.get("/metrics").text
        busy = [metric(text, n) for n in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")]
        if busy == [0, 0, 0]:
            return text
        assert time.monotonic() < deadline, f"the server is still busy (running, waiting, kv usage) = {busy}"
        time.sleep(0.1)
