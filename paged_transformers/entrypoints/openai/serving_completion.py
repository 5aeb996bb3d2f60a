"""``POST /v1/completions``: prompts (text, token ids, or lists of either) completed, whole or streamed."""

import time
from collections.abc import AsyncIterator

from .protocol import CompletionRequest
from .serving_engine import OpenAIServing, ServingError, clamp_logprob, random_id, sse_frames, top_logprobs, usage


class OpenAIServingCompletion(OpenAIServing):
    """The completions handler (``OpenAIServing``'s arguments)."""

    def prepare(self, request: CompletionRequest) -> list[tuple[list[int], object, str]]:
        """Per prompt: ``(token ids, SamplingParams, prompt text)``, every check done before anything runs.

        Raises:
            ServingError: 404 / 400 (``check_request``), an empty prompt list, or a bad prompt (index named).
        """
        self.check_request(request)
        prompts = request.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ServingError(400, "prompt is empty: give a string, a list of strings or token ids", "prompt")
        prepared = []
        for i, prompt in enumerate(prompts):
            ids = list(self.tokenizer(prompt).input_ids) if isinstance(prompt, str) else list(prompt)
            params = self.sampling_params(request, len(ids), request.max_tokens, request.logprobs)
            try:
                params = self.check_prompt(ids, params)
            except ServingError as e:
                raise ServingError(400, f"prompt {i}: {e.message}" if len(prompts) > 1 else e.message, e.param) from e
            text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids) if request.echo else ""
            prepared.append((ids, params, text))
        return prepared

    async def create_completion(self, request: CompletionRequest, raw_request, request_id: str | None):
        """The response body (a dict), or for ``stream=true`` an async iterator of SSE frames.

        Raises:
            ServingError: a refused request (before anything runs).
            ClientDisconnected: the client left before the (non-streamed) response was ready.
        """
        prepared = self.prepare(request)
        response_id, created = random_id("cmpl", request_id), int(time.time())
        requests = [(ids, params) for ids, params, _ in prepared]
        if request.stream:
            return sse_frames(self._stream(request, prepared, response_id, created))
        outputs = await self.run_to_end(requests, response_id, raw_request)
        choices, num_completion_tokens = [], 0
        for i, (output, (_, params, text)) in enumerate(zip(outputs, prepared)):
            for comp in output.outputs:
                num_completion_tokens += len(comp.token_ids)
                choices.append({
                    "index": i * params.n + comp.index, "text": (text if request.echo else "") + comp.text,
                    "logprobs": self._logprobs(comp.token_ids, comp.logprobs, request.logprobs),
                    "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
                })  # fmt: skip
        return {"id": response_id, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage(sum(len(ids) for ids, _ in requests), num_completion_tokens)}  # fmt: skip

    async def _stream(self, request: CompletionRequest, prepared, response_id: str, created: int) -> AsyncIterator[dict]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        head = {"id": response_id, "object": "text_completion", "created": created, "model": self.model_name}
        echoed: set[int] = set()
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token (logprobs)
        num_completion_tokens = 0
        async for delta in self.stream_choices([(ids, params) for ids, params, _ in prepared], response_id):
            num_completion_tokens += len(delta.token_ids)
            text = delta.text
            if request.echo and delta.index not in echoed:
                echoed.add(delta.index)
                text = prepared[delta.prompt_index][2] + text
            if not text and delta.finish_reason is None and delta.logprobs is None:
                continue
            logprobs = self._logprobs(delta.token_ids, delta.logprobs, request.logprobs, offsets.get(delta.index, 0))
            if logprobs is not None and logprobs["tokens"]:  # the next chunk's offsets go on from this one's
                offsets[delta.index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            choice = {"index": delta.index, "text": text, "logprobs": logprobs,
                      "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}  # fmt: skip
            yield {**head, "choices": [choice], **({"usage": None} if include_usage else {})}
        if include_usage:
            num_prompt_tokens = sum(len(ids) for ids, _, _ in prepared)
            yield {**head, "choices": [], "usage": usage(num_prompt_tokens, num_completion_tokens)}

    def _logprobs(self, token_ids: list[int], logprobs, k: int | None, offset: int = 0) -> dict | None:
        """The completions API's logprobs object of these tokens (None when not asked for); ``text_offset`` counts
        characters from ``offset`` (the first token's)."""
        if k is None or logprobs is None:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "text_offset": offsets, "token_logprobs": [clamp_logprob(lp[t]) for t, lp in zip(token_ids, logprobs)],
            "tokens": tokens,
            "top_logprobs": [{self.token_text(t): v for t, v in top_logprobs(lp, k)} for lp in logprobs],
        }  # fmt: skip
