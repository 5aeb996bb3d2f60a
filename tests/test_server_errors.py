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
    # strict types: a string or a number for a boolean, a fraction or a string for an integer used to be coerced
    ({**GOOD, "stream": "yes"}, "stream"),
    ({**GOOD, "stream": 1}, "stream"),
    ({**GOOD, "echo": "1"}, "echo"),
    ({**GOOD, "ignore_eos": "true"}, "ignore_eos"),
    ({**GOOD, "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({**GOOD, "skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({**GOOD, "skip_special_tokens": False}, "skip_special_tokens"),  # not served: special tokens are always skipped
    ({**GOOD, "n": 1.5}, "n"),
    ({**GOOD, "n": "1"}, "n"),
    ({**GOOD, "max_tokens": 1.5}, "max_tokens"),
    ({**GOOD, "max_tokens": "2"}, "max_tokens"),
    ({**GOOD, "logprobs": "1"}, "logprobs"),
    ({**GOOD, "min_tokens": 1.0}, "min_tokens"),
    ({**GOOD, "top_k": "5"}, "top_k"),
    ({**GOOD, "temperature": True}, "temperature"),
    ({**GOOD, "temperature": "0.5"}, "temperature"),
    ({**GOOD, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({**GOOD, "seed": 2**64}, "seed"),  # over the 64-bit range
    ({**GOOD, "seed": -(2**63) - 1}, "seed"),
    ({**GOOD, "logit_bias": {"1": 101}}, "logit_bias"),  # used to be clamped to 100
    ({**GOOD, "logit_bias": {"1": -100.5}}, "logit_bias"),
    ({**GOOD, "logit_bias": {"1": "5"}}, "logit_bias"),
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
    ({**CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),  # used to reach the template
    ({**CHAT, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "logprobs": "yes"}, "logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
    ({**CHAT, "max_tokens": 2.5}, "max_tokens"),
    ({**CHAT, "add_generation_prompt": "no"}, "add_generation_prompt"),
    ({**CHAT, "seed": 2**64}, "seed"),
])
def test_bad_chat_requests_are_400(http, body, param):
    _assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_typed_fields_within_range_are_accepted(server, http):
    """What the ``openai`` client sends (JSON booleans, integers, numbers; an integer for a number) still passes."""
    import openai

    body = {**GOOD, "n": 1, "seed": 2**63 - 1, "echo": False, "ignore_eos": True, "temperature": 0, "top_p": 1,
            "logit_bias": {"1": -100, "2": 100.0}, "logprobs": 0, "stream_options": None, "skip_special_tokens": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2, response.text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    got = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2, seed=-(2**63), n=1,
                                         temperature=0, logprobs=True, top_logprobs=2, logit_bias={"3": 5}, stream=False)
    assert got.usage.completion_tokens == 2 and len(got.choices[0].logprobs.content[0].top_logprobs) == 2


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", '{"model": "smol", "prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "smol", "prompt": ["ok", "hi \\udfff there"], "max_tokens": 2, "stream": true}', "prompt"),
    ("/v1/completions", '{"model": "smol", "prompt": "ok", "max_tokens": 2, "stop": ["\\ud800"]}', "stop"),
    ("/v1/chat/completions", '{"model": "smol", "messages": [{"role": "user", "content": "x \\udc00"}]}', "messages"),
    ("/v1/chat/completions",
     '{"model": "smol", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}], "stream": true}',
     "messages"),
    ("/tokenize", '{"model": "smol", "prompt": "hi \\ud800"}', "prompt"),
    ("/tokenize", '{"model": "smol", "messages": [{"role": "user", "content": "\\udc00"}]}', "messages"),
], ids=["completion", "completion-list-stream", "stop", "chat", "chat-part-stream", "tokenize", "tokenize-chat"])
def test_a_lone_surrogate_is_400(http, path, raw, param):
    """A lone UTF-16 surrogate, valid JSON but not valid Unicode, made the tokenizer raise a TypeError: a 500 without
    the error envelope. A surrogate pair (one character) is fine."""
    error = _assert_error(http.post(path, content=raw.encode(), headers={"Content-Type": "application/json"}), 400, param)
    assert "surrogate" in error["message"], error
    pair = raw.replace("\\ud800", "\\ud83d\\ude00").replace("\\udfff", "\\ud83d\\ude00")
    if pair != raw and path == "/tokenize":
        assert http.post(path, content=pair.encode(), headers={"Content-Type": "application/json"}).status_code == 200


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
