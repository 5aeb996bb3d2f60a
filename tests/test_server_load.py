"""The server under bounded load, and its shutdown.

64 concurrent clients send 4 requests each, streamed or not, with random sampling parameters (a few of them
invalid), and 10% of the streams disconnect mid-way: every response is well formed, no status is outside
200/400/503, the KV pool is whole afterwards (metrics) and the server healthy. Then the real command's process
under SIGTERM: it finishes the request in flight, stops accepting, and exits 0.
"""

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from serving import MODEL, metric, running_server, skip_without_server_deps, sse_events, wait_idle

NUM_CLIENTS, REQUESTS_PER_CLIENT = 64, 4
pytestmark = pytest.mark.slow  # each test starts a server


@pytest.fixture(scope="module")
def server(smollm2):
    skip_without_server_deps()
    with running_server({"max_num_seqs": 32}, max_num_queued_requests=48) as server:
        yield server


def _random_request(rng: random.Random) -> tuple[str, dict]:
    params = {"model": MODEL, "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0.7, 1.0]),
              "top_p": rng.choice([1.0, 0.9]), "seed": rng.choice([None, rng.randint(0, 99)]),
              "n": rng.choice([1, 1, 2]), "stream": rng.random() < 0.5}  # fmt: skip
    if rng.random() < 0.3:
        params.update(top_k=rng.choice([0, 5, 50]), min_p=rng.choice([0.0, 0.05]), repetition_penalty=1.1)
    if rng.random() < 0.2:
        params["stop"] = rng.choice(["\n", ".", [" the", ","]])
    if rng.random() < 0.05:
        params["temperature"] = -1.0  # invalid: a 400
    if rng.random() < 0.5:
        return "/v1/completions", {**params, "prompt": rng.choice(["Hello", "The weather today", "1, 2, 3,"]),
                                   "logprobs": rng.choice([None, 2])}  # fmt: skip
    return "/v1/chat/completions", {**params, "messages": [{"role": "user", "content": rng.choice(["Hi", "Name a color"])}]}


def _check_whole(path: str, body: dict, payload: dict) -> None:
    n = body["n"]
    assert sorted(c["index"] for c in payload["choices"]) == list(range(n)), payload
    assert all(c["finish_reason"] in ("stop", "length") for c in payload["choices"]), payload
    usage = payload["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"]
    assert 0 < usage["completion_tokens"] <= n * body["max_tokens"]


def _check_stream(body: dict, events: list) -> None:
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1], events[-3:]
    finished = [c["index"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")]
    assert sorted(finished) == list(range(body["n"])), events  # exactly once per choice


async def _client(http, rng: random.Random, statuses: list) -> None:
    for _ in range(REQUESTS_PER_CLIENT):
        path, body = _random_request(rng)
        disconnect = body["stream"] and rng.random() < 0.1
        async with http.stream("POST", path, json=body) as response:
            statuses.append(response.status_code)
            if response.status_code != 200:
                error = json.loads(await response.aread())["error"]
                assert error["code"] == response.status_code and error["message"]
                continue
            if not body["stream"]:
                _check_whole(path, body, json.loads(await response.aread()))
                continue
            lines = []
            async for line in response.aiter_lines():
                lines.append(line)
                if disconnect and len(lines) >= 2:
                    break  # leave mid-stream: closing the response drops the connection
            if not disconnect:
                _check_stream(body, sse_events(lines))


def test_bounded_load_with_disconnects(server):
    import httpx

    async def run() -> list[int]:
        statuses: list[int] = []
        limits = httpx.Limits(max_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
            await asyncio.gather(*(_client(http, random.Random(i), statuses) for i in range(NUM_CLIENTS)))
        return statuses

    statuses = asyncio.run(asyncio.wait_for(run(), timeout=420))
    assert len(statuses) == NUM_CLIENTS * REQUESTS_PER_CLIENT
    assert set(statuses) <= {200, 400, 503}, sorted(set(statuses))
    assert statuses.count(200) > len(statuses) // 2
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as http:
        text = wait_idle(http)
        assert metric(text, "vllm:kv_cache_usage_perc") == 0
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200


def _wait_healthy(process: subprocess.Popen, url: str, timeout_s: float = 180.0) -> None:
    """Until ``url``/health answers 200; fails when the server exits or ``timeout_s`` seconds pass first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, process.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="signals a process group")
def test_sigterm_finishes_in_flight_requests_and_exits_0(smollm2, tmp_path):
    """SIGTERM to the server's whole process group (as `timeout` and systemd send it; the engine process ignores it):
    a short request in flight finishes; two that would outlast the 10 s drain (one streamed) end as a 503 (an error
    event and [DONE] when streamed), with no traceback; the process exits 0."""
    skip_without_server_deps()
    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "paged_transformers.entrypoints.openai.api_server", "--port", str(port),
               "--served-model-name", MODEL, "--max-model-len", "2048", "--device", "cpu", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # cwd outside the checkout: `-m` puts the working directory first on sys.path (CI tests the installed wheel)
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(process, url)
        # two requests too long to finish within the shutdown's 10 s: they end as 503s, not as cancelled tasks
        long = {"model": MODEL, "prompt": "Once", "max_tokens": 2000, "ignore_eos": True}
        results = {}

        def post_long(name, stream):
            with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": stream}, timeout=120) as r:
                results[name] = (r.status_code, list(r.iter_lines()))

        threads = [threading.Thread(target=post_long, args=(name, name == "stream")) for name in ("json", "stream")]
        for thread in threads:
            thread.start()
        body = {"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 24, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(lines)
            os.killpg(process.pid, signal.SIGTERM)
            events = sse_events([first, *lines])
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        for thread in threads:
            thread.join(60)
        status, body_lines = results["json"]
        assert status == 503 and json.loads("".join(body_lines))["error"]["type"] == "ServiceUnavailableError"
        status, stream_lines = results["stream"]
        stream_events = sse_events(stream_lines)
        assert status == 200 and stream_events[-1] == "[DONE]" and stream_events[-2]["error"]["code"] == 503
        out = process.communicate(timeout=60)[0]
        assert process.returncode == 0, out
        assert "Traceback" not in out and "CancelledError" not in out and "exited unexpectedly" not in out, out
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=1)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (Linux ``/proc``)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return children


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads child processes from /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_stops_the_engine_process_and_exits_0(smollm2, tmp_path, sig):
    """SIGTERM or SIGINT while the engine process still loads the model: the server exits 0 at once and its engine
    process (and multiprocessing's helper) go with it."""
    skip_without_server_deps()
    command = [sys.executable, "-m", "paged_transformers.entrypoints.openai.api_server", "--port", str(_free_port()),
               "--max-model-len", "256", "--device", "cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_children(process.pid)) < 2:  # the resource tracker and the engine process
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "no engine process started"
            time.sleep(0.05)
        children = _children(process.pid)
        process.send_signal(sig)
        out = process.communicate(timeout=60)[0]
        assert process.returncode == 0, out
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in children):
            assert time.monotonic() < deadline, f"left behind: {[pid for pid in children if _alive(pid)]}"
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _shielded(pid: int, sig: int) -> bool:
    """Whether ``sig`` is ignored or blocked in ``pid`` (blocked from its start until it ignores it itself)."""
    with open(f"/proc/{pid}/status") as f:
        masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigIgn:", "SigBlk:"))]
    return any(mask & (1 << (sig - 1)) for mask in masks)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads child processes from /proc")
def test_ctrl_c_during_start_up_reaches_the_server_alone(smollm2, tmp_path):
    """A terminal's Ctrl+C (SIGINT to the whole process group) while the model loads: the server stops its engine
    process and exits 0, and the engine process prints no KeyboardInterrupt traceback: it (and multiprocessing's
    resource tracker) start with SIGINT blocked until they ignore it."""
    skip_without_server_deps()
    command = [sys.executable, "-m", "paged_transformers.entrypoints.openai.api_server", "--port", str(_free_port()),
               "--max-model-len", "256", "--device", "cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_children(process.pid)) < 2:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "no engine process started"
            time.sleep(0.01)
        for pid in _children(process.pid):  # from their first moment (the imports take seconds)
            assert _shielded(pid, signal.SIGINT) and _shielded(pid, signal.SIGTERM), pid
        time.sleep(0.5)  # the engine process is importing or loading
        os.killpg(process.pid, signal.SIGINT)
        out = process.communicate(timeout=60)[0]
        assert process.returncode == 0, out
        assert "KeyboardInterrupt" not in out and "Traceback" not in out, out
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads child processes from /proc")
def test_the_server_exits_1_when_its_engine_process_dies(smollm2, tmp_path):
    """The engine process killed under a running stream: the stream ends with a 503 error event and [DONE], and the
    server shuts itself down with exit status 1 (a supervisor's cue to restart it), naming the engine's exit."""
    skip_without_server_deps()
    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "paged_transformers.entrypoints.openai.api_server", "--port", str(port),
               "--served-model-name", MODEL, "--max-model-len", "1024", "--device", "cpu", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(process, url)
        engine = [pid for pid in _children(process.pid) if b"resource_tracker" not in open(f"/proc/{pid}/cmdline", "rb").read()]
        assert len(engine) == 1, engine
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(lines)
            os.kill(engine[0], signal.SIGKILL)
            events = sse_events([first, *lines])
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503, events[-3:]
        out = process.communicate(timeout=60)[0]
        assert process.returncode == 1, out
        assert "exited unexpectedly (exit code -9)" in out and "shutting the server down" in out, out
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

