"""The OpenAI-compatible server on the embedded SmolLM2, driven by the official ``openai`` client (sync and async)
and raw HTTP (``httpx``): greedy outputs equal stock ``generate()`` and the offline ``LLM``, streamed text equals
the whole response, SSE framing, usage, n > 1 and prompt lists, logprobs against the model's own log-softmax,
stops, metrics, disconnects. One server for the module, its engine in a process of its own (as ``serve`` runs it;
the other server tests step the engine in a thread of the test process)."""

import asyncio
import re
from pathlib import Path

import pytest
import torch

from conftest import stock_greedy
from serving import MODEL, metric, running_server, skip_without_server_deps, sse_events, wait_idle

MAX_TOKENS = 6
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
pytestmark = pytest.mark.slow  # every test but one talks to the server this module starts


@pytest.fixture(scope="module")
def server(smollm2):
    skip_without_server_deps()
    with running_server(engine_process=True) as server:  # as `paged-transformers serve` runs it
        yield server


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def _stock_text(smollm2, prompt_ids: list[int], max_tokens: int) -> str:
    model, tokenizer = smollm2
    new, _ = stock_greedy(model, prompt_ids, max_tokens)
    return tokenizer.decode(new, skip_special_tokens=True)


def _stream_lines(http, path: str, body: dict) -> list:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.iter_lines())


def test_completion_greedy_equals_stock_and_offline_llm(client, smollm2):
    from paged_transformers import LLM, SamplingParams

    model, tokenizer = smollm2
    ids = tokenizer(PROMPT).input_ids
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == _stock_text(smollm2, ids, MAX_TOKENS)
    with LLM(model, tokenizer=tokenizer) as llm:
        offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert got.choices[0].text == offline[0].outputs[0].text
    assert got.object == "text_completion" and got.model == MODEL and got.id.startswith("cmpl-")
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == MAX_TOKENS and got.choices[0].finish_reason == "length"
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_completion_stream_joins_to_the_whole_text(client, http):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    events = _stream_lines(http, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, "stream": True,
                                                      "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks, last = events[:-2], events[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == MAX_TOKENS
    assert last["usage"]["prompt_tokens"] + MAX_TOKENS == last["usage"]["total_tokens"]


def test_chat_equals_offline_chat_and_stream(client, smollm2):
    from paged_transformers import LLM, SamplingParams

    model, tokenizer = smollm2
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    with LLM(model, tokenizer=tokenizer) as llm:
        offline = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert got.choices[0].message.content == offline.outputs[0].text == _stock_text(smollm2, list(ids), MAX_TOKENS)
    assert got.choices[0].message.role == "assistant" and got.object == "chat.completion"
    assert got.usage.prompt_tokens == len(offline.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == got.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 1


def test_n_and_prompt_lists_give_one_choice_each(client, http, smollm2):
    _, tokenizer = smollm2
    prompts = [PROMPT, "Once upon a time"]
    ids = [tokenizer(p).input_ids for p in prompts]
    got = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert sorted(c.index for c in got.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in got.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy copies
    assert by_index[2] == _stock_text(smollm2, ids[1], 4)
    assert got.usage.completion_tokens == 16 and got.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    from_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in sorted(from_ids.choices, key=lambda c: c.index)] == [by_index[0], by_index[2]]
    events = _stream_lines(http, "/v1/completions", {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 4,
                                                      "temperature": 0.8, "seed": 1, "stream": True})
    indices = [e["choices"][0]["index"] for e in events[:-1]]
    assert set(indices) == {0, 1, 2, 3}
    first_end = max(indices.index(i) for i in range(4))
    assert any(indices[j] != indices[j + 1] for j in range(first_end)), "choices were not interleaved"
    finals = [e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(finals) == [0, 1, 2, 3]  # one finish_reason per choice


def test_seeded_sampling_is_reproducible(client):
    def draw():
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0,
                                         top_p=0.9, seed=123, extra_body={"top_k": 20, "min_p": 0.01,
                                         "repetition_penalty": 1.1}).choices[0].text
    assert draw() == draw()


def test_logprobs_are_the_models_log_softmax(client, smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(PROMPT).input_ids
    with torch.inference_mode():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    top = reference.topk(3)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=3).choices[0]
    first_top = got.logprobs.top_logprobs[0]
    assert list(first_top) == [tokenizer.decode([t]) for t in top.indices.tolist()]
    assert list(first_top.values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    assert got.logprobs.token_logprobs[0] == pytest.approx(top.values[0].item(), abs=1e-4)
    assert len(got.logprobs.tokens) == 2 and got.logprobs.text_offset[0] == 0
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0, logprobs=True,
                                          top_logprobs=2).choices[0]
    assert len(chat.logprobs.content) == 2
    entry = chat.logprobs.content[0]
    assert [t.token for t in entry.top_logprobs][0] == entry.token and len(entry.top_logprobs) == 2
    assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_top_logprobs_hold_the_sampled_token_as_in_vllm(client):
    """Sampled (temperature 1.5), a token outside the top k is still in its position's ``top_logprobs`` (vLLM's
    "up to logprobs + 1" entries), with its ``token_logprobs`` value; ``logprobs=0`` gives the token alone."""
    for k in (0, 1):
        lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.5, seed=1,
                                       logprobs=k, extra_body={"ignore_eos": True}).choices[0].logprobs  # fmt: skip
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[token] == pytest.approx(value) and k <= len(top) <= k + 1
        assert k == 0 or any(len(top) == k + 1 for top in lp.top_logprobs), "no sampled token outside the top 1"


def test_streamed_logprobs_offsets_run_on(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    events = _stream_lines(http, "/v1/completions", {**body, "stream": True})
    parts = [e["choices"][0]["logprobs"] for e in events[:-1]]
    assert [o for p in parts for o in p["text_offset"]] == whole["text_offset"]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"]


def _offsets(tokens: list[str]) -> list[int]:
    return [sum(map(len, tokens[:i])) for i in range(len(tokens))]


def test_echo_with_logprobs_gives_the_prompts_then_the_completions(client, smollm2):
    """Non-streamed and streamed (each choice's first chunk carries the prompt's entries): the prompt's tokens first,
    its first entry None, the rest equal to the offline engine's prompt logprobs and to stock log_softmax."""
    from paged_transformers import LLM, SamplingParams

    model, tokenizer = smollm2
    ids = tokenizer(PROMPT).input_ids
    n = len(ids)
    with torch.inference_mode():
        stock = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    with LLM(model, tokenizer=tokenizer) as llm:
        (offline,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2),
                                  use_tqdm=False)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice = got.choices[0]
    lp = choice.logprobs
    assert choice.text == PROMPT + offline.outputs[0].text and got.usage.completion_tokens == 3
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 3
    assert "".join(lp.tokens[:n]) == PROMPT and lp.text_offset == _offsets(lp.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        entry = offline.prompt_logprobs[i]
        assert lp.token_logprobs[i] == pytest.approx(entry[ids[i]], abs=1e-4)
        assert lp.token_logprobs[i] == pytest.approx(stock[i - 1, ids[i]].item(), abs=1e-4)
        top = sorted(entry.items(), key=lambda item: -item[1])  # the top 2 and the prompt token (vLLM: up to k + 1)
        assert list(lp.top_logprobs[i]) == [tokenizer.decode([t]) for t, _ in top]
        assert tokenizer.decode([ids[i]]) in lp.top_logprobs[i] and len(lp.top_logprobs[i]) in (2, 3)
        assert list(lp.top_logprobs[i].values()) == pytest.approx([v for _, v in top], abs=1e-4)
    completion = offline.outputs[0]
    want = [e[t] for t, e in zip(completion.token_ids, completion.logprobs)]
    assert lp.token_logprobs[n:] == pytest.approx(want, abs=1e-4)

    for k in (0, 1):  # n = 2 choices, streamed
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                                echo=True, n=2, stream=True))
        mine = [c.choices[0] for c in chunks if c.choices[0].index == k]
        assert mine[0].logprobs.tokens[:n] == lp.tokens[:n] and mine[0].text.startswith(PROMPT)
        assert mine[0].logprobs.token_logprobs[0] is None and mine[0].logprobs.top_logprobs[0] is None
        assert "".join(c.text for c in mine) == choice.text
        assert [t for c in mine for t in c.logprobs.tokens] == lp.tokens
        assert [o for c in mine for o in c.logprobs.text_offset] == lp.text_offset
        streamed = [v for c in mine for v in c.logprobs.token_logprobs]
        assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, http):
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = got.choices[0]
    assert choice.text == PROMPT and "".join(choice.logprobs.tokens) == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None and None not in choice.logprobs.token_logprobs[1:]
    assert got.usage.completion_tokens == 0 and got.usage.total_tokens == got.usage.prompt_tokens
    events = _stream_lines(http, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True,
                                                      "logprobs": 1, "stream": True})
    (only,) = [e["choices"][0] for e in events[:-1]]
    assert only["text"] == PROMPT and only["logprobs"]["tokens"] == choice.logprobs.tokens
    assert only["finish_reason"] == "length"
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True).choices[0]
    assert plain.text == PROMPT and plain.logprobs is None


def test_an_error_mid_stream_is_an_event_then_done():
    from paged_transformers.entrypoints.openai.serving_engine import sse_frames

    async def chunks():
        yield {"choices": []}
        raise RuntimeError("boom")

    async def frames():
        return [f async for f in sse_frames(chunks())]

    events = sse_events("".join(asyncio.run(frames())).split("\n")[:-1])
    assert events[0] == {"choices": []} and events[1]["error"]["message"] == "boom" and events[2] == "[DONE]"


def test_stop_strings_stop_token_ids_and_request_id(client, http, smollm2):
    _, tokenizer = smollm2
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    stop = whole.strip().split()[1]  # a word in the middle of the greedy output
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]).choices[0]
    assert got.finish_reason == "stop" and got.text == whole[: whole.index(stop)]
    events = _stream_lines(http, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, "stop": stop, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == got.text
    first_id = tokenizer(whole).input_ids[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"stop_token_ids": [first_id]}).choices[0]
    assert got.finish_reason == "stop" and got.stop_reason == first_id
    response = http.post("/v1/completions", headers={"X-Request-Id": "abc-1"},
                         json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "echo": True})
    assert response.headers["x-request-id"] == "abc-1" and response.json()["id"] == "cmpl-abc-1"
    assert response.json()["choices"][0]["text"].startswith(PROMPT)


def test_stop_token_id_text_left_out(client, http, smollm2):
    """A choice ended by an ordinary word token of ``stop_token_ids`` used to keep that token's text; as in vLLM,
    its text leaves the token out (completions and chat, whole and streamed), ``finish_reason`` is ``"stop"`` and
    ``stop_reason`` the id; ``include_stop_str_in_output`` keeps it. Reference: stock ``generate()``'s greedy
    tokens, decoded."""
    model, tokenizer = smollm2
    chat_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    for path, ids, body in (("/v1/completions", tokenizer(PROMPT).input_ids, {"prompt": PROMPT}),
                            ("/v1/chat/completions", list(chat_ids["input_ids"]), {"messages": MESSAGES})):
        new, _ = stock_greedy(model, ids, MAX_TOKENS)
        k = next(k for k in range(1, len(new)) if tokenizer.decode([new[k]]).strip().isalpha() and new[k] not in new[:k])
        for include in (False, True):
            want = tokenizer.decode(new[: k + 1 if include else k], skip_special_tokens=True)
            body = {**body, "model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stop_token_ids": [new[k]],
                    "include_stop_str_in_output": include}
            choice = http.post(path, json=body).json()["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert (text, choice["finish_reason"], choice["stop_reason"]) == (want, "stop", new[k]), (path, include)
            events = _stream_lines(http, path, {**body, "stream": True})[:-1]
            deltas = [e["choices"][0] for e in events if e["choices"]]
            streamed = "".join(d.get("text") or d.get("delta", {}).get("content") or "" for d in deltas)
            assert streamed == want and (deltas[-1]["finish_reason"], deltas[-1]["stop_reason"]) == ("stop", new[k]), path


def test_async_client_concurrent_requests(server):
    import openai

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        calls = [client.completions.create(model=MODEL, prompt=f"{i} + {i} =", max_tokens=4, temperature=0) for i in range(6)]
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True)
        results = await asyncio.gather(*calls)
        chunks = [c async for c in stream]
        await client.close()
        return results, chunks

    results, chunks = asyncio.run(run())
    assert all(r.usage.completion_tokens == 4 for r in results)
    assert chunks[0].choices[0].delta.role == "assistant"


def test_models_health_version_tokenize(client, http, smollm2):
    import openai

    import paged_transformers

    _, tokenizer = smollm2
    import time

    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert time.time() - 3600 < models[0].created <= time.time()  # the server's start, in seconds since the epoch
    assert client.models.retrieve(MODEL) == models[0]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert http.get("/health").status_code == 200
    assert http.get("/version").json() == {"version": paged_transformers.__version__}
    tokens = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert tokens["tokens"] == tokenizer(PROMPT).input_ids and tokens["count"] == len(tokens["tokens"])
    assert http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}


def test_metrics_count_every_request_and_return_to_idle(client, http):
    before = wait_idle(http)
    names = ["vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
             "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
             "vllm:request_success_total"]
    start = {name: metric(before, name) for name in names}
    tokens = metric(before, "vllm:generation_tokens_total")
    for i in range(3):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    after = wait_idle(http)
    assert {name: metric(after, name) - start[name] for name in names} == {name: 3 for name in names}
    assert metric(after, "vllm:generation_tokens_total") - tokens == 9
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total"):
        metric(after, name)  # exposed
    assert metric(after, "vllm:prefix_cache_hits_total") > 0  # the same prompt three times


def test_token_counters_go_up_while_a_request_runs(http, smollm2):
    """As vLLM's per-step counting: mid-stream, the prompt and the tokens streamed so far are counted already."""
    _, tokenizer = smollm2
    before = wait_idle(http)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        events = 0
        while events < 20:
            events += next(lines).startswith("data: ")
        during = http.get("/metrics").text
    assert metric(during, "vllm:num_requests_running") == 1
    assert metric(during, "vllm:prompt_tokens_total") - metric(before, "vllm:prompt_tokens_total") == len(
        tokenizer(PROMPT).input_ids)
    assert 20 <= metric(during, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total") < 200
    wait_idle(http)


def test_logit_bias_reaches_the_engine_process(client, smollm2):
    # +100 on one token outweighs every logit: greedy decoding then makes only that token (the bias is a logits
    # processor that crosses to the engine process)
    _, tokenizer = smollm2
    token = tokenizer(" blue").input_ids[-1]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(token): 100})
    assert out.choices[0].text == tokenizer.decode([token] * 3, skip_special_tokens=True)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert plain.choices[0].text != out.choices[0].text


def test_a_client_that_disconnects_aborts_its_request(server, http):
    import httpx

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        next(lines)  # a first event: the request runs
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    text = wait_idle(http, timeout_s=30)  # long before 400 tokens: both were aborted, their blocks freed
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
    assert http.get("/health").status_code == 200


def test_readme_serving_snippet_runs_against_the_server(server):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### OpenAI-compatible server"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "http://localhost:8000/v1" in code
    code = code.replace("http://localhost:8000/v1", server.url + "/v1").replace('"SmolLM2-135M-Instruct"', f'"{MODEL}"')
    exec(compile(code, "README.md", "exec"), {})
