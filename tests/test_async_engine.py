"""The server's engine front hands a request to the engine when it is added, not when its outputs are first read
(``AsyncEngine.add_request``; ``add_checked_request`` takes what ``check_request`` passed, as it was then), and a
request whose outputs are never read is aborted when its stream closes; a streamed response closes its body however
it ends, also before it sends a byte."""

import asyncio
import time

import pytest

from serving import skip_without_server_deps


async def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_a_request_runs_before_its_stream_is_read_and_closing_it_unread_frees_its_blocks():
    from paged_transformers import LLM, SamplingParams
    from paged_transformers.default_model import default_model_path
    from paged_transformers.entrypoints.async_engine import AsyncEngine

    llm = LLM(str(default_model_path()), max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256, device="cpu")
    prompt = llm.tokenizer("The capital of France is").input_ids
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=8)

    async def main():
        front = AsyncEngine(llm)
        front.start()
        try:
            unread = front.add_request(prompt, long)
            await _until(lambda: front.snapshot.num_running == 1)  # running, though nobody iterated its stream
            assert front.snapshot.kv_cache_usage > 0
            unread.close()
            unread.close()  # twice: a no-op
            await _until(lambda: front.snapshot.num_running == 0 and front.snapshot.kv_cache_usage == 0)
            assert front.num_waiting == 0
            # a server checks first (every prompt of a call) and hands the checked request over as it is
            with pytest.raises(ValueError, match="vocabulary"):
                front.check_request([front.limits.vocab_size], short)
            checked = front.check_request(prompt, short)
            prompt.append(0)  # the caller's list and params changed after the check do not reach the request
            short.max_tokens = 1
            with pytest.raises(TypeError, match="tuple"):
                front.add_checked_request(tuple(checked))
            assert front.num_waiting == 0
            async for output in front.add_checked_request(checked):
                last = output
            return last
        finally:
            front.shutdown()

    try:
        streamed = asyncio.run(main())
        assert streamed.finished
        prompt.pop()
        assert streamed.prompt_token_ids == prompt
        reference = SamplingParams(temperature=0, max_tokens=8)
        (offline,) = llm.generate([prompt], reference, use_tqdm=False)  # the same engine, offline: the reference
        assert len(offline.outputs[0].token_ids) > 1
        assert streamed.outputs[0].token_ids == offline.outputs[0].token_ids
    finally:
        llm.close()


def test_a_streamed_response_that_never_starts_still_closes_its_requests():
    skip_without_server_deps()
    from starlette.requests import ClientDisconnect

    from paged_transformers.entrypoints.openai.api_server import _respond
    from paged_transformers.entrypoints.openai.serving_engine import SSEStream

    events = []

    async def chunks():
        events.append("body started")
        yield {"choices": []}

    async def send(message):
        raise OSError("the client is gone")  # as the first send to a closed connection does

    async def receive():
        return {"type": "http.disconnect"}

    response = _respond(SSEStream(chunks(), lambda: events.append("requests closed")))
    with pytest.raises(ClientDisconnect):
        asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert events == ["requests closed"]
