"""What the engine returns: ``RequestOutput`` with one ``CompletionOutput`` per sampled sequence."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (vLLM's fields).

    Attributes:
        index: which of the request's ``n`` sequences.
        text: the decoded output, once the request has finished ('' before that, and without a tokenizer;
            ``paged_transformers.integration.streaming.stream`` yields text as it is generated); cut before a matched
            ``stop`` string, and without the text of the stop token or EOS that ended it (both kept with
            ``SamplingParams.include_stop_str_in_output``), as in vLLM.
        token_ids: output token ids (EOS / stop token included when it ended the sequence).
        cumulative_logprob: sum of the sampled tokens' logprobs, when ``logprobs`` was asked for.
        logprobs: per output token, ``{token_id: logprob}`` (the sampled token and the top-k).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, or None while unfinished.
        stop_reason: the stop string or stop token id that ended it, if any.
        error: the exception that aborted this sequence (e.g. from a logits processor), if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps of a request, in seconds (``time.perf_counter`` clock)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt and its ``n`` completions.

    Attributes:
        request_id, prompt (None when given as token ids), prompt_token_ids.
        outputs: ``n`` ``CompletionOutput``s, ordered by index.
        finished: all ``n`` sequences have finished.
        metrics: ``RequestMetrics``.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` set, one entry per prompt token (vLLM's format):
            ``None`` for the first (nothing scores it), then ``{token_id: logprob}`` holding the prompt token and
            the top ``prompt_logprobs`` tokens at its position (natural log, float, from the raw logits as
            ``CompletionOutput.logprobs``). Complete in every output that has a sampled token; shared by the
            request's ``n`` completions. None when not asked for.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
