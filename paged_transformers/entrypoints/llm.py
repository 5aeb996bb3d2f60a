"""``LLM``: vLLM's offline API (``LLM(model).generate(prompts, sampling_params)``, ``.chat(messages)``) over the
paged engine, and ``ModelEngine``, the same class under another write-up's argument names.

vLLM's quick-start code runs with only its import changed (``examples/quickstart_*.py``). The engine behind an
``LLM`` is the model's warm engine (``paged_transformers.integration.warm``), shared with ``paged_generate`` and patched
``generate()`` on the same model object: built at construction, reused by every call.
"""

import dataclasses
import numbers
import os

import torch

from ..integration import checkpoint, warm
from ..config import EngineConfig
from ..core.engine import LLMEngine
from ..core.engine_inputs import check_text
from ..integration.generate import params_per_prompt, run_to_completion
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
# GenerationConfig fields vLLM's get_default_sampling_params takes from the model (ModelConfig.get_diff_sampling_param)
_DEFAULT_SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")


class LLM:
    """A model, its tokenizer and a warm paged engine, for offline generation (vLLM's ``LLM``).

    Args (vLLM's names and defaults; ``model`` positional, the rest keyword-only as in vLLM; every argument is
    checked before anything is loaded):
        model: a local checkpoint folder, a hub id already in the local cache (``HF_HUB_OFFLINE`` honoured; when
            online an uncached id is downloaded, as vLLM does), or an already-loaded transformers causal LM (used
            as it is: its dtype and device stay). GPTQ v1 / AWQ GEMM folders load natively (``load_model``).
        tokenizer: a tokenizer folder or hub id, or a tokenizer object; default: the model's folder.
        skip_tokenizer_init: no tokenizer: prompts must be token ids and outputs have no text.
        trust_remote_code: let transformers run the checkpoint's own code.
        tensor_parallel_size: ranks the model is split over (``paged_transformers.distributed``); with more than 1,
            ``model`` must be a checkpoint folder or hub id, and this process becomes rank 0 and starts the others
            (one process per rank; under ``torchrun`` the existing group's processes: ``distributed.launcher``).
            At most the host's CUDA devices, or on CPU two per core. On the other ranks of a ``torchrun`` group
            the constructor serves rank 0 until rank 0's ``LLM`` closes, then destroys the group and exits (``SystemExit(0)``).
        dtype: ``"auto"``, ``"half"``/``"float16"``, ``"bfloat16"``, ``"float"``/``"float32"`` or a torch dtype.
            ``"auto"`` on CUDA is vLLM's rule: the config's dtype, float32 cast down to bfloat16 (float16 where the
            device has no bfloat16); on CPU it is float32, where vLLM would pick bfloat16, because CPU half-precision
            matmuls are slower than float32.
        quantization: None reads the method from the checkpoint's ``quantization_config``; ``"gptq"`` or ``"awq"``
            must match it.
        seed: as in vLLM, where the worker seeds its random generators at start: ``torch.manual_seed(seed)`` at
            construction, so requests without their own ``SamplingParams.seed`` draw from a stream that starts
            there (reproducible from process start; calls in sequence get different draws). None leaves the global
            generator alone. A request's own ``seed`` always wins.
        gpu_memory_utilization, max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
        enable_prefix_caching, enforce_eager: ``EngineConfig`` fields (vLLM's meaning). ``max_num_seqs`` and
            ``max_num_batched_tokens`` left None are picked for the device as vLLM's ``LLM`` picks them: 1024 and
            16384 on a CUDA device of >= 70 GiB that is not an A100, else 256 and 8192 (``EngineConfig`` has the rule).
        device: where an unloaded checkpoint goes; default ``"cuda"`` if available, else ``"cpu"``.
        **engine_kwargs: any other ``EngineConfig`` field (``kv_cache_memory_bytes``, ``num_gpu_blocks``,
            ``attention_backend``, ``enable_chunked_prefill``, ``async_scheduling``, ...).

    Raises:
        ValueError: a bad argument (named with its value), a missing folder or uncached hub id, a ``quantization``
            contradicting the checkpoint, a loaded model with another ``dtype``/``device`` than asked, no usable
            tokenizer, or anything ``LLMEngine`` refuses (a KV pool too small, ...).
        NotImplementedError: a checkpoint format ``load_model`` does not read.
        TypeError: a keyword argument that is neither an ``LLM`` argument nor an ``EngineConfig`` field.

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from paged_transformers import LLM, SamplingParams
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
        >>> with LLM(model, kv_cache_memory_bytes=1 << 20) as llm:
        ...     outs = llm.generate([[1, 2, 3], {"prompt_token_ids": [4, 5]}], SamplingParams(temperature=0, max_tokens=3),
        ...                         use_tqdm=False)
        >>> [len(o.outputs[0].token_ids) for o in outs], outs[1].prompt_token_ids
        ([3, 3], [4, 5])
        >>> LLM(model, tensor_parallel_size=2)
        Traceback (most recent call last):
        ...
        ValueError: tensor_parallel_size=2 needs a checkpoint folder or hub id (every rank loads its shard), got a loaded LlamaForCausalLM
    """

    def __init__(
        self,
        model,
        *,
        tokenizer=None,
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype="auto",
        quantization: str | None = None,
        seed: int | None = 0,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        device: str | torch.device | None = None,
        **engine_kwargs,
    ):
        _check_tensor_parallel_size(tensor_parallel_size, model)
        torch_dtype = checkpoint.parse_dtype(dtype)
        checkpoint.check_quantization(quantization)
        for name, value in (("skip_tokenizer_init", skip_tokenizer_init), ("trust_remote_code", trust_remote_code)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        unknown = sorted(set(engine_kwargs) - _ENGINE_FIELDS)
        if unknown:
            raise TypeError(f"LLM got unexpected keyword arguments {unknown}; it takes EngineConfig's fields {sorted(_ENGINE_FIELDS)}")
        self.engine_config = EngineConfig(
            block_size=block_size, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size, **engine_kwargs,
        )  # fmt: skip
        device = _parse_device(device)
        self._parallel = None if tensor_parallel_size == 1 else _start_parallel(  # the DriverEngine of a split model
            model, tokenizer, skip_tokenizer_init, trust_remote_code, torch_dtype, quantization, device, self.engine_config)
        if self._parallel is not None:
            self.model, self.tokenizer = self._parallel.model, self._parallel.tokenizer
        elif isinstance(model, torch.nn.Module):
            self.model = checkpoint.check_loaded_model(model, torch_dtype, quantization, device)
            folder = getattr(model, "name_or_path", None) or None
            self.tokenizer = checkpoint.tokenizer_for(tokenizer, folder if folder and os.path.isdir(folder) else None,
                                                      skip_tokenizer_init, trust_remote_code)  # fmt: skip
        elif isinstance(model, (str, os.PathLike)):
            self.model, self.tokenizer = checkpoint.load_from_checkpoint(
                model, tokenizer, skip_tokenizer_init, trust_remote_code, torch_dtype, quantization, max_model_len,
                device or _default_device(),
            )  # fmt: skip
        else:
            raise TypeError(f"model must be a checkpoint folder, a hub id or a transformers model, got {type(model).__name__}")
        if seed is not None:
            torch.manual_seed(int(seed))
        if self._parallel is None:
            # built now, as vLLM allocates its KV cache at construction: a pool too small fails here, not at generate()
            warm.engine_for(self.model, tokenizer=self.tokenizer, engine_config=self.engine_config)

    # -- the engine ------------------------------------------------------------------------------
    @property
    def llm_engine(self) -> LLMEngine:
        """The model's warm ``LLMEngine`` (rebuilt with this ``LLM``'s config if another entry point replaced it);
        with ``tensor_parallel_size > 1``, rank 0's ``DriverEngine``."""
        if self._parallel is not None:
            return self._parallel
        return warm.engine_for(self.model, tokenizer=self.tokenizer, engine_config=self.engine_config)

    def attached_engine(self):
        """Context manager: the engine attached for a call or a server's life (``warm.attached_engine``; TP: rank 0's)."""
        return self._parallel.for_call() if self._parallel is not None else warm.attached_engine(
            self.model, tokenizer=self.tokenizer, engine_config=self.engine_config)

    def get_tokenizer(self):
        """The tokenizer (None with ``skip_tokenizer_init``)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's default: ``SamplingParams()`` updated with the model's generation config where it sets
        ``repetition_penalty``, ``temperature``, ``top_k``, ``top_p``, ``min_p`` or ``max_new_tokens`` (as
        ``max_tokens``). As in vLLM, ``do_sample`` is not read: a generation config with ``temperature=0.6``
        samples at 0.6."""
        config = getattr(self.model, "generation_config", None)
        values = config.to_diff_dict() if config is not None else {}
        fields = {name: values[name] for name in _DEFAULT_SAMPLING_FIELDS if values.get(name) is not None}
        if values.get("max_new_tokens") is not None:
            fields["max_tokens"] = values["max_new_tokens"]
        return SamplingParams(**fields)

    def sleep(self, *args, **kwargs) -> None:
        """vLLM's ``LLM.sleep(level=1)``: the engine's ``sleep`` with the same arguments (frees the KV memory).

        Raises:
            NotImplementedError: this engine has no ``sleep``.
        """
        self._engine_method("sleep", *args, **kwargs)

    def wake_up(self, *args, **kwargs) -> None:
        """vLLM's ``LLM.wake_up()``: the engine's ``wake_up`` with the same arguments.

        Raises:
            NotImplementedError: this engine has no ``wake_up``.
        """
        self._engine_method("wake_up", *args, **kwargs)

    def _engine_method(self, name: str, *args, **kwargs) -> None:
        with self.attached_engine() as engine:
            method = getattr(engine, name, None)
            if method is None:
                raise NotImplementedError(f"this LLMEngine has no {name}()")
            method(*args, **kwargs)

    def close(self) -> None:
        """Release the model's warm engine (KV pool, graphs); a later call builds it again. With
        ``tensor_parallel_size > 1``: close every rank's engine and end the worker processes, for good."""
        if self._parallel is not None:
            self._parallel.close()
            return
        warm.release(self.model)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt, batched continuously on the warm engine.

        Args:
            prompts: vLLM's ``PromptType``, one or a list: a string, a list of token ids, ``{"prompt": str}`` or
                ``{"prompt_token_ids": [...]}`` (with an optional ``"prompt"`` text to report).
            sampling_params: one ``SamplingParams`` for all, or one per prompt; default
                ``get_default_sampling_params()``.
            use_tqdm: show a progress bar.

        Returns:
            One ``RequestOutput`` per prompt, in input order: ``.prompt`` (None for token ids), ``.prompt_token_ids``,
            ``.outputs[0].text``, ``.token_ids``, ``.finish_reason``.

        Raises:
            ValueError: an empty or malformed prompt (its index named), ``sampling_params`` of another length or a
                bad one (``LLMEngine.add_request``); the engine is left with none of this call's requests.
        """
        return self._run(parse_prompts(prompts), sampling_params, use_tqdm)

    def chat(
        self, messages, sampling_params=None, use_tqdm: bool = True, chat_template: str | None = None,
        add_generation_prompt: bool = True, continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, each rendered with the tokenizer's chat template (vLLM's ``chat``).

        Args:
            messages: one conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a list of them.
            sampling_params, use_tqdm: as in ``generate``.
            chat_template: a Jinja template replacing the tokenizer's.
            add_generation_prompt, continue_final_message, chat_template_kwargs: passed to
                ``tokenizer.apply_chat_template``.

        Returns:
            One ``RequestOutput`` per conversation, in order; ``.prompt`` is the rendered text, tokenized without
            adding special tokens again (the ids ``apply_chat_template(..., tokenize=True)`` gives).

        Raises:
            ValueError: no tokenizer, a malformed conversation or one with a lone UTF-16 surrogate (its index named),
                or the tokenizer's own error (e.g. it has no chat template).
        """
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer, and this LLM has none (skip_tokenizer_init=True or none found)")
        parsed = []
        for i, conversation in enumerate(_conversations(messages)):
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}),
            )  # fmt: skip
            check_text(text, f"conversation {i}")  # the tokenizer's own error for a lone surrogate is a TypeError
            parsed.append((self.tokenizer(text, add_special_tokens=False).input_ids, text))
        return self._run(parsed, sampling_params, use_tqdm)

    def _run(self, parsed: list[tuple], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        """Run ``(engine prompt, reported text)`` pairs to completion on the warm engine."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = params_per_prompt(sampling_params, len(parsed))
        # (a request refused midway leaves none queued: attached_engine aborts unfinished requests on exit)
        with self.attached_engine() as engine:
            return run_to_completion(engine, [p for p, _ in parsed], params_list, use_tqdm=use_tqdm,
                                     texts=[text for _, text in parsed])


class ModelEngine(LLM):
    """``LLM`` under the argument names of another popular write-up: ``max_context_length`` (= ``max_model_len``),
    ``max_concurrent_requests`` (= ``max_num_seqs``), ``max_tokens_per_batch`` (= ``max_num_batched_tokens``);
    ``quantization`` and every other argument as in ``LLM``.

    Raises:
        ValueError: an alias and its vLLM name both given, with different values (both named); else as ``LLM``.

    Examples:
        >>> ModelEngine(model="unused", max_context_length=512, max_model_len=1024)
        Traceback (most recent call last):
        ...
        ValueError: max_context_length=512 and max_model_len=1024 set the same limit to different values; give one of them
    """

    ALIASES = {"max_context_length": "max_model_len", "max_concurrent_requests": "max_num_seqs",
               "max_tokens_per_batch": "max_num_batched_tokens"}  # fmt: skip

    def __init__(self, model, *, max_context_length=None, max_concurrent_requests=None, max_tokens_per_batch=None, **kwargs):
        given = {"max_context_length": max_context_length, "max_concurrent_requests": max_concurrent_requests,
                 "max_tokens_per_batch": max_tokens_per_batch}  # fmt: skip
        for alias, name in self.ALIASES.items():
            value = given[alias]
            if value is None:
                continue
            if name in kwargs and kwargs[name] != value:
                raise ValueError(
                    f"{alias}={value!r} and {name}={kwargs[name]!r} set the same limit to different values; give one of them"
                )
            kwargs[name] = value
        super().__init__(model, **kwargs)


def parse_prompts(prompts) -> list[tuple[str | list, str | None]]:
    """vLLM's ``PromptType``, one or a list, as ``(what the engine takes, the prompt text to report)`` pairs.

    Raises:
        ValueError: no prompts, or a prompt of another type or a dict with other keys (its index named).
    """
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        prompts = [prompts]
    elif not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    return [_parse_prompt(i, prompt) for i, prompt in enumerate(prompts)]


def _parse_prompt(index: int, prompt) -> tuple[str | list, str | None]:
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, (list, tuple)):
        return list(prompt), None  # the engine checks the ids (and names this index)
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
        if unknown or not prompt:
            raise ValueError(f"prompt {index}: a prompt dict takes the keys {list(_PROMPT_KEYS)}, got {sorted(prompt)}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt {index}: 'prompt' must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            return prompt["prompt_token_ids"], text
        return text, text
    raise ValueError(f"prompt {index}: must be a string, a list of token ids or a prompt dict, got {type(prompt).__name__}")


def _is_token_ids(value) -> bool:
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value))  # fmt: skip


def _conversations(messages) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them, as a list of conversations.

    Raises:
        ValueError: empty, or a conversation that is not a non-empty list of dicts with a ``"role"`` and a
            ``"content"`` (index named).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a conversation (a list of message dicts) or a list of them, got {messages!r:.80}")
    conversations = list(messages) if isinstance(messages[0], (list, tuple)) else [messages]
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in conversation
        ):
            raise ValueError(f"conversation {i}: must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {conversation!r:.80}")
    return [list(c) for c in conversations]


def _check_tensor_parallel_size(size, model) -> None:
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if size > 1 and not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"tensor_parallel_size={size} needs a checkpoint folder or hub id (every rank loads its shard), "
                         f"got a loaded {type(model).__name__}")


def _start_parallel(model, tokenizer, skip_tokenizer_init, trust_remote_code, dtype, quantization, device, engine_config):
    """Rank 0's ``DriverEngine`` (``start_engine``); another rank of an existing group serves rank 0, then exits."""
    from ..distributed.launcher import start_engine

    engine = start_engine(model, tokenizer=tokenizer, skip_tokenizer_init=skip_tokenizer_init, trust_remote_code=trust_remote_code,
                          dtype=dtype, quantization=quantization, device=device or _default_device(), engine_config=engine_config)
    if engine is None:
        torch.distributed.destroy_process_group()
        raise SystemExit(0)
    return engine


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _parse_device(device) -> torch.device | None:
    """None stays None (the default device, or a loaded model's own)."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r}: {e}") from e
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch has no CUDA device")
    return parsed
