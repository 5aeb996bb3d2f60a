"""Whether the paged engine can serve a ``generate()`` call the patch intercepted (``patches/generate.py``), and
the checks that refuse a call before any forward.

``engine_blocker`` gives the reason a call runs stock code instead (logged once by the patch); the ``check_*``
functions raise a ValueError for a call that stock ``generate()`` would also fail, but only mid-forward.
"""

import torch

from ..compat import can_set_attn_implementation, is_user_defined_cache
from ..integration.generation_config import ENGINE_MODES
from ..integration.padding import left_padding

# model_kwargs that stock generate() itself puts next to the inputs; anything else (pixel_values,
# token_type_ids, ...) is a model input the engine does not pass, so stock code runs. `tokenizer` is
# generate()'s own (for stop_strings; pipeline(stop_sequence=...) passes it): the StopStringCriteria it
# built is in stopping_criteria, which the engine runs per request.
KNOWN_MODEL_KWARGS = {
    "attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep",
    "cache_position", "output_attentions", "output_hidden_states", "return_dict", "tokenizer",
}


def engine_blocker(model, call, input_ids, gc, synced_gpus, streamer, model_kwargs) -> str | None:
    """Why the engine cannot serve this ``_sample`` call (None when it can): ``call`` is the patch's record of the
    ``generate()`` call, the rest ``_sample``'s own arguments (``gc`` its ``GenerationConfig``).

    Raises:
        ValueError: the call would index past the model's learned position table (``check_position_table``).
    """
    check_position_table(model, input_ids, gc)
    if gc.get_generation_mode() not in ENGINE_MODES:
        return f"generation mode {gc.get_generation_mode().value}"
    if synced_gpus:
        return "synced_gpus"
    if model.config.is_encoder_decoder:
        return "encoder-decoder models"
    dropout = training_dropout(model)
    if dropout:
        # NOTE: the engine cannot reproduce stock's dropout draws, and its fused layers run none
        return f"a model in training mode with dropout {dropout} (model.eval() runs it on the engine)"
    if not can_set_attn_implementation(model):
        return f"{type(model).__name__} (its attention cannot be replaced)"
    if streamer is not None and input_ids.shape[0] > 1:
        return "a streamer with more than one row"
    for name in ("output_attentions", "output_hidden_states"):
        if getattr(gc, name, False):
            return f"{name}=True"
    if gc.guidance_scale is not None and gc.guidance_scale != 1:
        return "guidance_scale (classifier-free guidance)"
    if call.prefix_allowed_tokens_fn:
        return "prefix_allowed_tokens_fn (its batch_id is a batch row)"
    if call.user_position_ids:
        return "user-given position_ids"
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in KNOWN_MODEL_KWARGS)
    if extra:
        return f"model inputs {extra}"
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and is_user_defined_cache(cache):
        return "a user-given cache"
    # NOTE: the engine holds at most max_position_embeddings tokens per sequence (its max_model_len) and
    # caps there; stock code computes rotary positions for any length, so a RoPE model past the limit runs
    # stock code and returns what stock returns (learned position tables were refused above).
    max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_positions is not None and gc.max_length > max_positions:
        return f"max_length={gc.max_length} over max_position_embeddings={max_positions}"
    if gc.max_length <= input_ids.shape[1]:
        return "no new tokens to generate"
    return None


def check_prompt_length(model, arguments: dict) -> None:
    """Refuse ``input_ids`` without a token (``[batch, 0]``), on which stock ``generate()`` fails part-way (an
    IndexError in its padding check, or a reshape error in the forward, by model and arguments). ``arguments``:
    the ``generate()`` call's, by name. With ``inputs_embeds`` empty ids are by design; encoder-decoder models
    start their decoder from its start token.

    Raises:
        ValueError: naming the shape.
    """
    ids = arguments.get("inputs")
    ids = arguments.get("input_ids") if ids is None else ids
    if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[-1] != 0
            or arguments.get("inputs_embeds") is not None or model.config.is_encoder_decoder):
        return
    raise ValueError(f"input_ids of shape {tuple(ids.shape)} hold no token: generate() needs a prompt of at least one "
                     "token per row (or inputs_embeds)")


def training_dropout(model) -> float:
    """The largest dropout probability active in ``model``: of its modules in training mode, each ``nn.Dropout``'s
    ``p`` and each attention layer's ``attention_dropout`` (a float in Llama-style layers); 0.0 when none is."""
    rates = [0.0]
    for module in model.modules():
        if not module.training:
            continue
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            rates.append(module.p)
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, (int, float)):
            rates.append(float(rate))
    return max(rates)


def prompt_padding(input_ids, attention_mask) -> tuple[list[int] | None, str | None]:
    """``(pad_lens, None)``: each row's left padding (``padding.left_padding``, tokens); or ``(None, reason)`` for a
    mask the engine cannot serve (stock code runs it)."""
    try:
        pad_lens = left_padding(attention_mask, input_ids.shape[0])
    except ValueError:
        return None, "an attention_mask that is not left padding"
    if any(pad == input_ids.shape[1] for pad in pad_lens):
        return None, "an all-padding row"
    return pad_lens, None


# Module names of learned absolute-position tables (``nn.Embedding``): GPT-2 / GPT-Neo / GPTBigCode ``wpe``,
# OPT / BioGPT ``embed_positions``, BERT-style decoders ``position_embeddings``.
_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")


def check_position_table(model, input_ids, gc) -> None:
    """Refuse a call that would index past a learned absolute-position table, before any forward.

    Stock ``generate()`` feeds positions ``0 .. max_length - 2`` (the last token is sampled, never fed), so a
    decoder-only model with a table of ``max_position_embeddings`` rows fails mid-generation with
    ``IndexError: index out of range in self`` (a device-side assert on CUDA) once ``max_length`` exceeds
    ``max_position_embeddings + 1``. RoPE models compute positions for any length: not refused here.

    Raises:
        ValueError: naming the prompt length (padded, tokens), ``max_new_tokens``, ``max_length`` and the limit.
    """
    max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_positions is None or gc.max_length <= max_positions + 1 or model.config.is_encoder_decoder:
        return
    if not any(isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES
               for name, m in model.named_modules()):
        return
    prompt_len = input_ids.shape[1]
    raise ValueError(
        f"{type(model).__name__} has learned position embeddings for max_position_embeddings={max_positions} "
        f"positions, but a prompt of {prompt_len} tokens with max_new_tokens={gc.max_length - prompt_len} "
        f"(max_length={gc.max_length}) needs {gc.max_length - 1}: stock generate() would fail mid-generation. "
        f"Keep prompt length + max_new_tokens <= {max_positions + 1}"
    )
