"""The OpenAI API's request bodies as pydantic models (vLLM's field names and defaults), and the error envelope.

As in vLLM, a field the API does not know is ignored with a warning (``ignored_fields``), so clients that send
newer OpenAI fields keep working; a known field whose feature this server does not have (tools, structured
output, beam search, ...) is refused with a 400 naming it (``unserved_fields``), never silently dropped.

Booleans, integers and numbers are strict (``StrictBool``, ``StrictInt``, ``StrictFloat``): ``"stream": "yes"``,
``"n": "2"``, ``"max_tokens": 1.5`` or ``"temperature": true`` is a 400 naming the field, not coerced; JSON
``true``/``false``, integers and numbers (an integer too, for a number), what the ``openai`` client sends, are what
they take. A ``seed`` must fit in 64 bits (vLLM's range), a ``logit_bias`` value
lie in [-100, 100] (OpenAI's), and a chat message's ``role`` be one of OpenAI's (``ROLES``).
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

MAX_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI allows up to 20 top logprobs)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's chat message roles

TokenIds = list[StrictInt]
Prompt = str | list[str] | TokenIds | list[TokenIds]
Seed = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]  # vLLM's: torch.long's range
Bias = Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]


class OpenAIBaseModel(BaseModel):
    """Unknown fields are kept (``model_extra``) so that they can be named in a warning, as vLLM does."""

    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        """The request's fields this API does not know (ignored)."""
        return sorted(self.model_extra or {})

    def invalid_text(self) -> tuple[str, str] | None:
        """``(field, message)`` for the first string of the request (a value or a key, at any depth, unknown fields
        too) that is not valid Unicode: a lone UTF-16 surrogate, which JSON can spell (``"\\ud800"``) but UTF-8,
        the tokenizer and the response cannot; None when every string is valid."""
        for name, value in self.model_dump().items():
            found = _lone_surrogate(value, name)
            if found is not None:
                path, text, at = found
                return name, (f"{path}: a lone UTF-16 surrogate U+{ord(text[at]):04X} at character {at} is not valid "
                              "Unicode text")  # fmt: skip
        return None


def _lone_surrogate(value, path: str) -> tuple[str, str, int] | None:
    """``(path, string, offset)`` of the first lone surrogate in ``value`` (strings, and lists and dicts of them)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, value, e.start
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(key, f"{path} key") if isinstance(key, str) else None
        found = found or _lone_surrogate(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
        if found is not None:
            return found
    return None


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool | None = False


class ResponseFormat(OpenAIBaseModel):
    type: str


class SamplingFields(OpenAIBaseModel):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extras). None: the server default
    (the model's generation config, as vLLM's ``--generation-config auto``, else ``SamplingParams``')."""

    model: str | None = None
    n: StrictInt = 1
    best_of: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    logit_bias: dict[str, Bias] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    use_beam_search: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    prompt_logprobs: StrictInt | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: Any = None

    def unserved_fields(self) -> list[str]:
        """The fields set to something this server cannot do, each as ``"name: why"``."""
        bad = []
        if self.best_of is not None and self.best_of != self.n:
            bad.append(f"best_of: best_of={self.best_of} > n={self.n} (ranking extra samples) is not supported")
        if self.use_beam_search:
            bad.append("use_beam_search: beam search is not supported")
        if self.response_format is not None and self.response_format.type != "text":
            bad.append(f"response_format: type {self.response_format.type!r} (structured output) is not supported")
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
            if getattr(self, name) is not None:
                bad.append(f"{name}: structured output is not supported")
        if not self.skip_special_tokens:
            bad.append("skip_special_tokens: false is not supported (special tokens are always left out of the text)")
        if self.prompt_logprobs is not None:
            bad.append("prompt_logprobs: not served as a field (vLLM's per-token objects); on /v1/completions, "
                       "echo=true with logprobs=k returns the prompt tokens' logprobs")
        if self.stream_options is not None and not self.stream:
            bad.append("stream_options: only allowed with stream=true")
        return bad


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``echo=true`` puts the prompt before each choice's text (and, with ``logprobs``, its
    tokens' logprobs before the completion's); with ``max_tokens=0`` it returns the prompt alone, as OpenAI and
    vLLM do (``max_tokens=0`` without ``echo`` is a 400)."""

    prompt: Prompt
    max_tokens: StrictInt | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens=0``: the response is the prompt alone."""
        return self.echo and self.max_tokens == 0

    def unserved_fields(self) -> list[str]:
        bad = super().unserved_fields()
        if self.suffix is not None:
            bad.append("suffix: insertion (fill in the middle) is not supported")
        return bad


class ChatMessage(OpenAIBaseModel):
    role: Literal[ROLES]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def unserved_fields(self) -> list[str]:
        bad = super().unserved_fields()
        for name in ("tools", "functions", "function_call"):
            if getattr(self, name):
                bad.append(f"{name}: tool calling is not supported")
        if self.tool_choice not in (None, "none"):
            bad.append("tool_choice: tool calling is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            bad.append("top_logprobs: needs logprobs=true")
        return bad


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: TokenIds


ERROR_TYPES: dict[int, str] = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 503: "ServiceUnavailableError",
                               500: "InternalServerError"}  # other 4xx: BadRequestError; other 5xx: InternalServerError


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}`` (``code``: the HTTP status)."""
    kind = ERROR_TYPES.get(status, "BadRequestError" if 400 <= status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
