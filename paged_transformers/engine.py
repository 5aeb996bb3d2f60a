"""``LLMEngine``: add_request / step / abort over the scheduler, runner and sampler.

One ``step()`` reads top to bottom: scheduler plans -> block manager grants slots -> runner packs
the batch and runs the model -> sampler -> scheduler appends tokens, checks stops, frees blocks ->
outputs. With async scheduling (``EngineConfig.async_scheduling``, on by default) a decode step is
scheduled and launched before the previous step's tokens are read back, so that this host work
overlaps the device's (``LLMEngine.step``; vLLM V1's async scheduling, SGLang's overlap scheduler).

An engine outlives calls: ``detach()`` gives the model back to its user (its own attention, forwards and
projection modules) and ``attach()`` installs the engine's again, checking the weights (``weights.py``);
``sleep()`` / ``wake_up()`` free and restore the KV pool. ``warm.py`` keeps one such engine per model.
"""

import copy
import dataclasses
import logging
import operator
import os
import time
from dataclasses import dataclass

import torch

from .attention import ATTENTION_NAME, install_step_hooks, resolve_backend
from .kv_pool import KVPool
from .config import EngineConfig
from .generation_config import PerRequest, instantiate_per_request
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .prefix_cache import CacheStats
from .runner import ModelRunner
from .sampling import SampleLaunch, Sampler, _to_device
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceStatus
from .sizing import model_compute_dtype, model_kv_shape, num_kv_blocks
from .streaming import cut_at_stop, first_stop
from .weights import StaleWeightsError, WeightsChange, WeightsSnapshot

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics


@dataclass(slots=True)
class _InFlight:
    """A launched step whose sampled tokens the host has not applied yet (async scheduling: at most one
    is left running between ``step()`` calls)."""

    plan: SchedulerOutput
    sample_seqs: list[Sequence]  # the sampler's rows: sampled sequences, then their pending forks
    launch: SampleLaunch | None  # None when no row is sampled (prompt chunks only)
    advanced: bool = False  # Scheduler.advance applied: its sequences hold placeholders until collected


class LLMEngine:
    """The paged, continuously batched engine around an unmodified transformers causal LM.

    The engine is constructed attached: the model's ``attn_implementation`` is ``ATTENTION_NAME``, and its
    compiled forwards, fused projections and step hooks are installed. While attached, a forward of the model
    without the engine's step metadata raises (it never attends without the cache's causal structure).
    ``detach()`` hands the model back to its user as it was (a plain forward, backward, training step,
    ``state_dict`` or ``save_pretrained`` then behave as stock) while the engine keeps its KV pool, prefix
    cache, CUDA graphs, compiled forwards and fused weights; ``attach()`` installs them again. ``close()`` (or
    leaving the ``with`` block) detaches for good and frees everything.

    Weights are live: the fused projections are views of the model's own parameters' storage and the graphs
    read that storage, so in-place writes between calls are what the next step computes with. ``attach()``
    drops the prefix cache when a parameter or buffer was written in place since ``detach()`` and refuses
    (``StaleWeightsError``) when one was replaced (see ``paged_transformers.weights``).

    Args:
        model: a transformers causal LM whose attention goes through ``AttentionInterface``.
        tokenizer: optional; needed for string prompts, output text and ``stop`` strings.
        engine_config: ``EngineConfig``; default ``EngineConfig()``.

    Raises:
        ValueError: ``model`` not a loaded model (a path or hub id: see ``check_loaded_model``);
            ``engine_config`` not an ``EngineConfig`` or with a bad field (checked again here, so
            a field changed after construction is caught too); another engine is open on the model (one
            engine per model at a time); the model's attention cannot be replaced (names the model class);
            ``max_model_len`` over the model's ``max_position_embeddings``; a pool too small for one
            ``max_model_len`` sequence (with the numbers).

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from paged_transformers import LLMEngine, SamplingParams
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <...>
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
        >>> with LLMEngine(model) as engine:
        ...     engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
        ...     while engine.has_unfinished_requests():
        ...         outs = engine.step()
        >>> len(outs[0].outputs[0].token_ids), outs[0].outputs[0].finish_reason
        (4, 'length')
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, engine_config: EngineConfig | None = None):
        check_loaded_model(model)
        if engine_config is not None and not isinstance(engine_config, EngineConfig):
            raise ValueError(f"engine_config must be an EngineConfig, got {type(engine_config).__name__}")
        # Our own copy, checked again: a config changed after construction gets the same ValueError,
        # and one changed while the engine runs does not reach the scheduler.
        self.config = copy.copy(engine_config) if engine_config is not None else EngineConfig()
        self.config.validate()
        _check_not_attached(model)
        self.closed = False
        self.attached = False
        self.sleeping = False
        self.model = model
        self.tokenizer = tokenizer
        model_config = model.config
        # NOTE: _can_set_attn_implementation is transformers' own source heuristic; it says True for
        # models with no attention class at all (Mamba), so the config must also name attention heads.
        has_attention = getattr(model_config.get_text_config(), "num_attention_heads", None)
        if not has_attention or not getattr(model, "_can_set_attn_implementation", lambda: False)():
            raise ValueError(
                f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
                "so the paged engine cannot replace its attention"
            )
        self.vocab_size = model_config.get_text_config().vocab_size
        max_positions = getattr(model_config.get_text_config(), "max_position_embeddings", None)
        self.max_model_len = self.config.max_model_len or max_positions
        if self.max_model_len is None:
            raise ValueError("the model config has no max_position_embeddings; set EngineConfig.max_model_len")
        if max_positions is not None and self.max_model_len > max_positions:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={max_positions}")

        param = next(model.parameters())
        device, dtype = param.device, model_compute_dtype(model)
        num_layers, num_kv_heads, head_dim = model_kv_shape(model_config)
        bytes_per_block = KVPool.bytes_per_block(num_layers, self.config.block_size, num_kv_heads, head_dim, dtype)
        t0 = time.perf_counter()
        num_blocks = num_kv_blocks(model, self.config, self.max_model_len, bytes_per_block)
        sizing_s = time.perf_counter() - t0
        needed = -(-self.max_model_len // self.config.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV pool holds {num_blocks} blocks of {self.config.block_size} tokens "
                f"({num_blocks * self.config.block_size} tokens, {bytes_per_block} bytes per block), fewer than the "
                f"{needed} blocks one max_model_len={self.max_model_len} sequence needs; raise the KV budget or lower max_model_len"
            )
        self.cache = KVPool(num_layers, num_blocks, self.config.block_size, num_kv_heads, head_dim, dtype, device)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.scheduler = Scheduler(self.config, self.cache.block_manager, self._check_stop)
        self.sampler = Sampler(self.eos_token_ids, self.vocab_size)

        backend = resolve_backend(self.config.attention_backend, device)
        self.requests: dict[str, _Request] = {}
        self._install()
        t0 = time.perf_counter()
        try:
            self.runner = ModelRunner(
                model, self.cache, backend, max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens, max_model_len=self.max_model_len,
                use_cuda_graphs=not self.config.enforce_eager, compile_layers=self.config.compile_layers,
                fuse_projections=self.config.fuse_projections, cpu_prepack_weights=self.config.cpu_prepack_weights,
            )
        except BaseException:
            self.close()  # the model gets its attention back
            raise
        # seconds: the KV pool's sizing (on CUDA a profiled forward) and the runner's start (compiled layers)
        self.startup_times = {"kv_sizing_s": sizing_s, "runner_s": time.perf_counter() - t0}
        logger.info("paged_transformers: KV pool of %d blocks of %d tokens, sized in %.1f s; runner ready in %.1f s%s",
                    num_blocks, self.config.block_size, sizing_s, self.startup_times["runner_s"],
                    " (layers compiled)" if self.runner.compiled_layers else "")
        self.peak_num_used_blocks = 0
        self.device = device
        self._in_flight: _InFlight | None = None  # async scheduling: the step left running on the device
        self.num_pipelined_steps = 0  # steps launched before the previous step's tokens were read
        self._weights = WeightsSnapshot.take(model)  # after fusion: fusing moves the projections' storage

    # -- lifecycle -------------------------------------------------------------------------------
    def _install(self) -> None:
        """Our attention implementation and the step hooks on the model (the runner's modules: ``runner.attach``)."""
        self._previous_attn = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTENTION_NAME)
        self._step_hooks = install_step_hooks(self.model)
        self.attached = True

    def _uninstall(self) -> None:
        """Undo ``_install``: the step hooks removed, the model's previous attention implementation back."""
        for hook in self._step_hooks:
            hook.remove()
        self._step_hooks = []
        if self.model.config._attn_implementation == ATTENTION_NAME:
            self.model.set_attn_implementation(self._previous_attn)
        self.attached = False

    def attach(self) -> None:
        """Install the engine in the model for a call: our attention implementation, the compiled forwards, the
        fused projection modules and the step hooks (cheap swaps of objects the engine keeps: nothing is
        recompiled or captured again). Checks the weights against the snapshot of ``detach()``: written in place
        since then (an optimizer step, ``load_state_dict``) -> the prefix cache is dropped (its K/V came from the
        old weights); the EOS ids are read again from the model's generation config (and the tokenizer).
        Idempotent.

        Raises:
            RuntimeError: the engine is closed.
            StaleWeightsError: a parameter or buffer was replaced, moved or re-typed since ``detach()``
                (``model.to``, ``param.data = ...``, a wrapped module): the engine's fused weights and CUDA
                graphs read the old tensors; close it and build a new one (the warm entry points do).
            ValueError: another engine is attached to the model.
        """
        if self.closed:
            raise RuntimeError("this LLMEngine is closed; create a new one")
        if self.attached:
            return
        _check_not_attached(self.model)
        change, detail = self._weights.compare(self.model)
        if change is WeightsChange.REPLACED:
            raise StaleWeightsError(f"the model's weights were replaced since this engine last ran ({detail}); "
                                    "close it and build a new one")
        self._install()
        self.runner.attach()
        eos = _eos_token_ids(self.model, self.tokenizer)
        if eos != self.eos_token_ids:
            self.eos_token_ids.clear()  # in place: the sampler shares the set
            self.eos_token_ids.update(eos)
        if change is WeightsChange.UPDATED and not self.reset_prefix_cache():
            logger.warning("the weights changed (%s) while requests hold KV blocks: their K/V is from the old weights, "
                           "and the prefix cache was kept; call reset_prefix_cache() once they finish", detail)
        self.runner.weights_changed(change)  # packs the CPU weights, or drops them (cpu_linear.py); after the reset

    def detach(self) -> None:
        """Give the model back to its user: its own attention implementation, forwards and projection modules
        (the compiled wrappers and fused modules are kept for ``attach``), no step hooks. Takes the weights
        snapshot ``attach()`` compares with. Requests stay queued, but steps raise until ``attach()``. Idempotent."""
        if not self.attached or self.closed:
            return
        self.runner.detach()
        self._uninstall()
        self._weights = WeightsSnapshot.take(self.model)

    def close(self) -> None:
        """Detach for good: the model gets its previous attention implementation and eager, unfused layers
        back, and the KV cache and the CUDA graphs' memory are freed. Unfinished requests are aborted; the
        engine cannot be used afterwards (``stats()`` still reads its counters, with ``num_blocks`` 0)."""
        self.closed = True
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self._drain()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.uncompile()
            runner.release()
        self._free_pool()
        if self.attached:
            self._uninstall()

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool, the CUDA graphs (which hold the pool's addresses) and the packed CPU weights, forgetting
        the prefix cache; the compiled forwards and fused weights stay. ``wake_up()`` allocates the pool again (the
        next call with unchanged weights packs again). vLLM's name; its level 1 also offloads the weights to the CPU, but here the weights are the model's (its user's), so they
        stay where they are. Steps and ``add_request`` raise while asleep. Idempotent.

        Raises:
            ValueError: ``level`` other than 1.
            RuntimeError: the engine is closed, or has unfinished requests (finish or abort them first).
        """
        if level != 1:
            raise ValueError(f"sleep level must be 1 (free the KV cache; the weights are the model's), got {level!r}")
        if self.closed:
            raise RuntimeError("this LLMEngine is closed; create a new one")
        if self.requests:
            raise RuntimeError(f"sleep() with {len(self.requests)} unfinished requests; finish or abort them first")
        if self.sleeping:
            return
        self._drain()
        self.cache.block_manager.reset_prefix_cache()
        self.runner.release_graphs()
        self.runner.drop_packed_weights()
        self._free_pool()
        self.sleeping = True

    def wake_up(self) -> None:
        """Allocate the KV pool again after ``sleep()`` (same number of blocks, empty prefix cache). Nothing is
        recompiled; each decode bucket's CUDA graph is captured again at its first step. Idempotent.

        Raises:
            RuntimeError: the engine is closed.
        """
        if self.closed:
            raise RuntimeError("this LLMEngine is closed; create a new one")
        if self.sleeping:
            self.cache.allocate()
            self.sleeping = False

    def _drain(self) -> None:
        """Wait for the step left running on the device, if any (async scheduling), and forget it."""
        in_flight, self._in_flight = getattr(self, "_in_flight", None), None
        if in_flight is not None and in_flight.launch is not None and in_flight.launch.event is not None:
            in_flight.launch.event.synchronize()  # the step ends before its cache and graphs go

    def _free_pool(self) -> None:
        cache = getattr(self, "cache", None)
        if cache is not None:
            cache.release()
            if cache.device.type == "cuda":
                torch.cuda.empty_cache()  # the KV pool (gpu_memory_utilization of the device) goes back to the device

    def _check_usable(self) -> None:
        """Raises RuntimeError when the engine is closed, detached or asleep, or when the model no longer runs
        our attention (switched while attached): steps would then silently ignore the cache."""
        if self.closed:
            raise RuntimeError("this LLMEngine is closed; create a new one")
        if not self.attached:
            raise RuntimeError("this LLMEngine is detached from its model (the model is its user's between calls); "
                               "call attach() first")
        if self.sleeping:
            raise RuntimeError("this LLMEngine is asleep (its KV pool is freed); call wake_up() first")
        if self.model.config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError(
                f"the model's attn_implementation is {self.model.config._attn_implementation!r}, not {ATTENTION_NAME!r}: "
                "it was switched while this engine was open (another engine on the same model closed?); use one "
                "engine per model at a time"
            )

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (string prompts need the tokenizer). Token ids may be a list or tuple of
        ints, a 1-D ``torch.Tensor`` or numpy array, or a list of numpy/torch integer scalars.

        Raises:
            ValueError: a string prompt without a tokenizer, a tensor or array that is not 1-D, or a prompt
                of another type.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {prompt[:40]!r} is a string but no tokenizer was given; pass tokenizer= or token ids")
            return list(self.tokenizer(prompt).input_ids)
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

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Check a tokenized prompt against the vocabulary and the engine's limits.

        Raises:
            ValueError: empty; an id that is not an integer (naming its type: float, bool, str, a nested
                list, ...); an id outside ``[0, vocab_size)``; ``len >= max_model_len``
                (at least one output token must fit); longer than ``max_num_batched_tokens`` with
                chunked prefill off.
        """
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it needs at least one token")
        not_ints = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool)]
        if not_ints:
            shown = ", ".join(f"{t!r} ({type(t).__name__})" for t in not_ints[:5])
            raise ValueError(f"prompt token ids must be integers (one flat list of ids), got {shown}")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; max_model_len={self.max_model_len} leaves room for "
                f"prompts of at most {self.max_model_len - 1} tokens"
            )
        if not self.config.enable_chunked_prefill and len(prompt_token_ids) > self.config.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, over max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens}, and chunked prefill is off"
            )

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> None:
        """Queue a request; it joins the batch at the next step that has room.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (needs the tokenizer) or token ids.
            sampling_params: default ``SamplingParams()``. The request keeps a copy; ``PerRequest``
                entries of its ``logits_processors`` are built fresh for each of its sequences.

        Raises:
            ValueError: a ``request_id`` that is not a string or already in use, a ``SamplingParams`` field
                out of range (``SamplingParams.validate``, run again here), ``n > max_num_seqs``,
                ``logprobs > vocab_size``, ``stop_token_ids`` outside the vocabulary, ``stop`` strings without a
                tokenizer, or a bad prompt (``validate_prompt``); nothing is queued or allocated then.
            RuntimeError: the engine is closed, or the model's attention was switched away from ours.
        """
        self._check_usable()
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        # NOTE: the request keeps its own copy (own lists), checked again: a SamplingParams changed after
        # construction (sp.n = 0, sp.temperature = nan) is refused here instead of failing a step for the
        # whole batch, and changing it after add_request cannot reach the running request.
        sampling_params = copy.copy(sampling_params)
        sampling_params.validate()
        if sampling_params.n > self.config.max_num_seqs:
            raise ValueError(f"n={sampling_params.n} exceeds max_num_seqs={self.config.max_num_seqs}: the n sequences run together")
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError(f"stop={sampling_params.stop!r} needs a tokenizer to match text; pass tokenizer= or use stop_token_ids")
        bad_stop = [t for t in sampling_params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids outside the vocabulary [0, {self.vocab_size}): {bad_stop[:5]}")
        if sampling_params.logprobs is not None and sampling_params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs={sampling_params.logprobs} exceeds the vocabulary size {self.vocab_size}")
        prompt_token_ids = self.tokenize(prompt)
        self.validate_prompt(prompt_token_ids)
        per_request = any(isinstance(p, PerRequest) for p in sampling_params.logits_processors)
        seqs = []
        for index in range(sampling_params.n):
            generator = None
            if sampling_params.seed is not None:
                # NOTE: hash of an int tuple is not salted per process, so the stream is reproducible.
                generator = torch.Generator(device=self.device).manual_seed(hash((sampling_params.seed, index)) & (2**63 - 1))
            seq_params = sampling_params
            if per_request:  # each sequence gets its own instances of the PerRequest processors
                seq_params = dataclasses.replace(
                    sampling_params, logits_processors=instantiate_per_request(sampling_params.logits_processors)
                )
            seqs.append(Sequence(request_id, index, prompt_token_ids, seq_params, generator))
        # n > 1: only the first sequence computes the prompt; the others fork from it by reference
        # when its prompt is done (copy-on-write), each sampling its own first token (scheduler.py).
        seqs[0].pending_forks = seqs[1:]
        # Registered last, after every check passed: a refused request leaves no trace.
        self.requests[request_id] = _Request(
            request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids, sampling_params, seqs,
            RequestMetrics(arrival_time=time.perf_counter()),
        )
        self.scheduler.add(seqs[0])

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks are freed. Unknown ids are ignored (it may have finished)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._drop_dead_in_flight()

    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished. A step left in flight (async scheduling) always has one: it
        is dropped as soon as all of its sequences are finished (its tokens would be discarded)."""
        return bool(self.requests)

    def _drop_dead_in_flight(self) -> None:
        """Forget the in-flight step when every sequence in it finished (stop at the step before, or
        abort): nothing would be applied. The device finishes it in stream order before later steps."""
        in_flight = self._in_flight
        if in_flight is not None and all(seq.is_finished for seq in in_flight.plan.seqs):
            self._in_flight = None

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns the outputs of the requests that got a token or finished in it;
        a finished request is returned once, then forgotten by the engine.

        With ``EngineConfig.async_scheduling`` a decode step may be left running on the device when this
        returns (``_pipeline``): the call launches step N+1 before reading step N's tokens, then returns
        N's outputs; the next call collects N+1. Otherwise (and whenever pipelining is not safe, see
        ``_can_pipeline``) it is the synchronous loop: schedule, run, sample, read back, update::

            sync:   host [sched N|launch N]......wait......[tokens N, stops, outputs]
                    gpu                  [  step N  ]
            async:  host [sched N+1 | launch N+1][wait N][tokens N, stops, outputs]
                    gpu  [ step N ][       step N+1        ]

        Raises:
            RuntimeError: the engine is closed, or the model's attention was switched away from ours.
        """
        self._check_usable()
        current, self._in_flight = self._in_flight, None
        if current is None:
            plan = self.scheduler.schedule()
            if not plan.seqs:
                # The pool holds a max_model_len sequence, so a step with nothing running always admits one.
                assert not self.scheduler.has_unfinished(), (
                    f"no progress: nothing scheduled with {len(self.scheduler.waiting)} waiting and "
                    f"{len(self.scheduler.running)} running sequences ({self.cache.block_manager.num_free_blocks} free blocks)"
                )
                return []
            current = self._launch(plan)
        if self.config.async_scheduling and self._can_pipeline(current):
            self._in_flight = self._pipeline(current)
        outputs = self._collect(current)
        self._drop_dead_in_flight()
        return outputs

    def _launch(self, plan: SchedulerOutput, input_ids: torch.Tensor | None = None) -> "_InFlight":
        """Run ``plan`` on the model and enqueue its sampling, without waiting for the device (unless a
        row's sampling needs host work). ``input_ids``: a decode step's device input ids (``_pipeline``)."""
        now = time.perf_counter()
        for seq in plan.seqs:
            # only a sequence still without outputs can be its request's first one scheduled
            if len(seq.token_ids) == seq.num_prompt_tokens:
                metrics = self.requests[seq.request_id].metrics
                metrics.first_scheduled_time = metrics.first_scheduled_time or now
        self.peak_num_used_blocks = max(self.peak_num_used_blocks, self.cache.block_manager.num_used_blocks)

        logits = self.runner.execute(plan, input_ids)
        sample_seqs = [seq for seq, samples in zip(plan.seqs, plan.sample_mask) if samples]
        logits, sample_seqs = _with_pending_forks(logits, sample_seqs)
        launch = self.sampler.launch(logits, sample_seqs) if sample_seqs else None
        return _InFlight(plan, sample_seqs, launch)

    def _can_pipeline(self, current: "_InFlight") -> bool:
        """Whether the next step can be scheduled and launched before ``current``'s tokens are read: every
        unfinished sequence of ``current`` samples in it and is all that runs, nothing waits to be
        admitted, none has n > 1 forks pending, none can finish by length with this token, none needs
        host work to sample its next token (``Sampler.needs_host_work``), and the pool has a free block
        for each that needs one (no preemption, no copy-on-write). Host state only: no device read."""
        plan = current.plan
        scheduler = self.scheduler
        if current.launch is None or scheduler.waiting or not all(plan.sample_mask):
            return False
        live = [seq for seq in plan.seqs if not seq.status.is_finished]
        # the running sequences are exactly the step's live ones (none left out by the token budget)
        if not live or len(live) != len(scheduler.running) or len(live) > self.config.max_num_batched_tokens:
            return False
        bm = self.cache.block_manager
        block_size, tables, ref_cnt, block_hash = bm.block_size, bm.block_tables, bm.ref_cnt, bm.block_hash
        max_model_len, needs_host_work = self.max_model_len, self.sampler.needs_host_work
        num_new_blocks = 0
        for seq in live:
            num_tokens = len(seq.token_ids)  # the next step computes position num_tokens (this step's token)
            num_outputs = num_tokens + 1 - seq.num_prompt_tokens
            if (seq.pending_forks or num_outputs >= seq.sampling_params.max_tokens or num_tokens + 1 >= max_model_len
                    or needs_host_work(seq)):
                return False
            if num_tokens % block_size == 0:
                num_new_blocks += 1
            else:
                block_id = tables[seq.seq_id][num_tokens // block_size]
                if ref_cnt[block_id] > 1 or block_hash[block_id] is not None:
                    return False  # the write would need a copy-on-write
        return num_new_blocks <= bm.num_free_blocks

    def _pipeline(self, current: "_InFlight") -> "_InFlight":
        """Schedule and launch the step after ``current`` before its tokens are on the host: each sequence
        advances and holds a placeholder (``Scheduler.advance``), ``schedule()`` plans its decode token,
        and the step's input ids are gathered on the device from ``current``'s sampled tokens."""
        self.scheduler.advance(current.plan)
        plan = self.scheduler.schedule()
        assert not plan.preempted and not plan.block_copies and plan.total_num_scheduled_tokens == len(plan.seqs), (
            f"pipelined step: {len(plan.preempted)} preempted, {len(plan.block_copies)} copies, "
            f"{plan.total_num_scheduled_tokens} tokens for {len(plan.seqs)} sequences"
        )
        row_of = {seq.seq_id: i for i, seq in enumerate(current.sample_seqs)}
        rows = [row_of[seq.seq_id] for seq in plan.seqs]
        token_ids = current.launch.token_ids
        if rows == list(range(len(rows))):
            input_ids = token_ids[: len(rows)]
        else:  # sequences of the current step were aborted meanwhile
            input_ids = token_ids[_to_device(rows, torch.int64, token_ids.device)]
        current.advanced = True
        self.num_pipelined_steps += 1
        return self._launch(plan, input_ids)

    def _collect(self, current: "_InFlight") -> list[RequestOutput]:
        """Read ``current``'s sampled tokens (waiting for them only), apply them (append or replace the
        placeholders, stops, frees) and return the outputs of its requests that are still known."""
        plan, sample_seqs = current.plan, current.sample_seqs
        sampled: dict[int, int] = {}
        if current.launch is not None:
            result = self.sampler.collect(current.launch)
            for i in sorted(result.errors):  # row order, as the sequences were sampled
                seq = sample_seqs[i]
                if not seq.is_finished:
                    seq.error = result.errors[i]
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            for i, (logprob, top_logprobs) in result.logprobs.items():
                seq = sample_seqs[i]
                if not seq.is_finished:  # (a pipelined step's row of a sequence finished before it is dropped)
                    seq.logprobs.append(top_logprobs)
                    seq.cumulative_logprob += logprob
            sampled = {seq.seq_id: token for seq, token in zip(sample_seqs, result.token_ids) if token is not None}
        if current.advanced:
            self.scheduler.replace_placeholders(plan, sampled)
        else:
            self.scheduler.update_from_output(plan, sampled)

        now = time.perf_counter()
        requests = self.requests
        touched: dict[str, _Request] = {}
        for seq in sample_seqs:
            request = requests.get(seq.request_id)
            # None: aborted while the step ran, or finished by the step before; a request without this
            # sequence: the id was aborted and added again while the step ran (its row is the old request's).
            # request.seqs is in index order (add_request), so the check is one lookup per row; the new
            # request may have fewer sequences than the old one.
            seqs = request.seqs if request is not None else ()
            if seq.index < len(seqs) and seqs[seq.index] is seq:
                touched[seq.request_id] = request
        outputs = []
        for request_id, request in touched.items():
            metrics = request.metrics
            if not metrics.first_token_time:
                metrics.first_token_time = now
            output = self._make_output(request)
            if output.finished:
                metrics.finished_time = now
                del requests[request_id]
            outputs.append(output)
        return outputs

    # -- prefix cache and metrics -----------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after the model's weights changed), and drop the packed CPU weights
        (``EngineConfig.cpu_prepack_weights``; always, also when the cache is kept).

        Returns:
            True when the cache was emptied; False, changing nothing in it, while requests hold blocks
            (finish or abort them first: their K/V would be as stale as the cache's).
        """
        self.runner.drop_packed_weights()
        return self.cache.block_manager.reset_prefix_cache()

    def stats(self) -> CacheStats:
        """KV pool and prefix-cache counters since the engine started (``CacheStats``): prefix-cache
        hit rate (prompt tokens served from cache / prompt tokens), blocks shared (n > 1 forks and
        cache hits), blocks used, evictions, preemptions."""
        bm = self.cache.block_manager
        stats = copy.copy(self.scheduler.stats)
        stats.num_blocks = bm.num_blocks if self.cache.key_cache else 0  # 0 once the pool is freed (sleep, close)
        stats.num_used_blocks = bm.num_used_blocks
        stats.peak_num_used_blocks = max(self.peak_num_used_blocks, bm.num_used_blocks)
        stats.num_shared_blocks = bm.num_shared_blocks
        stats.peak_num_shared_blocks = bm.peak_num_shared_blocks
        stats.num_cached_blocks = bm.num_cached_blocks
        stats.num_evicted_blocks = bm.num_evicted_blocks
        return stats

    def _check_stop(self, seq: Sequence) -> SequenceStatus | None:
        sp = seq.sampling_params
        token_ids = seq.token_ids
        token = token_ids[-1]
        if sp.stop_token_ids and token in sp.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if not sp.ignore_eos and token in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if sp.stop and self.tokenizer is not None:
            stop = first_stop(self._decode(seq.output_token_ids), sp.stop)
            if stop is not None:
                seq.stop_reason = stop
                return SequenceStatus.FINISHED_STOPPED
        num_tokens = len(token_ids)
        if num_tokens - seq.num_prompt_tokens >= sp.max_tokens or num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _make_output(self, request: _Request) -> RequestOutput:
        seqs = request.seqs
        finished = True
        for seq in seqs:
            if not seq.status.is_finished:
                finished = False
                break
        completions = []
        for seq in seqs:
            # NOTE: decoding the whole output again every step is O(length) per request per step, the
            # largest host cost at big batches: text comes with the finished output only (streaming.stream
            # detokenizes incrementally instead).
            stop_reason = seq.stop_reason
            text = cut_at_stop(self._decode(seq.output_token_ids), stop_reason) if finished else ""
            logprobs = seq.logprobs
            # positional: CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs, finish_reason,
            # stop_reason, error); the token and logprob lists are copies, so an output is a snapshot
            completions.append(CompletionOutput(
                seq.index, text, seq.token_ids[seq.num_prompt_tokens :],
                seq.cumulative_logprob if logprobs is not None else None,
                list(logprobs) if logprobs is not None else None,
                seq.status.finish_reason, stop_reason, seq.error,
            ))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                             request.metrics)


def check_loaded_model(model) -> None:
    """Raise unless ``model`` is a loaded ``torch.nn.Module`` (the engine serves models, not paths).

    Raises:
        ValueError: naming the value given; a path or hub id gets the call that loads it.
    """
    if isinstance(model, torch.nn.Module):
        return
    hint = ""
    if isinstance(model, (str, os.PathLike)):
        hint = f"; load it first: model = paged_transformers.load_model({os.fspath(model)!r})"
    raise ValueError(f"model must be a loaded transformers model (a torch.nn.Module), got {type(model).__name__} {model!r}{hint}")
def _check_not_attached(model: torch.nn.Module) -> None:
    """Raises ValueError when an engine is attached to ``model`` (its attn_implementation is ours)."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTENTION_NAME:
        raise ValueError(
            f"this model's attn_implementation is already {ATTENTION_NAME!r}: another LLMEngine (or paged_generate) "
            "is open on it; close that engine first (one engine per model at a time), or switch the model back "
            "with model.set_attn_implementation('sdpa')"
        )


def _with_pending_forks(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
    """n > 1: a sequence sampled for the first time brings its ``pending_forks``; each fork samples from a
    copy of its row (``logits [len(seqs), vocab]`` -> ``[len(seqs) + num_forks, vocab]``), with its own
    generator when seeded."""
    rows = [i for i, seq in enumerate(seqs) for _ in seq.pending_forks]
    if not rows:
        return logits, seqs
    forks = [fork for seq in seqs for fork in seq.pending_forks]
    return torch.cat([logits, logits[rows]]), seqs + forks


def _as_token_id(token):
    """numpy / torch integer scalars as ``int``; anything else unchanged, for ``validate_prompt`` to name."""
    if isinstance(token, int):
        return token
    try:
        return operator.index(token)
    except TypeError:
        return token


def _eos_token_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    """EOS ids as ``generate()`` would use them: the generation config's, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
