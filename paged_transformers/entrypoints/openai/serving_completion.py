"""``POST /v1/completions``: prompts (text, token ids, or lists of either) completed, whole or streamed."""

import time
from collections.abc import AsyncIterator

from ..async_engine import CheckedRequest
from .protocol import CompletionRequest
from .serving_engine import OpenAIServing, ServingError, clamp_logprob, random_id, top_logprobs, usage


class OpenAIServingCompletion(OpenAIServing):
    """The completions handler (``OpenAIServing``'s arguments)."""

    def prepare(self, request: CompletionRequest) -> list[tuple[CheckedRequest, str]]:
        """Per prompt: ``(the checked request: token ids and SamplingParams, prompt text)``, every check done before
        anything runs.

        Raises:
            ServingError: 404 / 400 (``check_request``), an empty prompt list, or a bad prompt (index named).
        """
        self.check_request(request)
        prompts = request.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ServingError(400, "prompt is empty: give a string, a list of strings or token ids", "prompt")
        # echo with max_tokens=0: the prompt alone; one token is sampled and dropped (vLLM's rule)
        max_tokens = 1 if request.echo_only else request.max_tokens
        prompt_logprobs = request.logprobs if request.echo else None
        prepared = []
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt  # check_prompt copies it
            params = self.sampling_params(request, len(ids), max_tokens, request.logprobs,
                                          prompt_logprobs=prompt_logprobs)
            try:
                checked = self.check_prompt(ids, params)
            except ServingError as e:
                raise ServingError(400, f"prompt {i}: {e.message}" if len(prompts) > 1 else e.message, e.param) from e
            text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids) if request.echo else ""
            prepared.append((checked, text))
        return prepared

    async def create_completion(self, request: CompletionRequest, raw_request, request_id: str | None):
        """The response body (a dict), or for ``stream=true`` its SSE frames (an ``SSEStream``: its requests already
        handed to the engine).

        Raises:
            ServingError: a refused request (before anything runs).
            ClientDisconnected: the client left before the (non-streamed) response was ready.
        """
        prepared = self.prepare(request)
        response_id, created = random_id("cmpl", request_id), int(time.time())
        requests = [checked for checked, _ in prepared]
        if request.stream:
            return self.stream_response(requests, response_id,
                                        lambda streams: self._stream(request, prepared, streams, response_id, created))
        outputs = await self.run_to_end(requests, response_id, raw_request)
        echo_only = request.echo_only
        choices, num_completion_tokens = [], 0
        for i, (output, ((_, params), _)) in enumerate(zip(outputs, prepared)):
            for comp in output.outputs:
                text, token_ids, logprobs = comp.text, comp.token_ids, comp.logprobs
                if request.echo:
                    text, token_ids, logprobs = self._echo(request, prepared[i], output.prompt_logprobs,
                                                           text, token_ids, logprobs)
                num_completion_tokens += 0 if echo_only else len(comp.token_ids)
                choices.append({
                    "index": i * params.n + comp.index, "text": text,
                    "logprobs": self._logprobs(token_ids, logprobs, request.logprobs),
                    "finish_reason": "length" if echo_only else comp.finish_reason,
                    "stop_reason": None if echo_only else comp.stop_reason,
                })  # fmt: skip
        return {"id": response_id, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage(sum(len(ids) for ids, _ in requests), num_completion_tokens)}  # fmt: skip

    async def _stream(self, request: CompletionRequest, prepared, streams, response_id: str,
                      created: int) -> AsyncIterator[dict]:  # fmt: skip
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        head = {"id": response_id, "object": "text_completion", "created": created, "model": self.model_name}
        echo_only = request.echo_only
        echoed: set[int] = set()
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token (logprobs)
        num_completion_tokens = 0
        async for delta in self.stream_choices([checked for checked, _ in prepared], streams):
            num_completion_tokens += 0 if echo_only else len(delta.token_ids)
            text, token_ids, logprobs = delta.text, delta.token_ids, delta.logprobs
            if request.echo and delta.index not in echoed:  # the choice's first chunk: the prompt's entries first
                echoed.add(delta.index)
                text, token_ids, logprobs = self._echo(request, prepared[delta.prompt_index], delta.prompt_logprobs,
                                                       text, token_ids, logprobs)  # fmt: skip
            if not text and delta.finish_reason is None and logprobs is None:
                continue
            logprobs = self._logprobs(token_ids, logprobs, request.logprobs, offsets.get(delta.index, 0))
            if logprobs is not None and logprobs["tokens"]:  # the next chunk's offsets go on from this one's
                offsets[delta.index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            choice = {"index": delta.index, "text": text, "logprobs": logprobs,
                      "finish_reason": "length" if echo_only else delta.finish_reason,
                      "stop_reason": None if echo_only else delta.stop_reason}  # fmt: skip
            yield {**head, "choices": [choice], **({"usage": None} if include_usage else {})}
        if include_usage:
            num_prompt_tokens = sum(len(ids) for (ids, _), _ in prepared)
            yield {**head, "choices": [], "usage": usage(num_prompt_tokens, num_completion_tokens)}

    @staticmethod
    def _echo(request: CompletionRequest, prepared: tuple, prompt_logprobs, text: str, token_ids: list[int], logprobs):
        """A choice's first ``(text, token ids, logprobs)`` with ``echo``: the prompt's (``prepared``: its ids and
        text), then the completion's (none with ``max_tokens=0``). The logprobs join ``prompt_logprobs`` (its first
        entry None) and the completion's; None when not asked for."""
        (ids, _), prompt_text = prepared
        if request.echo_only:
            text, token_ids, logprobs = "", [], []
        return prompt_text + text, ids + token_ids, None if prompt_logprobs is None else prompt_logprobs + logprobs

    def _logprobs(self, token_ids: list[int], logprobs, k: int | None, offset: int = 0) -> dict | None:
        """The completions API's logprobs object of these tokens (None when not asked for); ``text_offset`` counts
        characters from ``offset`` (the first token's). A None entry (an echoed prompt's first token: nothing scores
        it) gives None in ``token_logprobs`` and ``top_logprobs``, as in OpenAI's and vLLM's responses."""
        if k is None or logprobs is None:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "text_offset": offsets,
            "token_logprobs": [None if lp is None else clamp_logprob(lp[t]) for t, lp in zip(token_ids, logprobs)],
            "tokens": tokens,
            # the top k and the position's own token, k + 1 entries when it is not among them (vLLM's "up to
            # logprobs + 1")
            "top_logprobs": [None if lp is None else {self.token_text(t): v for t, v in top_logprobs(lp, k + 1)}
                             for lp in logprobs],
        }  # fmt: skip
