"""``paged_generate()``: offline batch generation through the paged engine."""

from dataclasses import replace
from typing import Sequence as Seq

import torch
from tqdm.auto import tqdm

from ..config import EngineConfig
from ..core.engine import LLMEngine, check_loaded_model, run_engine
from .generation_config import sampling_params_from_generation_config
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .warm import attached_engine


def paged_generate(
    model: torch.nn.Module, prompts: Seq[str] | Seq[list[int]],
    sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *, tokenizer=None,
    engine_config: EngineConfig | None = None, generation_config=None, logits_processor=None, use_tqdm: bool = True,
) -> list[RequestOutput]:
    """Generate completions for many prompts with paged attention and continuous batching.

    The call runs on the model's warm engine (``paged_transformers.integration.warm``: created on the first call, then reused with
    its KV pool, fused or compiled layers and CUDA graphs, and its prefix cache across calls). Every prompt is tokenized once
    and validated before any is queued, so a bad one raises before any KV block is taken. On return (or on error) the
    engine is detached: the model is its user's again, as it was.

    Args:
        model: a transformers causal LM (any dtype; weights on the device to run on).
        prompts: strings (``tokenizer`` required) or lists of token ids.
        sampling_params: one ``SamplingParams`` for all prompts, or one per prompt. Default: from ``generation_config``
            (else ``model.generation_config``), every option ``generate()`` honours for greedy/sampling, each prompt
            getting the processors ``generate()`` would build for it alone (``paged_transformers.integration.generation_config``);
            unsupported options raise ``NotImplementedError`` naming them.
        tokenizer: a transformers tokenizer, for string prompts and output text.
        engine_config: ``EngineConfig``; None: the warm engine as it is (``EngineConfig()`` when there is none).
            A config other than the warm engine's rebuilds it (``warm.engine_for``).
        generation_config: used only when ``sampling_params`` is None.
        logits_processor: a ``LogitsProcessorList`` or list of processors applied to every request, after each
            request's own ``SamplingParams.logits_processors``. The same instances serve every request, so they must
            be stateless; wrap a stateful one's factory in ``PerRequest`` (a fresh instance per request, with or
            without ``sampling_params``) or give instances per request in ``SamplingParams.logits_processors``.
        use_tqdm: show a progress bar (requests finished).

    Returns:
        One ``RequestOutput`` per prompt, in input order (``request_id`` is the prompt's index as a string).

    Raises:
        ValueError: ``model`` not a loaded model (a path: load it with ``paged_transformers.load_model``), ``prompts``
            not a list, a bad prompt (index named), a list of ``sampling_params`` of another length, or any error
            ``LLMEngine`` raises for the model or configuration.
        RuntimeError: called from inside a call on the same model (e.g. from a logits processor).

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from paged_transformers import paged_generate, SamplingParams
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <...>
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
        >>> outs = paged_generate(model, [[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        >>> [len(o.outputs[0].token_ids) for o in outs]
        [3, 3]
    """
    check_loaded_model(model)
    prompts, params_list = _given_params(prompts, sampling_params, logits_processor)
    with attached_engine(model, tokenizer=tokenizer, engine_config=engine_config) as engine:
        token_ids, stopping = tokenize_prompts(engine, prompts), None
        if params_list is None:  # from the GenerationConfig, per prompt's token ids (generation_config.py)
            params_list, stopping = sampling_params_from_generation_config(
                model, token_ids, generation_config, tokenizer=tokenizer, logits_processor=logits_processor)
        texts = [p if isinstance(p, str) else None for p in prompts]
        return run_to_completion(engine, token_ids, params_list, use_tqdm, stopping, texts)


def _given_params(prompts, sampling_params, logits_processor) -> tuple[list, list[SamplingParams] | None]:
    """``paged_generate``'s prompts as a list, and its ``SamplingParams`` per prompt with ``logits_processor`` appended
    (None: to be built from the ``GenerationConfig``), checked before any engine is attached.

    Raises:
        ValueError: ``prompts`` not a list or tuple; a list of ``sampling_params`` of another length.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}")
    prompts = list(prompts)
    if sampling_params is None:
        return prompts, None
    params_list = params_per_prompt(sampling_params, len(prompts))
    if logits_processor:
        params_list = [replace(p, logits_processors=p.logits_processors + list(logits_processor)) for p in params_list]
    return prompts, params_list


def params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: the list (or tuple) given, or the one given, repeated.

    Raises:
        ValueError: a list of another length than ``num_prompts``.
    """
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {num_prompts} prompts")
        return list(sampling_params)
    return [sampling_params] * num_prompts


def tokenize_prompts(engine: LLMEngine, prompts: list) -> list[list[int]]:
    """Each prompt's token ids (``LLMEngine.tokenize``: a string prompt is tokenized here, once), each checked
    against the engine's limits (``LLMEngine.validate_prompt``).

    Raises:
        ValueError: a bad prompt, naming its index.
    """
    token_ids = []
    for i, prompt in enumerate(prompts):
        try:
            ids = engine.tokenize(prompt)
            engine.validate_prompt(ids)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from e
        token_ids.append(ids)
    return token_ids


def run_to_completion(
    engine: LLMEngine, prompts: list, params_list: list[SamplingParams], use_tqdm: bool = True,
    stopping_criteria: dict | None = None, texts: list[str | None] | None = None,
) -> list[RequestOutput]:
    """Validate every prompt, queue them all on ``engine`` and step until each has finished
    (``stopping_criteria``: per request id, given to ``LLMEngine.add_request``).

    Args:
        prompts: strings or token ids (``tokenize_prompts``; token ids are not tokenized again).
        texts: per prompt, the text its output reports as ``prompt``; None: the string prompts (None for ids).

    Returns:
        One ``RequestOutput`` per prompt, in input order; ``request_id`` is the prompt's index.

    Raises:
        ValueError: a bad prompt, naming its index; raised before anything is queued.
    """
    token_ids = tokenize_prompts(engine, prompts)
    if texts is None:
        texts = [p if isinstance(p, str) else None for p in prompts]
    for i, (ids, params) in enumerate(zip(token_ids, params_list)):
        engine.add_request(str(i), ids, params, stopping_criteria=(stopping_criteria or {}).get(str(i)))
    outputs: dict[str, RequestOutput] = {}
    with tqdm(total=len(prompts), desc="paged_generate", disable=not use_tqdm or len(prompts) < 2) as bar:
        for step_outputs in run_engine(engine):
            for out in step_outputs:
                if out.finished:
                    out.prompt = texts[int(out.request_id)]
                    outputs[out.request_id] = out
                    bar.update(1)
    return [outputs[str(i)] for i in range(len(prompts))]
