"""``pipeline("text-generation")`` under the patch: a list of prompts goes to the engine in one ``generate()`` call.

Stock, a text-generation pipeline called on a list runs ``generate()`` once per ``batch_size`` prompts, one batch
after the other: its batch size bounds the memory of stock's padded KV cache. The paged engine has no such need:
its KV pool and ``max_num_seqs`` bound what runs at once, and continuous batching keeps every slot busy. So under
``patch()`` a pipeline called on a list hands the whole list to one ``generate()`` call (the pipeline's own
preprocessing, padding and postprocessing unchanged), and the engine schedules all its prompts together. Each
prompt's tokens do not depend on the batch it runs in, so the results are those of the per-batch calls.
The speed-up on 64 prompts at ``batch_size=8``: BENCHMARKS.md, the entry points as users call them.

The whole list goes in one call only where the engine will serve it: a list of more than one prompt (or chat), a
tokenizer that left-pads and has a pad token (what batching needs), and neither beam search nor a streamer asked
for in the call or the pipeline's generation config. Anything else keeps the pipeline's own batches, as stock
(datasets and generators stream batch by batch either way).
"""

import functools

_ORIGINAL = {}


def patch_pipeline() -> None:
    """Wrap ``TextGenerationPipeline.__call__`` (idempotent); ``unpatch_pipeline`` undoes it."""
    from transformers import TextGenerationPipeline

    if not _ORIGINAL:
        original = TextGenerationPipeline.__dict__["__call__"]
        _ORIGINAL["__call__"] = original
        TextGenerationPipeline.__call__ = functools.wraps(original)(_call)


def unpatch_pipeline() -> None:
    """Give ``TextGenerationPipeline`` its own ``__call__`` back (a no-op when not patched)."""
    from transformers import TextGenerationPipeline

    if _ORIGINAL:
        TextGenerationPipeline.__call__ = _ORIGINAL.pop("__call__")


def _call(self, text_inputs, **kwargs):
    if whole_list_in_one_call(self, text_inputs, kwargs):
        kwargs["batch_size"] = len(text_inputs)
    return _ORIGINAL["__call__"](self, text_inputs, **kwargs)


def whole_list_in_one_call(pipe, text_inputs, kwargs: dict) -> bool:
    """Whether a pipeline call on ``text_inputs`` runs as one ``generate()`` call under the patch (the module
    docstring's conditions)."""
    if not isinstance(text_inputs, list) or len(text_inputs) < 2 or _is_one_chat(text_inputs):
        return False
    tokenizer = pipe.tokenizer
    if tokenizer is None or tokenizer.pad_token_id is None or tokenizer.padding_side != "left":
        return False
    generate_kwargs = {**kwargs.get("generate_kwargs", {}), **kwargs}
    config = (generate_kwargs.get("generation_config") or getattr(pipe, "generation_config", None)
              or pipe.model.generation_config)
    num_beams = generate_kwargs.get("num_beams", getattr(config, "num_beams", 1))
    return (num_beams or 1) == 1 and generate_kwargs.get("streamer") is None


def _is_one_chat(text_inputs: list) -> bool:
    """A list of message dicts is one chat (one prompt), not a list of prompts."""
    return isinstance(text_inputs[0], dict)
