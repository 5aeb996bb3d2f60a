"""``paged_generate()``: offline batch generation through the paged engine."""

from typing import Sequence as Seq

import torch
from tqdm.auto import tqdm

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


def paged_generate(
    model: torch.nn.Module,
    prompts: Seq[str] | Seq[list[int]],
    sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    *,
    tokenizer=None,
    engine_config: EngineConfig | None = None,
    generation_config=None,
    logits_processor=None,
    use_tqdm: bool = True,
) -> list[RequestOutput]:
    """Generate completions for many prompts with paged attention and continuous batching.

    Every prompt is validated before any is queued, so a bad one raises before any KV block is
    allocated. The model's attention implementation is restored on return.

    Args:
        model: a transformers causal LM (any dtype; weights on the device to run on).
        prompts: strings (``tokenizer`` required) or lists of token ids.
        sampling_params: one ``SamplingParams`` for all prompts, or one per prompt. Default:
            ``SamplingParams.from_generation_config(generation_config or model.generation_config)``.
        tokenizer: a transformers tokenizer, for string prompts and output text.
        engine_config: ``EngineConfig``; default ``EngineConfig()``.
        generation_config: used only when ``sampling_params`` is None.
        logits_processor: a ``LogitsProcessorList`` or list of processors applied to every request,
            after each request's own ``SamplingParams.logits_processors``. The same instances serve
            every request, so they must be stateless; give stateful ones per request instead.
        use_tqdm: show a progress bar (requests finished).

    Returns:
        One ``RequestOutput`` per prompt, in input order (``request_id`` is the prompt's index as a
        string).

    Raises:
        ValueError: a bad prompt (index named), a list of ``sampling_params`` of another length, or any
            error ``LLMEngine`` raises for the model or configuration.

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from paged_transformers import paged_generate, SamplingParams
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <...>
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
        >>> outs = paged_generate(model, [[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=3),
        ...                       use_tqdm=False)
        >>> [len(o.outputs[0].token_ids) for o in outs]
        [3, 3]
    """
    prompts = list(prompts)
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        params_list = list(sampling_params)
    else:
        if sampling_params is None:
            sampling_params = SamplingParams.from_generation_config(generation_config or model.generation_config)
        params_list = [sampling_params] * len(prompts)
    if logits_processor:
        params_list = [_with_processors(p, list(logits_processor)) for p in params_list]

    with LLMEngine(model, tokenizer=tokenizer, engine_config=engine_config) as engine:
        return run_to_completion(engine, prompts, params_list, use_tqdm=use_tqdm)


def run_to_completion(
    engine: LLMEngine, prompts: list, params_list: list[SamplingParams], use_tqdm: bool = True
) -> list[RequestOutput]:
    """Validate every prompt, queue them all on ``engine`` and step until each has finished.

    Returns:
        One ``RequestOutput`` per prompt, in input order; ``request_id`` is the prompt's index.

    Raises:
        ValueError: a bad prompt, naming its index; raised before anything is queued.
    """
    tokenized = []
    for i, prompt in enumerate(prompts):
        try:
            ids = engine.tokenize(prompt)
            engine.validate_prompt(ids)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from e
        tokenized.append(ids)
    for i, (prompt, ids, params) in enumerate(zip(prompts, tokenized, params_list)):
        engine.add_request(str(i), prompt if isinstance(prompt, str) else ids, params)
    outputs: dict[str, RequestOutput] = {}
    with tqdm(total=len(prompts), desc="paged_generate", disable=not use_tqdm or len(prompts) < 2) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
                    bar.update(1)
    return [outputs[str(i)] for i in range(len(prompts))]


def _with_processors(params: SamplingParams, processors: list) -> SamplingParams:
    from dataclasses import replace

    return replace(params, logits_processors=params.logits_processors + processors)
