"""Every transformers API this package uses that is not in transformers' public top-level namespace.

transformers promises nothing about its submodules, private methods and private attributes: they change
between minor versions. Each one the package relies on is reached through this module alone, so a new
transformers release breaks in one place, and ``tests/test_compat.py`` calls every entry against the
installed transformers (CI runs it on the newest transformers and on 5.17.0, the lowest supported). Each
entry names the transformers versions it was checked on (the two ends of the supported range).
Public top-level names (``transformers.GenerationConfig``, ``transformers.StopStringCriteria``,
``transformers.GradientCheckpointingLayer``, ...) are imported from ``transformers`` where they are used.
"""

import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList

# Checked on 5.17.0 and 5.24.0: both live in transformers.generation (not top-level).
from transformers.generation import GenerateDecoderOnlyOutput, GenerationMode

__all__ = [
    "GenerateDecoderOnlyOutput", "GenerationMode", "PATCHED_GENERATION_METHODS", "attn_implementation",
    "build_logits_processors", "can_set_attn_implementation", "eos_token_ids", "is_user_defined_cache",
    "model_from_config", "original_generation_method", "pad_token_id", "prepare_generation_config",
    "workload_hints",
]

# Checked on 5.17.0 and 5.24.0: the GenerationMixin methods patch() replaces. ``_sample`` and ``_beam_search``
# are private; their signatures are ``(self, input_ids, logits_processor, stopping_criteria, generation_config,
# synced_gpus=False, [streamer=None,] **model_kwargs)``, and generate() calls them for greedy/sampling and beam
# search.
PATCHED_GENERATION_METHODS = ("generate", "_sample", "_beam_search")


def prepare_generation_config(model, generation_config: GenerationConfig | None, **kwargs) -> tuple[GenerationConfig, dict]:
    """The ``GenerationConfig`` ``generate()`` would use, with its special-token tensors set, and the kwargs
    that are not generation options (``generate()``'s model kwargs).

    Checked on 5.17.0 and 5.24.0: ``GenerationMixin._prepare_generation_config(generation_config, **kwargs)
    -> (config, model_kwargs)`` and ``_prepare_special_tokens(config, kwargs_has_attention_mask, device)`` (sets
    ``_eos_token_tensor``, ``_pad_token_tensor``, ...).
    """
    gc, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    device = next(model.parameters()).device
    model._prepare_special_tokens(gc, kwargs_has_attention_mask=True, device=device)
    return gc, model_kwargs


def build_logits_processors(
    model, gc: GenerationConfig, prompt_token_ids: list[int], logits_processor: LogitsProcessorList
) -> LogitsProcessorList:
    """The processor list ``generate()`` builds for ``gc`` and one unpadded prompt, ``logits_processor`` (the
    caller's) merged into it as ``generate()`` merges them.

    Checked on 5.17.0 and 5.24.0: ``GenerationMixin._get_logits_processor(generation_config,
    input_ids_seq_length, encoder_input_ids, prefix_allowed_tokens_fn, logits_processor, device, model_kwargs)``.
    """
    device = next(model.parameters()).device
    return model._get_logits_processor(
        generation_config=gc,
        input_ids_seq_length=len(prompt_token_ids),
        encoder_input_ids=torch.tensor([prompt_token_ids], dtype=torch.int64, device=device),
        prefix_allowed_tokens_fn=None,
        logits_processor=logits_processor,
        device=device,
        model_kwargs={},
    )


def eos_token_ids(gc: GenerationConfig) -> list[int]:
    """EOS ids of a prepared config (its private ``_eos_token_tensor``), else of ``eos_token_id``.

    Checked on 5.17.0 and 5.24.0: ``_prepare_special_tokens`` stores ``_eos_token_tensor`` (1-D int64, or None).
    """
    eos = getattr(gc, "_eos_token_tensor", None)
    if eos is not None:
        return [int(t) for t in eos.flatten().tolist()]
    eos = gc.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def pad_token_id(gc: GenerationConfig) -> int | None:
    """The pad id ``generate()`` pads finished rows with: the prepared ``_pad_token_tensor``, else ``pad_token_id``.

    Checked on 5.17.0 and 5.24.0: ``_prepare_special_tokens`` stores ``_pad_token_tensor`` (0-D int64, or None;
    EOS when the config has no pad id).
    """
    pad = getattr(gc, "_pad_token_tensor", None)
    pad = pad if pad is not None else gc.pad_token_id
    return None if pad is None else int(pad)


def can_set_attn_implementation(model) -> bool:
    """Whether the model's attention can be switched (``set_attn_implementation``).

    Checked on 5.17.0 and 5.24.0: ``PreTrainedModel._can_set_attn_implementation() -> bool``.
    """
    return model._can_set_attn_implementation()


def attn_implementation(config) -> str | None:
    """The attention implementation a model config selects.

    Checked on 5.17.0 and 5.24.0: ``PretrainedConfig._attn_implementation`` (a property; no public getter).
    """
    return config._attn_implementation


def is_user_defined_cache(cache) -> bool:
    """Whether ``generate()`` was given this cache by its caller (rather than building it).

    Checked on 5.17.0 and 5.24.0: ``generate()`` sets ``cache._is_user_defined = True`` on a user's cache.
    """
    return bool(getattr(cache, "_is_user_defined", False))


def model_from_config(model_cls, config, dtype: torch.dtype):
    """A model of ``model_cls`` with random weights for ``config``, in ``dtype``, on the current default device.

    Checked on 5.17.0 and 5.24.0: ``PreTrainedModel._from_config(config, dtype=...)`` (the public
    ``AutoModelForCausalLM.from_config`` needs an auto class).
    """
    return model_cls._from_config(config, dtype=dtype)


def workload_hints(**hints):
    """transformers' continuous-batching ``WorkloadHints(**hints)``, or None where it does not exist.

    Checked on 5.17.0 and 5.24.0: ``transformers.generation.continuous_batching.utils.WorkloadHints`` with the
    fields ``max_prompt_length``, ``max_generated_length``, ``num_requests`` (tokens, tokens, requests).
    """
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    return WorkloadHints(**hints)


def original_generation_method(name: str):
    """The ``GenerationMixin`` method ``name`` as defined on the class (one of ``PATCHED_GENERATION_METHODS``)."""
    return GenerationMixin.__dict__[name]
