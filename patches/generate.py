"""The one-line patch: ``paged_transformers.patch()`` routes ``model.generate()`` through the paged engine.

``patch()`` replaces three methods of ``transformers.GenerationMixin`` and routes GPTQ / AWQ checkpoints of
``AutoModelForCausalLM.from_pretrained`` to our own loader (``patches/loading.py``); ``unpatch()`` puts all back:

- ``generate``: records the call (the caller's logits processors, stopping criteria, options) and
  then runs stock ``generate()``, which validates the arguments, merges the ``GenerationConfig``,
  expands the batch for ``num_return_sequences`` and builds the processors, exactly as unpatched;
  a user ``PagedCache`` is told the prompt padding;
- ``_sample`` (greedy and sampling): instead of stock's padded loop, each batch row becomes one
  engine request (left padding stripped; its own processor list built for its own prompt; see
  ``paged_transformers.integration.generation_config``), the engine runs them with continuous batching, and the
  result is rebuilt as stock returns it: ``[batch, prompt_len + new]`` with the left-padded prompt,
  rows that finished early right-padded with ``pad_token_id``; with ``return_dict_in_generate`` a
  ``GenerateDecoderOnlyOutput`` with ``scores``/``logits`` when asked (one ``[batch, vocab]`` tensor
  per step; a row that already finished holds NaN there, where stock holds the scores of its
  pad-token continuation);
- ``_beam_search``: stock beam search on a ``PagedCache`` (beams share blocks by reference).

Whatever the engine cannot serve runs stock code, after a one-time log message: assisted decoding,
DoLa / contrastive / constrained / group beam search, ``output_attentions`` / ``output_hidden_states``,
classifier-free guidance, ``prefix_allowed_tokens_fn``, a streamer with more than one row, extra model
inputs (e.g. ``pixel_values``), a user cache that is not a ``PagedCache``, right padding, encoder-decoder
models, a model in training mode with dropout (the engine cannot draw stock's dropout masks; with every dropout
probability 0 the engine serves it). ``input_ids`` without a token raise a ValueError (``patches/eligibility.py``). The calls run on the model's warm engine (``paged_transformers.integration.warm``), made once and kept between calls
(KV pool, compiled layers, CUDA graphs) with the patch's ``engine_config`` or, without one, whatever engine the
model has warm; each row is one request. Plain ``model(...)`` forwards and training never see the paged
attention: the engine is attached to the model only while a call runs. A call whose rows need more than the
warm engine's ``max_model_len`` rebuilds it with the model's maximum, or, when ``patch()`` was given a config with
a shorter ``max_model_len``, raises a ValueError naming it.

Errors: a logits processor that raises fails only its own request inside the engine; ``generate()``
then re-raises that exception (the first failed row, by row index) after all rows finished, with
``exc.paged_failed_rows`` (``{row: exception}``) and ``exc.paged_partial_output`` (what the call would
have returned, the failed rows cut where they failed) attached.
"""

import contextvars
import functools
import inspect
import logging
import weakref
from dataclasses import dataclass

import torch
from transformers import GenerationMixin

from ..integration.cache import PagedCache
from ..compat import (
    PATCHED_GENERATION_METHODS, GenerateDecoderOnlyOutput, is_user_defined_cache, original_generation_method,
    pad_token_id,
)
from ..config import EngineConfig
from ..core.engine import run_engine
from ..integration.generation_config import ScoreRecorder, sampling_params_for_prompts
from ..integration.padding import unpadded_prompts
from ..integration.warm import attached_engine, release
from .eligibility import check_prompt_length, engine_blocker, prompt_padding
from .loading import patch_from_pretrained, unpatch_from_pretrained
from .pipeline import patch_pipeline, unpatch_pipeline

logger = logging.getLogger("paged_transformers")


@dataclass(slots=True)
class _Call:
    """What the patched ``generate`` saw for the call in progress."""

    model: object
    logits_processor: object  # the caller's own processors (not generate()'s defaults)
    user_position_ids: bool
    prefix_allowed_tokens_fn: bool
    engine_config: EngineConfig | None


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("paged_transformers_generate_call", default=None)
_ORIGINALS: dict[str, object] = {}
_ENGINE_CONFIG: list[EngineConfig | None] = [None]
_LOGGED: set[str] = set()
_DROP_IN_MODELS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models the patched generate() ran on
# the owner tag of the warm engines the patched generate() builds: unpatch() closes those, and no other entry
# point's (warm.release decides under the model's lock which engine is whose)
_OWNER = "paged_transformers.patch"


def _log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning("paged_transformers: %s; running stock transformers code for it", reason)


# -- patch / unpatch ----------------------------------------------------------------------------


class PatchHandle:
    """Returned by ``patch()``; as a context manager it undoes the patch on exit."""

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        unpatch()


def patch(engine_config: EngineConfig | None = None) -> PatchHandle:
    """Route ``model.generate()`` (and so ``pipeline("text-generation")``, which then hands a list of prompts to one
    ``generate()`` call: ``patches/pipeline.py``) through the paged engine.

    Idempotent; ``unpatch()`` restores transformers. Usable as ``with paged_transformers.patch(): ...``.

    Args:
        engine_config: the ``EngineConfig`` of the warm engine ``generate()`` calls run on (e.g.
            ``EngineConfig(gpu_memory_utilization=0.3)`` in a process that also trains: the KV pool stays within
            that budget). Default: the model's warm engine as it is, ``EngineConfig()`` when it has none.

    Returns:
        A ``PatchHandle`` (a context manager that calls ``unpatch()`` on exit).

    Raises:
        ValueError: ``engine_config`` is not an ``EngineConfig``.

    Examples:
        >>> import torch, paged_transformers
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <...>
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)).eval()
        >>> ids, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
        >>> stock = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        >>> with paged_transformers.patch():
        ...     paged = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        >>> torch.equal(paged, stock)
        True
    """
    if engine_config is not None and not isinstance(engine_config, EngineConfig):
        raise ValueError(f"engine_config must be an EngineConfig, got {type(engine_config).__name__}")
    _ENGINE_CONFIG[0] = engine_config
    patch_from_pretrained()
    patch_pipeline()
    if not _ORIGINALS:
        replacements = {"generate": _generate, "_sample": _sample, "_beam_search": _beam_search}
        for name in PATCHED_GENERATION_METHODS:
            _ORIGINALS[name] = original_generation_method(name)
            setattr(GenerationMixin, name, functools.wraps(_ORIGINALS[name])(replacements[name]))
    return PatchHandle()


def unpatch() -> None:
    """Undo ``patch()`` (a no-op when not patched), and release the warm engines the patched ``generate()``
    built (``paged_transformers.release``); an engine that ``paged_generate``, ``LLM`` or ``engine_for`` built
    stays, even one the patched calls ran on."""
    for model in list(_DROP_IN_MODELS):
        release(model, owner=_OWNER)
    _DROP_IN_MODELS.clear()
    unpatch_from_pretrained()
    unpatch_pipeline()
    for name, original in _ORIGINALS.items():
        setattr(GenerationMixin, name, original)
    _ORIGINALS.clear()
    _ENGINE_CONFIG[0] = None


def is_patched() -> bool:
    return bool(_ORIGINALS)


# -- the replaced methods -----------------------------------------------------------------------


def _generate(self, *args, **kwargs):
    original = _ORIGINALS["generate"]
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    arguments = {**bound.arguments, **bound.arguments.get("kwargs", {})}
    check_prompt_length(self, arguments)
    user_cache = arguments.get("cache", arguments.get("past_key_values"))
    if isinstance(user_cache, PagedCache) and user_cache._rows is None:
        user_cache.set_prompt_padding(arguments.get("attention_mask"))
    call = _Call(
        model=self,
        logits_processor=arguments.get("logits_processor"),
        user_position_ids=arguments.get("position_ids") is not None,
        prefix_allowed_tokens_fn=arguments.get("prefix_allowed_tokens_fn") is not None,
        engine_config=_ENGINE_CONFIG[0],
    )
    token = _CALL.set(call)
    try:
        return original(self, *args, **kwargs)
    finally:
        _CALL.reset(token)


def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, streamer=None, **model_kwargs):
    call = _CALL.get()
    if call is not None and call.model is self:
        reason = engine_blocker(self, call, input_ids, generation_config, synced_gpus, streamer, model_kwargs)
        if reason is None:
            pad_lens, reason = prompt_padding(input_ids, model_kwargs.get("attention_mask"))
        if reason is None:
            prompts = unpadded_prompts(input_ids, pad_lens)
            return _engine_generate(self, call, input_ids, prompts, stopping_criteria, generation_config, streamer)
        _log_once(reason)
    return _ORIGINALS["_sample"](
        self, input_ids, logits_processor, stopping_criteria, generation_config,
        synced_gpus=synced_gpus, streamer=streamer, **model_kwargs,
    )


def _beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, **model_kwargs):
    call = _CALL.get()
    key = "cache" if "cache" in model_kwargs else "past_key_values"
    cache = model_kwargs.get(key)
    if (
        call is not None and call.model is self and generation_config.use_cache and cache is not None
        and not isinstance(cache, PagedCache) and not is_user_defined_cache(cache)
        and not self.config.is_encoder_decoder
    ):
        _log_once("beam search is served by stock generate() on a PagedCache, not by the engine")
        num_rows, block_size = input_ids.shape[0], 16
        num_blocks = num_rows * (-(-generation_config.max_length // block_size) + 1)
        paged = PagedCache.from_model(self, num_blocks=num_blocks, block_size=block_size)
        mask = model_kwargs.get("attention_mask")
        paged.set_prompt_padding(None if mask is None else mask[:: generation_config.num_beams])
        model_kwargs[key] = paged
    return _ORIGINALS["_beam_search"](
        self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus, **model_kwargs
    )


# -- the engine path ----------------------------------------------------------------------------


def _engine_generate(model, call: _Call, input_ids, prompts: list[list[int]], stopping_criteria, gc, streamer):
    """Serve a greedy / sampling ``generate()`` call with the engine and rebuild stock's output.

    ``input_ids``: ``[batch, prompt_len]`` int64, left-padded; ``prompts``: its rows without the padding."""
    num_rows, prompt_len = input_ids.shape
    max_new = gc.max_length - prompt_len  # stock: every row gets max_length - padded prompt length
    want_scores = gc.return_dict_in_generate and gc.output_scores
    want_logits = gc.return_dict_in_generate and gc.output_logits
    raw = [ScoreRecorder() for _ in range(num_rows)] if want_logits else None
    processed = [ScoreRecorder() for _ in range(num_rows)] if want_scores else None
    params, criteria = sampling_params_for_prompts(
        model, gc, prompts, [max_new] * num_rows, logits_processor=call.logits_processor,
        stopping_criteria=stopping_criteria, processors_first=[[rec] for rec in raw] if raw else None,
        processors_last=[[rec] for rec in processed] if processed else None,
    )

    finals = {}
    _DROP_IN_MODELS.add(model)
    with attached_engine(model, engine_config=call.engine_config, min_model_len=max(map(len, prompts)) + max_new,
                         owner=_OWNER) as engine:
        for r, prompt in enumerate(prompts):
            engine.add_request(str(r), prompt, params[r], stopping_criteria=(criteria or {}).get(str(r)))
        for outputs in run_engine(engine):
            for out in outputs:
                if streamer is not None:
                    streamer.put(torch.tensor(out.outputs[0].token_ids[-1:], dtype=torch.int64))
                if out.finished:
                    finals[int(out.request_id)] = out.outputs[0]
    if streamer is not None:
        streamer.end()

    pad = pad_token_id(gc)
    pad = pad if pad is not None else 0
    new_len = max(len(finals[r].token_ids) for r in range(num_rows))
    sequences = torch.full((num_rows, prompt_len + new_len), pad, dtype=input_ids.dtype, device=input_ids.device)
    sequences[:, :prompt_len] = input_ids
    for r in range(num_rows):
        ids = finals[r].token_ids
        sequences[r, prompt_len : prompt_len + len(ids)] = torch.tensor(ids, dtype=input_ids.dtype)
    result = sequences
    if gc.return_dict_in_generate:
        result = GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=_stack_steps(processed, new_len, input_ids.device) if want_scores else None,
            logits=_stack_steps(raw, new_len, input_ids.device) if want_logits else None,
        )
    failed = {r: finals[r].error for r in range(num_rows) if finals[r].error is not None}
    if failed:
        first = failed[min(failed)]
        first.paged_failed_rows = failed
        first.paged_partial_output = result
        raise first
    return result


def _stack_steps(recorders: list[ScoreRecorder], num_steps: int, device) -> tuple[torch.Tensor, ...]:
    """Per step a ``[num_rows, vocab]`` tensor; rows that already finished are NaN. ``()`` for no step
    (every row failed at its first token: the caller then raises that error)."""
    if num_steps == 0:
        return ()
    vocab = next(len(s) for rec in recorders for s in rec.steps[:1])  # a row with a token recorded a step
    steps = []
    for t in range(num_steps):
        rows = [rec.steps[t] if t < len(rec.steps) else torch.full((vocab,), float("nan")) for rec in recorders]
        steps.append(torch.stack([row.to(device) for row in rows]))
    return tuple(steps)
