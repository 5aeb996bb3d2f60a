"""What ``LLMEngine.add_request`` checks before anything is queued: the prompt and the sampling parameters (and
``model_limits``, what ``LLMEngine`` checks of its model).

Every check raises a ``ValueError`` naming the bad value, before any state changes: a refused request
leaves no trace.
"""

import copy
import operator

import torch

from ..config import EngineConfig
from ..compat import can_set_attn_implementation
from ..sampling_params import SamplingParams


def check_text(text: str, what: str = "text") -> None:
    """Raise unless ``text`` (called ``what`` in the error) is valid Unicode: a lone UTF-16 surrogate (U+D800..U+DFFF,
    which JSON's ``"\\ud800"`` escape or ``surrogateescape`` decoding produce) has no UTF-8 encoding, and Hugging Face
    tokenizers raise a ``TypeError`` for it.

    Raises:
        ValueError: naming the surrogate and its character offset.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} has a lone UTF-16 surrogate U+{ord(text[e.start]):04X} at character {e.start} "
                         f"(not valid Unicode): {text[max(0, e.start - 20) : e.start + 1]!r}") from None


def tokenize(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt (string prompts need the tokenizer). Token ids may be a list or tuple of
    ints, a 1-D ``torch.Tensor`` or numpy array, or a list of numpy/torch integer scalars.

    Raises:
        ValueError: a string prompt without a tokenizer or with a lone UTF-16 surrogate (``check_text``), a tensor
            or array that is not 1-D, or a prompt of another type.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompt {prompt[:40]!r} is a string but no tokenizer was given; pass tokenizer= or token ids")
        check_text(prompt)
        return list(tokenizer(prompt).input_ids)
    if isinstance(prompt, torch.Tensor) or type(prompt).__module__ == "numpy":
        if getattr(prompt, "ndim", None) != 1:
            raise ValueError(
                f"a token-id prompt must be 1-D, got a {type(prompt).__name__} of shape {tuple(prompt.shape)}"
                + (" (a batch: pass its rows as separate prompts)" if getattr(prompt, "ndim", 0) == 2 else "")
            )
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    return [_as_token_id(t) for t in prompt]


def validate_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int, config: EngineConfig) -> None:
    """Check a tokenized prompt against the vocabulary and the engine's limits.

    Raises:
        ValueError: empty; an id that is not an integer (naming its type: float, bool, str, a nested
            list, ...); an id outside ``[0, vocab_size)``; ``len >= max_model_len``
            (at least one output token must fit); longer than ``max_num_batched_tokens`` with
            chunked prefill off.
    """
    if not prompt_token_ids:
        raise ValueError("prompt is empty: it needs at least one token")
    # the common case in C (a server checks every prompt on its event loop); _check_token_ids names what is wrong
    if not (set(map(type, prompt_token_ids)) == {int} and 0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab_size):
        _check_token_ids(prompt_token_ids, vocab_size)
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_token_ids)} tokens; max_model_len={max_model_len} leaves room for "
            f"prompts of at most {max_model_len - 1} tokens"
        )
    if not config.enable_chunked_prefill and len(prompt_token_ids) > config.max_num_batched_tokens:
        raise ValueError(
            f"prompt has {len(prompt_token_ids)} tokens, over max_num_batched_tokens="
            f"{config.max_num_batched_tokens}, and chunked prefill is off"
        )


def _check_token_ids(prompt_token_ids: list, vocab_size: int) -> None:
    """Raises ValueError naming the ids that are not integers (with their types), or else those outside
    ``[0, vocab_size)``."""
    not_ints = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool)]
    if not_ints:
        shown = ", ".join(f"{t!r} ({type(t).__name__})" for t in not_ints[:5])
        raise ValueError(f"prompt token ids must be integers (one flat list of ids), got {shown}")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def check_sampling_params(sampling_params, config: EngineConfig, vocab_size: int, tokenizer) -> SamplingParams:
    """The request's own copy of ``sampling_params`` (default ``SamplingParams()``), checked again.

    A ``SamplingParams`` changed after construction (``sp.n = 0``, ``sp.temperature = nan``) is refused here
    instead of failing a step for the whole batch, and changing it after ``add_request`` cannot reach the
    running request (the copy has its own lists).

    Raises:
        ValueError: not a ``SamplingParams``, a field out of range (``SamplingParams.validate``),
            ``n > max_num_seqs``, ``stop`` strings without a tokenizer, ``stop_token_ids`` outside the
            vocabulary, ``logprobs`` or ``prompt_logprobs`` over ``vocab_size``.
    """
    sampling_params = sampling_params if sampling_params is not None else SamplingParams()
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
    sampling_params = copy.copy(sampling_params)
    sampling_params.validate()
    if sampling_params.n > config.max_num_seqs:
        raise ValueError(f"n={sampling_params.n} exceeds max_num_seqs={config.max_num_seqs}: the n sequences run together")
    if sampling_params.stop and tokenizer is None:
        raise ValueError(f"stop={sampling_params.stop!r} needs a tokenizer to match text; pass tokenizer= or use stop_token_ids")
    bad_stop = [t for t in sampling_params.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab_size}): {bad_stop[:5]}")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(sampling_params, name)
        if k is not None and k > vocab_size:
            raise ValueError(f"{name}={k} exceeds the vocabulary size {vocab_size}")
    return sampling_params


def _as_token_id(token):
    """numpy / torch integer scalars as ``int``; anything else unchanged, for ``validate_prompt`` to name."""
    if isinstance(token, int):
        return token
    try:
        return operator.index(token)
    except TypeError:
        return token


def model_limits(model: torch.nn.Module, config: EngineConfig) -> tuple[int, int]:
    """``(vocab_size, max_model_len)`` of a model the engine can serve.

    Raises:
        ValueError: the model's attention does not go through ``AttentionInterface`` (naming its class); no
            ``max_model_len`` known; ``max_model_len`` over the model's ``max_position_embeddings``.
    """
    text_config = model.config.get_text_config()
    # NOTE: can_set_attn_implementation is transformers' own source heuristic; it says True for
    # models with no attention class at all (Mamba), so the config must also name attention heads.
    if not getattr(text_config, "num_attention_heads", None) or not can_set_attn_implementation(model):
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            "so the paged engine cannot replace its attention"
        )
    max_positions = getattr(text_config, "max_position_embeddings", None)
    max_model_len = config.max_model_len or max_positions
    if max_model_len is None:
        raise ValueError("the model config has no max_position_embeddings; set EngineConfig.max_model_len")
    if max_positions is not None and max_model_len > max_positions:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_positions}")
    return text_config.vocab_size, max_model_len
