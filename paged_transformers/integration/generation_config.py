"""The one ``GenerationConfig`` -> per-prompt ``SamplingParams`` adapter, with transformers' own logits processors.

``paged_generate(generation_config=...)`` (``sampling_params_from_generation_config``) and the patched
``model.generate()`` and so ``pipeline("text-generation")`` (``sampling_params_for_prompts`` on the config and
stopping criteria stock ``generate()`` prepared) map a ``GenerationConfig`` here.
``SamplingParams.from_generation_config`` maps, without a model, only the options that are ``SamplingParams``
fields (``sampling_params_fields``, in ``sampling_params.py``; this module's ``__all__`` names it and
``PerRequest`` too, so the adapter's whole API imports from one place).

The engine samples each request alone, so every ``GenerationConfig`` option that ``generate()``
implements as a ``LogitsProcessor`` (repetition_penalty, no_repeat_ngram_size, bad_words_ids,
typical_p, suppress_tokens, min_new_tokens, forced_eos_token_id, temperature/top-k/top-p/min-p
warpers, watermarking, ...) is served by building the very list ``generate()`` builds
(``compat.build_logits_processors``) once per request, for that request's own prompt, and calling it with
that request's history ``[1, num_tokens]`` (prompt + output, no padding). Then the sampler only takes
the argmax (``do_sample=False``) or draws from ``softmax(scores)`` (``do_sample=True``), which is what
``generate()`` does after its processors. Stopping criteria other than max length and EOS (e.g.
``stop_strings``, ``max_time``, a user's ``StoppingCriteria``) run per request on the same history, in the driver
loop (``engine.run_engine``), as ``criterion(input_ids [1, num_tokens], None)``.

Processors and per-request state: one ``LogitsProcessor`` instance given by the caller is shared by
every request (fine for stateless ones). For a stateful processor, wrap a factory in ``PerRequest``
(``logits_process.py``): each request (and each of its sequences) gets its own instance; outside the engine
(stock ``generate()``) ``PerRequest`` builds one instance and behaves like it.
"""

import copy
from typing import Iterable

import torch
from transformers import (
    EosTokenCriteria, GenerationConfig, LogitsProcessor, LogitsProcessorList, MaxLengthCriteria, MaxTimeCriteria,
    StopStringCriteria,
)

from .. import compat
from ..compat import GenerationMode, eos_token_ids
from ..logits_process import PerRequest, instantiate_per_request
from ..sampling_params import SamplingParams, sampling_params_fields

__all__ = [
    "ENGINE_MODES", "PerRequest", "ScoreRecorder", "check_engine_supported", "eos_token_ids",
    "instantiate_per_request", "request_sampling_params", "resolve_generation_config",
    "sampling_params_fields", "sampling_params_for_prompts", "sampling_params_from_generation_config",
]

ENGINE_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


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


def resolve_generation_config(model, generation_config: GenerationConfig | None = None, **kwargs) -> GenerationConfig:
    """The ``GenerationConfig`` ``generate()`` would use: the model's defaults, ``generation_config`` and
    ``kwargs`` merged, special-token tensors set. Checked with ``check_engine_supported``.

    Raises:
        NotImplementedError: an unsupported option, or ``kwargs`` that are not generation options.
    """
    gc, model_kwargs = compat.prepare_generation_config(model, copy.deepcopy(generation_config), **kwargs)
    if model_kwargs:
        raise NotImplementedError(f"keyword arguments that are not GenerationConfig options: {sorted(model_kwargs)}")
    check_engine_supported(gc)
    return gc


def sampling_params_from_generation_config(
    model, prompts: list[list[int]], generation_config: GenerationConfig | None = None, *,
    tokenizer=None, logits_processor: Iterable | None = None, **kwargs,
) -> tuple[list[SamplingParams], dict[str, list] | None]:
    """Per prompt, the ``SamplingParams`` that sample it as ``generate(generation_config, **kwargs)`` would
    sample it alone, and the stopping criteria ``generate()`` builds from the config (``stop_strings``,
    ``max_time``).

    Args:
        model: the transformers model (its defaults are merged as ``generate()`` merges them).
        prompts: token ids per prompt, no padding.
        generation_config, kwargs: as given to ``generate()``; None: ``model.generation_config``.
        tokenizer: needed for ``stop_strings``.
        logits_processor: the caller's processors (``request_sampling_params``).

    Returns:
        ``(params, stopping_criteria)``: one ``SamplingParams`` per prompt; criteria per request id (the prompt's
        index as a string), None when there are none.

    Raises:
        NotImplementedError: an option the engine cannot honour, naming it.
        ValueError: ``stop_strings`` without a tokenizer; a prompt left no room by ``max_length`` (index named).
    """
    gc = resolve_generation_config(model, generation_config, **kwargs)
    criteria = []
    if gc.stop_strings is not None:
        if tokenizer is None:
            raise ValueError(f"GenerationConfig.stop_strings={gc.stop_strings!r} needs tokenizer=")
        criteria.append(StopStringCriteria(stop_strings=gc.stop_strings, tokenizer=tokenizer))
    if gc.max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=gc.max_time))
    max_new_tokens = []
    for i, ids in enumerate(prompts):
        max_new = gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length - len(ids)
        if max_new < 1:
            raise ValueError(f"prompt {i}: {len(ids)} tokens leave no room under max_length={gc.max_length}")
        max_new_tokens.append(max_new)
    return sampling_params_for_prompts(model, gc, prompts, max_new_tokens, logits_processor=logits_processor,
                                       stopping_criteria=criteria)


def sampling_params_for_prompts(
    model, gc: GenerationConfig, prompts: list[list[int]], max_new_tokens: list[int], *,
    logits_processor: Iterable | None = None, stopping_criteria: Iterable = (),
    processors_first: list[list] | None = None, processors_last: list[list] | None = None,
) -> tuple[list[SamplingParams], dict[str, list] | None]:
    """Per prompt, ``request_sampling_params`` for a prepared config, and the stopping criteria the engine
    runs per request: ``stopping_criteria`` less ``MaxLengthCriteria`` and ``EosTokenCriteria`` (those are
    each request's ``max_tokens`` and ``stop_token_ids``).

    Args:
        gc: a prepared ``GenerationConfig`` (``resolve_generation_config`` or the one ``generate()`` made).
        prompts, max_new_tokens: per prompt, its token ids (no padding) and its new-token budget (tokens).
        processors_first, processors_last: per prompt, processors run before / after its list (score recorders).

    Returns:
        ``(params, stopping_criteria)`` as ``sampling_params_from_generation_config``.
    """
    criteria = [c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    params = [
        request_sampling_params(
            model, gc, prompt, max_new, logits_processor=logits_processor,
            extra_processors_first=processors_first[i] if processors_first else (),
            extra_processors_last=processors_last[i] if processors_last else (),
        )
        for i, (prompt, max_new) in enumerate(zip(prompts, max_new_tokens, strict=True))
    ]
    return params, ({str(i): criteria for i in range(len(prompts))} if criteria else None)


def request_sampling_params(
    model, gc: GenerationConfig, prompt_token_ids: list[int], max_new_tokens: int, *,
    logits_processor: Iterable | None = None, extra_processors_first: Iterable = (),
    extra_processors_last: Iterable = (), seed: int | None = None,
) -> SamplingParams:
    """``SamplingParams`` that make the engine sample one request as ``generate()`` would sample it alone.

    Args:
        model: the transformers model (it builds the processor list, ``compat.build_logits_processors``).
        gc: a prepared ``GenerationConfig`` (``resolve_generation_config`` or the one ``generate()`` made).
        prompt_token_ids: this request's prompt, no padding.
        max_new_tokens: new tokens at most for this request (>= 1).
        logits_processor: the caller's processors (``PerRequest`` entries instantiated for this request),
            merged into the list exactly as ``generate()`` merges them.
        extra_processors_first, extra_processors_last: run before / after the list (score recorders).
        seed: per-request seed for ``do_sample`` (None: the global torch RNG, as ``generate()``).

    Returns:
        ``SamplingParams`` with ``n=1``: greedy (``temperature=0``) or plain multinomial (``temperature=1``
        with no engine-side top-k/top-p: the warpers are in the processor list), ``ignore_eos=True`` and
        ``stop_token_ids`` = the config's EOS ids inside the vocabulary (an id outside it, e.g. GPT2Config's
        default 50256 on a small vocab, can never be sampled: stock ``generate()`` warns and runs, so it is
        dropped rather than refused by the engine), repetition penalty left to the transformers processor.

    Raises:
        NotImplementedError: an option the engine cannot honour (``check_engine_supported``).
        ValueError: ``max_new_tokens < 1``.
    """
    check_engine_supported(gc)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 for every request, got {max_new_tokens}")
    row_gc = _request_generation_config(gc, len(prompt_token_ids), max_new_tokens)
    processors = compat.build_logits_processors(
        model, row_gc, prompt_token_ids, LogitsProcessorList(instantiate_per_request(logits_processor))
    )
    vocab_size = model.config.get_text_config().vocab_size
    return SamplingParams(
        n=1, temperature=1.0 if gc.do_sample else 0.0, seed=seed, max_tokens=max_new_tokens, ignore_eos=True,
        stop_token_ids=[t for t in eos_token_ids(gc) if 0 <= t < vocab_size],
        logits_processors=[*extra_processors_first, *processors, *extra_processors_last],
    )


def _request_generation_config(gc: GenerationConfig, prompt_len: int, max_new_tokens: int) -> GenerationConfig:
    """A shallow copy of ``gc`` whose length limits are this request's own (tokens)."""
    row_gc = copy.copy(gc)
    # NOTE: length-based processors (ForcedEOS at max_length - 1, MinLength) see this request's own
    # length, so express the limits in it: prompt_len + the request's new-token budget.
    row_gc.max_length = prompt_len + max_new_tokens
    if gc.min_length:
        row_gc.min_length = prompt_len + max(0, gc.min_length - (gc.max_length - max_new_tokens))
    return row_gc


class ScoreRecorder(LogitsProcessor):
    """Records the scores it is called with (one ``[vocab_size]`` float32 row per step), unchanged."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.steps.append(scores[0].detach().clone())
        return scores
