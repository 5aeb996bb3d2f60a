"""The server's engine in a process of its own (``AsyncEngine.spawn``, how ``paged-transformers serve`` runs it): the
messages that cross the pipe, a model that fails to load, and an engine process that dies under a running request.
The OpenAI behaviour over it is ``test_server.py``'s (its module server runs this way)."""

import multiprocessing
import time

import pytest

from serving import MODEL, running_server, skip_without_server_deps, sse_events


def test_outputs_cross_the_pipe_whole():
    from paged_transformers.entrypoints.engine_process import decode_message, encode_message
    from paged_transformers.entrypoints.step_loop import EngineSnapshot
    from paged_transformers.outputs import CompletionOutput, RequestMetrics, RequestOutput

    outputs = [
        RequestOutput("1", "a prompt", [5, 6, 7], [CompletionOutput(0, "", [1, 2], -0.5, [{1: -0.2}, {2: -0.3}]),
                                                  CompletionOutput(1, "done", [3], None, None, "stop", "x")],
                      False, RequestMetrics(1.0, 2.0, 3.0), [None, {6: -1.5, 4: -0.5}, {7: -2.0}]),
        RequestOutput("2", None, [8], [CompletionOutput(0, "", [], None, None, "abort", None, ValueError("bad"))],
                      True, RequestMetrics(4.0, None, None, 5.0)),
    ]  # fmt: skip
    kind, got = decode_message(encode_message(("outputs", outputs)))
    assert kind == "outputs" and len(got) == 2
    for a, b in zip(got, outputs):
        assert a.prompt_token_ids is None  # the front fills them in from its own record of the request
        assert (a.request_id, a.prompt, a.finished, a.metrics, a.prompt_logprobs) == (
            b.request_id, b.prompt, b.finished, b.metrics, b.prompt_logprobs)
        assert [c.error is None for c in a.outputs] == [c.error is None for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            assert (ca.index, ca.text, ca.token_ids, ca.cumulative_logprob, ca.logprobs, ca.finish_reason,
                    ca.stop_reason) == (cb.index, cb.text, cb.token_ids, cb.cumulative_logprob, cb.logprobs,
                                        cb.finish_reason, cb.stop_reason)  # fmt: skip
    assert str(got[1].outputs[0].error) == "bad"
    snapshot = ("snapshot", EngineSnapshot(num_running=3))
    assert decode_message(encode_message(snapshot)) == snapshot


def test_pipe_writer_sends_in_order_in_batches_and_flushes_on_close():
    from paged_transformers.entrypoints.engine_process import PipeWriter

    reader, conn = multiprocessing.Pipe(duplex=False)
    writer = PipeWriter(conn, "test-writer")
    for i in range(500):
        writer.put(("n", i))
    writer.close()
    received = []
    while reader.poll(0.5):
        batch = reader.recv()
        assert isinstance(batch, list) and batch
        received += batch
    assert received == [("n", i) for i in range(500)]


def test_pipe_writer_reports_a_message_that_does_not_pickle():
    import threading

    from paged_transformers.entrypoints.engine_process import PipeWriter

    reader, conn = multiprocessing.Pipe(duplex=False)
    writer = PipeWriter(conn, "test-writer")
    writer.put(("ready", threading.Lock()))  # a lock does not pickle
    writer.close()
    assert reader.poll(5)
    ((kind, error),) = reader.recv()
    assert kind == "dead" and "could not be sent" in str(error) and "lock" in str(error)


def test_an_unpicklable_error_crosses_as_its_text():
    from paged_transformers.entrypoints.engine_process import encode_message

    class Local(Exception):  # a class pickle cannot find by name
        pass

    kind, request_id, error = encode_message(("failed", "7", Local("boom")))
    assert (kind, request_id) == ("failed", "7")
    assert isinstance(error, RuntimeError) and "Local: boom" in str(error)


@pytest.mark.slow
def test_a_model_that_fails_to_load_raises_its_error_and_leaves_no_process(tmp_path):
    from paged_transformers.entrypoints.async_engine import AsyncEngine

    missing = tmp_path / "no-such-model"
    with pytest.raises((OSError, ValueError), match="no-such-model"):
        AsyncEngine.spawn(str(missing), {"device": "cpu"})
    deadline = time.monotonic() + 10
    while [p for p in multiprocessing.active_children() if p.name == "paged-transformers-engine"]:
        assert time.monotonic() < deadline, "the engine process is still alive"
        time.sleep(0.1)


def test_a_signal_while_the_engine_process_starts_reaches_the_handler_and_leaves_no_process(tmp_path, monkeypatch):
    """SIGTERM arriving while ``process.start()`` runs (the child exists, its start not finished) is held back, not
    lost: the handler sees it once the start is done, and the half-started engine process is killed."""
    import os
    import signal

    from paged_transformers.entrypoints.async_engine import AsyncEngine

    class Stopped(Exception):
        pass

    def stop(sig, frame):
        raise Stopped(sig)

    start = multiprocessing.get_context("spawn").Process.start

    def start_then_signal(self):
        start(self)
        os.kill(os.getpid(), signal.SIGTERM)  # as a supervisor's SIGTERM in the middle of the spawn
        time.sleep(0.2)  # time for it to arrive: it must not run the handler inside the start

    monkeypatch.setattr(multiprocessing.get_context("spawn").Process, "start", start_then_signal)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(Stopped):  # ignored instead, the spawn would go on to fail to load the missing model
            AsyncEngine.spawn(str(tmp_path / "no-such-model"), {"device": "cpu"})
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGINT, signal.SIGTERM}  # the hold is over
    deadline = time.monotonic() + 10
    while [p for p in multiprocessing.active_children() if p.name == "paged-transformers-engine"]:
        assert time.monotonic() < deadline, "the engine process is still alive"
        time.sleep(0.1)


def test_a_bad_queue_limit_is_refused_before_any_process_starts():
    from paged_transformers.entrypoints.async_engine import AsyncEngine

    with pytest.raises(ValueError, match="max_num_queued_requests"):
        AsyncEngine.spawn("unused", {}, max_num_queued_requests=-1)
    assert not [p for p in multiprocessing.active_children() if p.name == "paged-transformers-engine"]


@pytest.mark.slow
def test_the_engine_process_dying_ends_requests_and_health(smollm2):
    # a running stream ends with an error event and [DONE]; /health and new requests answer 503; nothing hangs
    skip_without_server_deps()
    import httpx

    with running_server(engine_process=True) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        front = server.server.config.app.state.front
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            first = next(lines)
            assert first.startswith("data: {")
            front._process.kill()
            events = sse_events(list(lines)[1:])  # the rest of the stream, after the first event's blank line
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert events[-2]["error"]["code"] == 503 and "exited unexpectedly" in events[-2]["error"]["message"]
        assert http.get("/health").status_code == 503
        response = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert response.status_code == 503, response.text
