"""``GenerationConfig`` -> one ``SamplingParams`` per request, with transformers' own logits processors.

The engine samples each request alone, so every ``GenerationConfig`` option that ``generate()``
implements as a ``LogitsProcessor`` (repetition_penalty, no_repeat_ngram_size, bad_words_ids,
typical_p, suppress_tokens, min_new_tokens, forced_eos_token_id, temperature/top-k/top-p/min-p
warpers, watermarking, ...) is served by building the very list ``generate()`` builds
(``model._get_logits_processor``) once per request, for that request's own prompt, and calling it with
that request's history ``[1, num_tokens]`` (prompt + output, no padding). Then the sampler only takes
the argmax (``do_sample=False``) or draws from ``softmax(scores)`` (``do_sample=True``), which is what
``generate()`` does after its processors. Stopping criteria other than max length and EOS (e.g.
``stop_strings``, ``max_time``, a user's ``StoppingCriteria``) run per request on the same history, in the driver
loop (``engine.run_engine``), as ``criterion(input_ids [1, num_tokens], None)``.

Processors and per-request state: one ``LogitsProcessor`` instance given by the caller is shared by
every request (fine for stateless ones). For a stateful processor, wrap a factory in ``PerRequest``:
each request (and each of its sequences) gets its own instance; outside the engine (stock
``generate()``) ``PerRequest`` builds one instance and behaves like it.
"""

import copy
import logging
from typing import Any, Callable, Iterable

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.configuration_utils import GenerationMode

from .sampling_params import SamplingParams

logger = logging.getLogger("paged_transformers")

ENGINE_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


class PerRequest(LogitsProcessor):
    """A logits processor built fresh for every request (for processors that keep state).

    Args:
        factory: ``() -> LogitsProcessor``; called once per request sequence by the engine, once in all
            by stock ``generate()`` (which then calls that instance with the whole batch).

    Raises:
        ValueError: ``factory`` is not callable.

    Examples:
        >>> from transformers import NoRepeatNGramLogitsProcessor
        >>> from paged_transformers.generation_config import PerRequest
        >>> proc = PerRequest(lambda: NoRepeatNGramLogitsProcessor(2))
        >>> proc.new() is proc.new()
        False
    """

    def __init__(self, factory: Callable[[], Any]):
        if not callable(factory):
            raise ValueError(f"PerRequest needs a callable factory, got {factory!r}")
        self.factory = factory
        self._shared = None

    def new(self):
        """A fresh instance for one request."""
        return self.factory()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._shared is None:
            self._shared = self.factory()
        return self._shared(input_ids, scores)


def instantiate_per_request(processors: Iterable | None) -> list:
    """The processors for one request: ``PerRequest`` entries replaced by fresh instances."""
    return [p.new() if isinstance(p, PerRequest) else p for p in (processors or [])]


def check_engine_supported(gc: GenerationConfig) -> None:
    """Raise for a ``GenerationConfig`` the paged engine cannot honour.

    Raises:
        NotImplementedError: naming the option (``num_beams``, ``penalty_alpha``, ``dola_layers``,
            ``num_beam_groups``, ``constraints``/``force_words_ids``, ``guidance_scale``,
            ``output_attentions``, ``output_hidden_states``, ``prompt_lookup_num_tokens``,
            ``assistant_early_exit``, ``token_healing``).
    """
    unsupported = []
    if (gc.num_beams or 1) > 1:
        unsupported.append(f"num_beams={gc.num_beams} (beam search)")
    if (getattr(gc, "num_beam_groups", None) or 1) > 1:
        unsupported.append(f"num_beam_groups={gc.num_beam_groups}")
    if getattr(gc, "penalty_alpha", None):
        unsupported.append(f"penalty_alpha={gc.penalty_alpha} (contrastive search)")
    if getattr(gc, "dola_layers", None) is not None:
        unsupported.append(f"dola_layers={gc.dola_layers!r}")
    if getattr(gc, "constraints", None) is not None or getattr(gc, "force_words_ids", None) is not None:
        unsupported.append("constraints/force_words_ids (constrained beam search)")
    if gc.guidance_scale is not None and gc.guidance_scale != 1:
        unsupported.append(f"guidance_scale={gc.guidance_scale} (classifier-free guidance)")
    for name in ("output_attentions", "output_hidden_states", "token_healing"):
        if getattr(gc, name, False):
            unsupported.append(f"{name}=True")
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        if getattr(gc, name, None) is not None:
            unsupported.append(f"{name}={getattr(gc, name)!r}")
    if unsupported:
        raise NotImplementedError(f"the paged engine does not support GenerationConfig options: {', '.join(unsupported)}")


def prepare_generation_config(model, generation_config: GenerationConfig | None = None, **kwargs) -> GenerationConfig:
    """The ``GenerationConfig`` ``generate()`` would use: the model's defaults, ``generation_config`` and
    ``kwargs`` merged, special-token tensors set. Checked with ``check_engine_supported``.

    Raises:
        NotImplementedError: an unsupported option, or ``kwargs`` that are not generation options.
    """
    gc, model_kwargs = model._prepare_generation_config(copy.deepcopy(generation_config), **kwargs)
    if model_kwargs:
        raise NotImplementedError(f"keyword arguments that are not GenerationConfig options: {sorted(model_kwargs)}")
    device = next(model.parameters()).device
    model._prepare_special_tokens(gc, kwargs_has_attention_mask=True, device=device)
    check_engine_supported(gc)
    return gc


def eos_token_ids(gc: GenerationConfig) -> list[int]:
    """EOS ids of a prepared config (``_eos_token_tensor``), else of ``eos_token_id``."""
    eos = getattr(gc, "_eos_token_tensor", None)
    if eos is not None:
        return [int(t) for t in eos.flatten().tolist()]
    eos = gc.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def request_sampling_params(
    model,
    gc: GenerationConfig,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    *,
    logits_processor: Iterable | None = None,
    extra_processors_first: Iterable = (),
    extra_processors_last: Iterable = (),
    seed: int | None = None,
) -> SamplingParams:
    """``SamplingParams`` that make the engine sample one request as ``generate()`` would sample it alone.

    Args:
        model: the transformers model (its ``_get_logits_processor`` builds the processor list).
        gc: a prepared ``GenerationConfig`` (``prepare_generation_config`` or the one ``generate()`` made).
        prompt_token_ids: this request's prompt, no padding.
        max_new_tokens: new tokens at most for this request (>= 1).
        logits_processor: the caller's processors (``PerRequest`` entries instantiated for this request),
            merged into the list exactly as ``generate()`` merges them.
        extra_processors_first, extra_processors_last: run before / after the list (score recorders).
        seed: per-request seed for ``do_sample`` (None: the global torch RNG, as ``generate()``).

    Returns:
        ``SamplingParams`` with ``n=1``: greedy (``temperature=0``) or plain multinomial
        (``temperature=1`` with no engine-side top-k/top-p: the warpers are in the processor list),
        ``ignore_eos=True`` and ``stop_token_ids`` = the config's EOS ids inside the vocabulary, repetition penalty left to
        the transformers processor.

    Raises:
        NotImplementedError: an option the engine cannot honour (``check_engine_supported``).
        ValueError: ``max_new_tokens < 1``.
    """
    check_engine_supported(gc)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 for every request, got {max_new_tokens}")
    prompt_len = len(prompt_token_ids)
    row_gc = copy.copy(gc)
    # NOTE: length-based processors (ForcedEOS at max_length - 1, MinLength) see this request's own
    # length, so express the limits in it: prompt_len + the request's new-token budget.
    row_gc.max_length = prompt_len + max_new_tokens
    if gc.min_length:
        row_gc.min_length = prompt_len + max(0, gc.min_length - (gc.max_length - max_new_tokens))
    device = next(model.parameters()).device
    processors = model._get_logits_processor(
        generation_config=row_gc,
        input_ids_seq_length=prompt_len,
        encoder_input_ids=torch.tensor([prompt_token_ids], dtype=torch.int64, device=device),
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(instantiate_per_request(logits_processor)),
        device=device,
        model_kwargs={},
    )
    return SamplingParams(
        n=1,
        temperature=1.0 if gc.do_sample else 0.0,
        seed=seed,
        max_tokens=max_new_tokens,
        ignore_eos=True,
        # an EOS id outside the vocabulary (GPT2Config's default 50256 on a small vocab) can never be sampled:
        # stock generate() warns and runs, so it is dropped here rather than refused by the engine
        stop_token_ids=[t for t in eos_token_ids(gc) if 0 <= t < model.config.get_text_config().vocab_size],
        logits_processors=[*extra_processors_first, *processors, *extra_processors_last],
    )


class ScoreRecorder(LogitsProcessor):
    """Records the scores it is called with (one ``[vocab_size]`` float32 row per step), unchanged."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.steps.append(scores[0].detach().clone())
        return scores
