"""``SamplingParams``: how one request is sampled and when it stops (vLLM's fields and defaults)."""

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable


SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping parameters of one request, named and defaulted as in vLLM.

    Args:
        n: sequences to sample from the prompt (>= 1).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it. >= 0. Values below
            ``SAMPLING_EPS`` (1e-5) count as 0, as in vLLM: dividing by them overflows float32.
        top_p: nucleus sampling mass, in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's, in [0, 1].
        seed: per-request random seed (an integer, not a bool); a seeded request samples the same tokens whatever else is in
            the batch (each sequence gets its own ``torch.Generator``).
        max_tokens: most new tokens (>= 1). The sequence also stops at the engine's ``max_model_len``
            (``finish_reason="length"`` in both cases).
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens were generated.
        stop: strings that end generation when they appear in the output text (not included in it).
        stop_token_ids: token ids that end generation (included in ``token_ids``, like EOS; their text is not
            in the output text, nor is EOS's).
        include_stop_str_in_output: keep the matched ``stop`` string, and the text of the stop token or EOS
            that ended the sequence, in the output text (vLLM's option).
        ignore_eos: keep generating past EOS.
        logprobs: if set, return the log-probabilities of the sampled token and of the top
            ``logprobs`` tokens at each step (from the model's raw logits, before any processing).
        prompt_logprobs: if set (>= 0), return the log-probability of every prompt token after the first and of
            the top ``prompt_logprobs`` tokens at its position (``RequestOutput.prompt_logprobs``; raw logits, as
            ``logprobs``). The whole prompt is computed then: such a request takes no prefix-cache hits.
        repetition_penalty: > 0; as in transformers/CTRL, applied to prompt and output tokens.
        presence_penalty, frequency_penalty: in [-2, 2]; OpenAI-style, applied to output tokens.
        logits_processors: callables with the transformers ``LogitsProcessor`` signature
            ``(input_ids [1, num_tokens] int64, scores [1, vocab_size] float32) -> scores``, called for
            this request alone with its whole history (prompt + output so far).

    Integer fields accept numpy integers too (stored as ``int``). ``LLMEngine.add_request`` checks the
    fields again (``validate``) and keeps its own copy, so changing a ``SamplingParams`` later cannot
    affect a request already added.

    Raises:
        ValueError: a field out of range, naming the field and the value.

    Examples:
        >>> from paged_transformers import SamplingParams
        >>> SamplingParams(temperature=0.0, max_tokens=8).max_tokens
        8
        >>> SamplingParams(top_p=1.5)
        Traceback (most recent call last):
        ...
        ValueError: top_p must be in (0, 1], got 1.5
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logits_processors: list[Callable[..., Any]] = field(default_factory=list)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field, normalizing in place: ``stop`` as a string becomes a one-item list, the
        list fields become lists, integer fields become ``int`` (numpy integers are accepted, ``bool``
        is not) and float fields ``float``.

        Run at construction and again by ``LLMEngine.add_request`` (on the request's own copy), so a
        field changed after construction is checked before the request can join a batch.

        Raises:
            ValueError: a field of the wrong type or out of range, naming the field and the value.
        """
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "logits_processors"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r}")
            setattr(self, name, list(value))
        self.n = _check_int("n", self.n, 1)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.max_tokens = _check_int("max_tokens", self.max_tokens, 1)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} max_tokens={self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        self.top_k = int(self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _check_int(name, getattr(self, name), 0))
        if self.seed is not None:
            if not _is_int(self.seed):
                raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
            self.seed = int(self.seed)
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        for proc in self.logits_processors:
            if not callable(proc):
                raise ValueError(f"logits_processors must be callables, got {proc!r}")

    @property
    def greedy(self) -> bool:
        """Argmax sampling: ``temperature < SAMPLING_EPS``."""
        return self.temperature < SAMPLING_EPS

    @classmethod
    def from_generation_config(cls, generation_config, **overrides) -> "SamplingParams":
        """Map a transformers ``GenerationConfig`` onto ``SamplingParams``.

        ``do_sample=False`` becomes ``temperature=0``; ``max_new_tokens`` becomes ``max_tokens`` (16, the
        vLLM default, when it is unset); ``min_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
        ``min_p``, ``repetition_penalty``, ``num_return_sequences`` (as ``n``) carry over. EOS comes from
        the engine (the tokenizer's or generation config's ``eos_token_id``). ``overrides`` win.

        Raises:
            NotImplementedError: a field set to a value the engine cannot honour (e.g. ``num_beams > 1``),
                or one that needs a transformers logits processor (``typical_p``, ``no_repeat_ngram_size``,
                ``bad_words_ids``, ``stop_strings``, ...: use ``paged_generate(generation_config=...)``),
                naming it.
        """
        return cls(**{**sampling_params_fields(generation_config), **overrides})


def sampling_params_fields(gc) -> dict[str, Any]:
    """``SamplingParams`` fields for a transformers ``GenerationConfig`` ``gc``, without a model:
    ``SamplingParams.from_generation_config``.

    ``do_sample=False`` becomes ``temperature=0``; ``max_new_tokens`` becomes ``max_tokens`` (unset: the
    ``SamplingParams`` default); ``min_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``, ``num_return_sequences`` (as ``n``) carry over.

    Raises:
        NotImplementedError: ``num_beams > 1``, or an option that needs a transformers logits processor or
            stopping criterion (``_PROCESSOR_FIELDS``), naming it.
    """
    if getattr(gc, "num_beams", 1) not in (None, 1):
        raise NotImplementedError(f"GenerationConfig.num_beams={gc.num_beams} (beam search) is not supported by the paged engine")
    needs_processors = [
        f"{name}={getattr(gc, name)!r}" for name, neutral in _PROCESSOR_FIELDS.items()
        if getattr(gc, name, neutral) not in (neutral, None) and not (name == "typical_p" and not gc.do_sample)
    ]
    if needs_processors:
        raise NotImplementedError(
            f"SamplingParams.from_generation_config cannot map GenerationConfig options {', '.join(needs_processors)}; "
            "use paged_generate(..., generation_config=gc) or the patched model.generate(), which run "
            "transformers' own logits processors per request"
        )
    fields: dict[str, Any] = {"temperature": 0.0}
    if gc.do_sample:
        fields.update(
            temperature=gc.temperature if gc.temperature is not None else 1.0,
            top_k=gc.top_k or 0,
            top_p=gc.top_p if gc.top_p is not None else 1.0,
            min_p=gc.min_p or 0.0,
        )
    if gc.max_new_tokens is not None:
        fields["max_tokens"] = gc.max_new_tokens
    if gc.min_new_tokens:
        fields["min_tokens"] = gc.min_new_tokens
    if gc.repetition_penalty is not None:
        fields["repetition_penalty"] = gc.repetition_penalty
    if gc.num_return_sequences:
        fields["n"] = gc.num_return_sequences
    return fields


# GenerationConfig fields served by transformers logits processors / stopping criteria (not by
# SamplingParams fields), with their neutral values.
_PROCESSOR_FIELDS = {
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "no_repeat_ngram_size": 0,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "sequence_bias": None, "exponential_decay_length_penalty": None,
    "watermarking_config": None, "stop_strings": None, "max_time": None, "renormalize_logits": False,
    "min_length": 0, "encoder_repetition_penalty": 1.0, "top_h": None,
}


def _is_int(value) -> bool:
    """An integer, Python or numpy (``numbers.Integral``), that is not a bool (``True`` is no seed or count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value, minimum: int) -> int:
    """``value`` as an ``int``; ValueError naming ``name`` unless it is an integer >= ``minimum``."""
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
