"""One warm ``LLMEngine`` per model, shared by every entry point.

``paged_generate``, the patched ``model.generate()`` (and so ``pipeline("text-generation")``) and ``LLM`` run on
the engine ``engine_for(model)`` returns: created on first use, with its KV pool, fused (or compiled) layers, fused
projections and CUDA graphs made once and reused by every later call. Each call runs inside ``attached_engine``::

    with attached_engine(model, tokenizer=tok, engine_config=cfg) as engine:  # lock; get; check weights; attach
        engine.add_request(...); engine.step(); ...
    # here: unfinished requests aborted, engine detached (the model is its user's again), lock released

Policies:

- **Reuse and rebuild.** ``engine_config=None`` uses the warm engine as it is (``EngineConfig()`` when there is
  none); a config equal to the one the warm engine was built from (``requested_config``: its step limits left
  None, not the values picked for the device) reuses it; a different config closes it and builds a new one (one
  engine per model).
  A call that needs longer sequences than the warm engine's ``max_model_len`` (``min_model_len``) rebuilds it
  with ``max_model_len=None`` (the model's ``max_position_embeddings``) when the call gave no config, and is
  refused with a ValueError when its config sets a shorter ``max_model_len``.
- **Concurrency.** One stepping thread per engine: a lock per model is held for a whole call, so two threads
  calling ``generate()`` on one model run one after the other. During a call the model runs the paged
  attention, so a plain forward from another thread raises instead of computing without the cache. A call
  from inside a call on the same model (a logits processor calling ``generate()``) raises RuntimeError.
- **Weights.** Checked once per call, at attach (``weights.py``: version counters and a checksum of every
  weight): written in place since the last call (an optimizer step, fused or not, ``load_state_dict``, a write
  through ``.data``, a merged adapter) -> the prefix cache and the packed CPU weights are dropped; replaced, moved
  or re-typed (``model.to``, ``param.data = ...``) -> the engine is rebuilt with its config (logged at info).
- **Memory.** ``release(model)`` closes the engine (KV pool, graphs, compiled forwards and fused weights given
  back); ``engine_for(model).sleep()`` frees the KV pool and graphs only, and the next call wakes it up. Release
  before moving the model to another device (``model.cpu()`` to free the GPU): until the next call rebuilds it,
  the engine keeps its fused projection weights on the old device. The engine lives in a holder in
  ``model.__dict__`` that copies and pickles empty: ``copy.deepcopy(model)`` (an RL reference model) gets no
  engine, and the engine is freed when the model is garbage-collected.
"""

import contextlib
import copy
import dataclasses
import logging
import threading
from collections.abc import Iterator

import torch

from ..config import EngineConfig
from ..core.engine import LLMEngine
from ..core.weights import StaleWeightsError

logger = logging.getLogger("paged_transformers")

_ATTR = "_paged_transformers_warm"  # the holder's key in model.__dict__


class _Holder:
    """A model's warm engine, its call lock, and whether a call is in progress. Copies (``copy``,
    ``deepcopy``) and pickles as an empty holder, so the engine never travels with a copy of the model."""

    __slots__ = ("engine", "lock", "in_call", "owner")

    def __init__(self):
        self.engine: LLMEngine | None = None
        self.lock = threading.RLock()  # re-entrant: a nested call on the same thread raises instead of deadlocking
        self.in_call = False
        self.owner: str | None = None  # the owner tag of the call that built the engine (``attached_engine``)

    def __copy__(self) -> "_Holder":
        return _Holder()

    def __deepcopy__(self, memo) -> "_Holder":
        return _Holder()

    def __reduce__(self):
        return (_Holder, ())


def _holder(model: torch.nn.Module) -> _Holder:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a transformers causal LM (a torch.nn.Module), got {type(model).__name__}")
    holder = model.__dict__.get(_ATTR)
    if holder is None:
        holder = model.__dict__.setdefault(_ATTR, _Holder())  # atomic: two threads get one holder
    return holder


def current_engine(model: torch.nn.Module) -> LLMEngine | None:
    """The model's warm engine if it has an open one, else None (nothing is created)."""
    holder = model.__dict__.get(_ATTR) if isinstance(model, torch.nn.Module) else None
    engine = holder.engine if holder is not None else None
    return engine if engine is not None and not engine.closed else None


def engine_for(model: torch.nn.Module, *, tokenizer=None, engine_config: EngineConfig | None = None) -> LLMEngine:
    """The model's warm engine, created on first use and reused by every entry point.

    Reused when ``engine_config`` is None or equal to the warm engine's config; a different config closes the
    old engine and builds a new one. Between calls the engine is detached (the model is its user's): use it
    inside ``attached_engine`` to step it. Waits while another thread's call on the model is in progress.

    Args:
        model: a transformers causal LM.
        tokenizer: when given, becomes the engine's tokenizer (string prompts, output text, ``stop`` strings); it
            does not affect the KV cache, so the engine is kept.
        engine_config: ``EngineConfig``, or None for the warm engine as it is (``EngineConfig()`` if none).

    Returns:
        The open, detached ``LLMEngine`` of ``model``.

    Raises:
        ValueError: ``model`` not a ``torch.nn.Module``; a bad ``engine_config`` (checked before the warm engine is
            touched); anything ``LLMEngine`` raises for the model or the config (the old engine is closed then).
        RuntimeError: called from inside a call on this model that needs another config.

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from paged_transformers import SamplingParams, engine_for, paged_generate, release
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <...>
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
        >>> outs = paged_generate(model, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        >>> engine = engine_for(model)  # the engine that call ran on, kept warm (and detached)
        >>> engine.attached, engine.stats().num_requests
        (False, 1)
        >>> release(model)
        >>> engine.closed, engine.stats().num_blocks
        (True, 0)
    """
    holder = _holder(model)
    with holder.lock:
        return _engine_locked(holder, model, tokenizer, engine_config, None)


def _engine_locked(holder: _Holder, model, tokenizer, engine_config: EngineConfig | None, owner: str | None) -> LLMEngine:
    if engine_config is not None:
        if not isinstance(engine_config, EngineConfig):
            raise ValueError(f"engine_config must be an EngineConfig, got {type(engine_config).__name__}")
        engine_config = copy.copy(engine_config)
        engine_config.validate()  # a bad field raises here, before the warm engine is closed
    engine = holder.engine
    if engine is None or engine.closed:
        engine = _build(holder, model, tokenizer, engine_config, None, owner)
    elif engine_config is not None and engine_config != engine.requested_config:
        engine = _build(holder, model, tokenizer or engine.tokenizer, engine_config, "another engine_config was given",
                        owner)
    if tokenizer is not None:
        engine.tokenizer = tokenizer
    return engine


def _build(holder: _Holder, model, tokenizer, engine_config: EngineConfig | None, reason: str | None,
           owner: str | None) -> LLMEngine:
    """Close the holder's engine (its memory goes first) and put a new, detached one in its place, built for
    ``owner`` (the caller's tag, or None). Called with the holder's lock held."""
    if holder.in_call:
        raise RuntimeError(f"the warm engine of this model would be rebuilt ({reason}) from inside a call on it")
    old, holder.engine = holder.engine, None
    if old is not None and not old.closed:
        logger.info("paged_transformers: rebuilding the warm engine of %s: %s", type(model).__name__, reason)
        old.close()
    engine = LLMEngine(model, tokenizer=tokenizer, engine_config=engine_config)
    engine.detach()
    holder.engine, holder.owner = engine, owner
    return engine


def release(model: torch.nn.Module, *, owner: str | None = None) -> None:
    """Close and forget the model's warm engine: its KV pool, CUDA graphs, compiled forwards and fused weights are
    given back (``stats().num_blocks`` is 0 afterwards); the next call builds a new one. A no-op without one;
    waits for another thread's call on the model to finish.

    Args:
        model: a transformers causal LM.
        owner: when given, only an engine built by a call with this ``owner`` tag (``attached_engine``) is closed:
            the check is made under the model's lock, so an engine another entry point is building or has built
            is never taken for the owner's.

    Raises:
        RuntimeError: called from inside a call on this model.
    """
    holder = model.__dict__.get(_ATTR) if isinstance(model, torch.nn.Module) else None
    if holder is None:
        return
    with holder.lock:
        if holder.in_call:
            raise RuntimeError("release(model) from inside a call on this model")
        if owner is not None and holder.owner != owner:
            return
        engine, holder.engine, holder.owner = holder.engine, None, None
        if engine is not None:
            engine.close()


@contextlib.contextmanager
def attached_engine(
    model: torch.nn.Module, *, tokenizer=None, engine_config: EngineConfig | None = None, min_model_len: int | None = None,
    owner: str | None = None,
) -> Iterator[LLMEngine]:
    """The model's warm engine (``engine_for``), attached for one call.

    On entry: takes the model's lock (one call at a time per model), gets the engine (policies in the module
    docstring), makes room for ``min_model_len``, wakes it if asleep, and attaches it: our attention, compiled
    forwards, fused projections; the prefix cache dropped if the weights were written in place, the engine
    rebuilt if they were replaced. On exit, even on error: unfinished requests are aborted (no KV block stays
    held) and the engine is detached, so the model is its user's again.

    Args:
        model, tokenizer, engine_config: as in ``engine_for``.
        min_model_len: the longest sequence (prompt + output, tokens) the call needs, or None. A warm engine with
            a shorter ``max_model_len`` is rebuilt with ``max_model_len=None`` when ``engine_config`` is None.
        owner: a tag recorded with an engine this call builds or rebuilds (``release(model, owner=...)``), or None.

    Raises:
        ValueError: as ``engine_for``; ``engine_config.max_model_len`` (or the model's ``max_position_embeddings``)
            below ``min_model_len``, raised before anything is built or attached.
        RuntimeError: a call from inside a call on the same model.

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from paged_transformers import SamplingParams
        >>> from paged_transformers.compat import attn_implementation
        >>> from paged_transformers.integration.warm import attached_engine
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <...>
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
        >>> with attached_engine(model) as engine:
        ...     engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
        ...     while engine.has_unfinished_requests():
        ...         outs = engine.step()
        >>> len(outs[0].outputs[0].token_ids), attn_implementation(model.config) != "paged_transformers"
        (2, True)
    """
    limit = engine_config.max_model_len if isinstance(engine_config, EngineConfig) else None
    if min_model_len is not None and limit is not None and min_model_len > limit:
        raise ValueError(f"this call needs sequences of {min_model_len} tokens, over the engine config's "
                         f"max_model_len={limit}; raise EngineConfig.max_model_len, or leave it None (the model's maximum)")
    holder = _holder(model)
    with holder.lock:
        if holder.in_call:
            raise RuntimeError("a call on this model from inside a call on it (e.g. generate() from a logits "
                               "processor): the engine runs one call at a time per model")
        engine = _engine_locked(holder, model, tokenizer, engine_config, owner)
        if min_model_len is not None and engine.max_model_len < min_model_len:
            if engine_config is None:
                reason = f"a call needs {min_model_len} tokens, over max_model_len={engine.max_model_len}"
                engine = _build(holder, model, engine.tokenizer,
                                dataclasses.replace(engine.requested_config, max_model_len=None), reason, owner)
            if engine.max_model_len < min_model_len:
                raise ValueError(f"this call needs sequences of {min_model_len} tokens, over the engine's "
                                 f"max_model_len={engine.max_model_len} (the model's maximum)")
        engine.wake_up()
        try:
            engine.attach()
        except StaleWeightsError as e:
            engine = _build(holder, model, engine.tokenizer, engine.requested_config, str(e), owner)
            engine.attach()
        holder.in_call = True
        try:
            yield engine
        finally:
            holder.in_call = False
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
            engine.detach()
