"""The server refuses bad requests with OpenAI's error envelope and the right status, and stays healthy: 400 for
malformed or out-of-range input and unserved fields, 401 without the API key, 404 for another model, 413 for a
huge body, 503 with Retry-After when the queue is full. Never a 500; the pool is whole afterwards."""

import json
import logging
import time

import pytest

from serving import MODEL, metric, running_server, skip_without_server_deps, wait_idle

KEY = "secret-key"
GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(smollm2):
    skip_without_server_deps()
    with running_server({"max_num_seqs": 1, "max_model_len": 128}, api_key=KEY, max_num_queued_requests=1,
                        log_requests=True) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
        yield http


def _assert_error(response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


BAD_COMPLETIONS = [
    ({**GOOD, "max_tokens": "many"}, "max_tokens"),
    ({**GOOD, "max_tokens": -1}, "max_tokens"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "temperature": -0.5}, "temperature"),
    ({**GOOD, "top_p": 1.5}, "top_p"),
    ({**GOOD, "presence_penalty": 3}, "presence_penalty"),
    ({**GOOD, "n": 0}, "n"),
    ({**GOOD, "prompt": ""}, "prompt"),
    ({**GOOD, "prompt": []}, "prompt"),
    ({**GOOD, "prompt": [1, 2, 10**7]}, "prompt"),
    ({**GOOD, "prompt": [-1]}, "prompt"),
    ({**GOOD, "prompt": {"text": "x"}}, "prompt"),
    ({**GOOD, "prompt": "word " * 200}, "prompt"),  # over max_model_len=128
    ({**GOOD, "max_tokens": 128}, "max_tokens"),  # prompt + max_tokens over max_model_len
    ({**GOOD, "logprobs": 21}, "logprobs"),
    ({**GOOD, "best_of": 3}, "best_of"),
    ({**GOOD, "suffix": "x"}, "suffix"),
    ({**GOOD, "echo": True, "logprobs": 21}, "logprobs"),
    ({**GOOD, "echo": True, "logprobs": -1}, "logprobs"),
    ({**GOOD, "prompt_logprobs": 1}, "prompt_logprobs"),  # not served as a field: echo with logprobs gives them
    ({**GOOD, "response_format": {"type": "json_schema"}}, "response_format"),
    ({**GOOD, "stop": [""]}, "stop"),
    ({**GOOD, "stop_token_ids": [10**7]}, "stop_token_ids"),
    ({**GOOD, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({**GOOD, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "Hello", "max_tokens": "x", "n": "y"}, "any"),
]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS, ids=[str(i) for i in range(len(BAD_COMPLETIONS))])
def test_bad_completion_requests_are_400(http, body, param):
    _assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({**CHAT, "tool_choice": "auto"}, "tool_choice"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
    ({**CHAT, "max_tokens": -3}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": 10**6}, "max_completion_tokens"),  # prompt + it over max_model_len
])
def test_bad_chat_requests_are_400(http, body, param):
    _assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_malformed_bodies_are_400(http):
    headers = {"Content-Type": "application/json"}
    for content in (b"{not json", b"[1, 2]", b"", "\"text\"".encode(), b"\xff\xfe"):
        _assert_error(http.post("/v1/completions", content=content, headers=headers), 400)
    error = http.post("/v1/completions", content=b'{"model": "x", "prompt": ', headers=headers).json()["error"]
    assert error["param"] is None and "not valid JSON" in error["message"] and "byte 25" in error["message"]


def test_a_wrong_method_is_405_of_a_client_error_type(http):
    error = http.get("/v1/completions").json()["error"]
    assert (error["code"], error["type"]) == (405, "MethodNotAllowedError")


def test_unknown_fields_are_ignored_as_in_vllm(http):
    response = http.post("/v1/completions", json={**GOOD, "some_future_field": 1})
    assert response.status_code == 200 and response.json()["choices"][0]["text"]


def test_a_huge_body_is_413(http):
    huge = json.dumps({**GOOD, "prompt": "x" * (10 << 20)}).encode()
    _assert_error(http.post("/v1/completions", content=huge, headers={"Content-Type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit is counted as it is read
        for start in range(0, len(huge), 1 << 20):
            yield huge[start : start + (1 << 20)]

    _assert_error(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)


def test_api_key_and_model_name(server, http):
    import httpx
    import openai

    _assert_error(httpx.post(server.url + "/v1/completions", json=GOOD), 401)
    _assert_error(httpx.post(server.url + "/v1/completions", json=GOOD, headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(server.url + "/health").status_code == 200  # only /v1 is guarded, as in vLLM
    _assert_error(http.post("/v1/completions", json={**GOOD, "model": "gpt-4"}), 404, "model")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).completions.create(
            model="gpt-4", prompt="x", max_tokens=1)


def test_a_full_queue_is_503_with_retry_after(server, http):
    long = {**GOOD, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=long) as running:
        next(running.iter_lines())  # the one seat (max_num_seqs=1) is taken
        with http.stream("POST", "/v1/completions", json=long) as waiting:
            deadline = time.monotonic() + 30
            while metric(http.get("/metrics").text, "vllm:num_requests_waiting") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            response = http.post("/v1/completions", json=GOOD)
            _assert_error(response, 503)
            assert response.headers["retry-after"] == "1"
            assert waiting.status_code == 200
    wait_idle(http)


def test_a_disconnect_aborts_the_request_and_is_logged(http, caplog):
    caplog.set_level(logging.INFO, logger="paged_transformers.serve")
    with http.stream("POST", "/v1/completions", json={**GOOD, "max_tokens": 100, "ignore_eos": True, "stream": True}) as response:
        next(response.iter_lines())  # running; leaving the block closes the connection
    assert metric(wait_idle(http), "vllm:kv_cache_usage_perc") == 0
    deadline = time.monotonic() + 10
    while not any(r.getMessage().endswith("aborted (its client disconnected, or the server is stopping)")
                  for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.05)


def test_the_server_is_healthy_after_bad_input(http):
    text = wait_idle(http)
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
    response = http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
