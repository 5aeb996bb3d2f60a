"""``POST /v1/chat/completions``: a conversation rendered with the chat template, answered whole or streamed."""

import time
from collections.abc import AsyncIterator

from ..async_engine import CheckedRequest
from .protocol import ChatCompletionRequest
from .serving_engine import OpenAIServing, ServingError, clamp_logprob, random_id, top_logprobs, usage


class OpenAIServingChat(OpenAIServing):
    """The chat handler.

    Args:
        chat_template: a Jinja template replacing the tokenizer's (``--chat-template``), or None.
        the rest: as ``OpenAIServing``.
    """

    def __init__(self, *args, chat_template: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template

    def render(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
               chat_template_kwargs: dict | None = None) -> list[int]:  # fmt: skip
        """The conversation's prompt token ids: the chat template's text, tokenized without adding special tokens
        again (as ``LLM.chat`` does).

        Raises:
            ServingError: 400 for a message part that is not text, or a template that fails on the conversation.
        """
        conversation = [{"role": m.role, "content": _text_of(m.content, i)} for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, chat_template=self.chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}),
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - jinja's and transformers' errors: the conversation does not fit it
            raise ServingError(400, f"the chat template failed on these messages: {e}", "messages") from e
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request, request_id: str | None):
        """The response body (a dict), or for ``stream=true`` its SSE frames (an ``SSEStream``: its requests already
        handed to the engine).

        Raises:
            ServingError: a refused request (before anything runs).
            ClientDisconnected: the client left before the (non-streamed) response was ready.
        """
        self.check_request(request)
        ids = self.render(request.messages, request.add_generation_prompt, request.continue_final_message,
                          request.chat_template_kwargs)  # fmt: skip
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        k = (request.top_logprobs or 0) if request.logprobs else None
        checked = self.check_prompt(ids, self.sampling_params(request, len(ids), getattr(request, field), k, field))
        ids, params = checked
        response_id, created = random_id("chatcmpl", request_id), int(time.time())
        if request.stream:
            return self.stream_response([checked], response_id,
                                        lambda streams: self._stream(request, checked, streams, response_id, created))
        (output,) = await self.run_to_end([checked], response_id, raw_request)
        choices = [{
            "index": comp.index, "message": {"role": "assistant", "content": comp.text},
            "logprobs": self._logprobs(comp.token_ids, comp.logprobs, k),
            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
        } for comp in output.outputs]  # fmt: skip
        return {"id": response_id, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage(len(ids), sum(len(c.token_ids) for c in output.outputs))}  # fmt: skip

    async def _stream(self, request: ChatCompletionRequest, checked: CheckedRequest, streams, response_id: str,
                      created: int) -> AsyncIterator[dict]:  # fmt: skip
        ids, params = checked
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        tail = {"usage": None} if include_usage else {}
        k = (request.top_logprobs or 0) if request.logprobs else None
        num_completion_tokens = 0
        for index in range(params.n):  # the first delta of every choice carries the role (vLLM, OpenAI)
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}  # fmt: skip
            yield {**head, "choices": [choice], **tail}
        async for delta in self.stream_choices([checked], streams):
            num_completion_tokens += len(delta.token_ids)
            if not delta.text and delta.finish_reason is None and delta.logprobs is None:
                continue
            choice = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                      "logprobs": self._logprobs(delta.token_ids, delta.logprobs, k),
                      "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}  # fmt: skip
            yield {**head, "choices": [choice], **tail}
        if include_usage:
            yield {**head, "choices": [], "usage": usage(len(ids), num_completion_tokens)}

    def _logprobs(self, token_ids: list[int], logprobs, k: int | None) -> dict | None:
        """The chat API's logprobs object (``{"content": [...]}``) of these tokens (None when not asked for)."""
        if k is None or logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": clamp_logprob(logprob), "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(t, lp[t]), "top_logprobs": [entry(i, v) for i, v in top_logprobs(lp, k)]}
                            for t, lp in zip(token_ids, logprobs)]}  # fmt: skip


def _text_of(content, index: int) -> str:
    """A message's text: a string, None (empty), or OpenAI's list of ``{"type": "text", "text": ...}`` parts.

    Raises:
        ServingError: 400 for a part of another type (images, audio: not served).
    """
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ServingError(400, f"messages[{index}]: content parts of type {part.get('type')!r} are not supported "
                                    "(text only)", "messages")  # fmt: skip
        parts.append(part["text"])
    return "".join(parts)
