"""``LLMEngine``: add_request / step / abort over the scheduler, runner, sampler and output processor.

One ``step()`` flows one way, each stage handing the next a message::

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute -> logits
    SchedulerOutput -> SamplingBatch.prepare -> SamplingMetadata;  Sampler(logits, metadata) -> ModelRunnerOutput
        -> SamplingBatch.record, Scheduler.update_from_output -> OutputProcessor: stops (Scheduler.finish), RequestOutputs

A request's sampling state and stop conditions (``output_processor.StopConditions``) are fixed at ``add_request``.

With async scheduling (``EngineConfig.async_scheduling``, on by default) the next decode step is planned
(``Scheduler.schedule_ahead``) and launched before the previous step's tokens are read back, so that this
host work overlaps the device's (vLLM V1's async scheduling, SGLang's overlap scheduler). The engine's
life around calls (attach / detach / sleep / wake_up / close) is ``engine_lifecycle.py``; ``run_engine``
is the loop the entry points drive it with.
"""

import copy
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .attention import resolve_backend
from .batch_defaults import DeviceDescription, resolve_batch_limits
from ..config import EngineConfig
from .engine_inputs import check_sampling_params, model_limits, tokenize, validate_prompt
from .engine_lifecycle import EngineLifecycle, check_loaded_model, check_not_attached, eos_token_ids
from .kv_pool import KVPool
from .messages import ModelRunnerOutput, SchedulerOutput
from .output_processor import EngineRequest, OutputProcessor, StopConditions
from ..outputs import RequestMetrics, RequestOutput
from .prefix_cache import CacheStats
from .runner import ModelRunner
from .sampling import PromptLogprobsLaunch, SampleLaunch, Sampler
from .sampling_batch import SamplingBatch, make_generator
from ..sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import SequenceStatus, fan_out
from .sizing import model_compute_dtype, model_kv_shape, num_kv_blocks
from .weights import WeightsFingerprint, WeightsSnapshot

__all__ = ["LLMEngine", "check_loaded_model", "run_engine"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlight:
    """A launched step whose sampled tokens the host has not applied yet (async scheduling: at most one
    is left running between ``step()`` calls)."""

    plan: SchedulerOutput
    launch: SampleLaunch | None  # None when no row is sampled (prompt chunks only)
    prompt_logprobs: PromptLogprobsLaunch | None = None  # None unless the plan has prompt_logprob_rows


class LLMEngine(EngineLifecycle):
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
    (``StaleWeightsError``) when one was replaced (see ``paged_transformers.core.weights``).

    Args:
        model: a transformers causal LM whose attention goes through ``AttentionInterface``.
        tokenizer: optional; needed for string prompts, output text and ``stop`` strings.
        engine_config: ``EngineConfig``; default ``EngineConfig()``. The engine runs on a copy whose step limits
            left None are picked for the model's device (``core.batch_defaults``): ``config``; ``requested_config`` is
            the copy as given.

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
        check_not_attached(model)
        self.closed = False
        self.attached = False
        self.sleeping = False
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size, self.max_model_len = model_limits(model, self.config)
        param = next(model.parameters())
        self.device = device = param.device
        # the config as given (what the warm engine compares a call's config with), and the one the engine runs:
        # the step limits left None picked for this device (batch_defaults.py)
        self.requested_config = self.config
        self.config = resolve_batch_limits(self.config, DeviceDescription.of(device), self.max_model_len)
        sizing_s = self._make_pool(device, model_compute_dtype(model))
        self.eos_token_ids = eos_token_ids(model, tokenizer)  # read again by attach(): for requests added after it
        self.scheduler = Scheduler(self.config, self.cache.block_manager, self.max_model_len)
        self.sampler = Sampler(self.vocab_size)
        self.sampling_batch = SamplingBatch()  # the sampler's per-sequence state (sampling_batch.py)
        self.output_processor = OutputProcessor(tokenizer, device)
        self._in_flight: _InFlight | None = None  # async scheduling: the step left running on the device
        backend = resolve_backend(self.config.attention_backend, device)
        self._install()
        t0 = time.perf_counter()
        try:
            self.runner = ModelRunner(
                model, self.cache, backend, max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens, max_model_len=self.max_model_len,
                max_cudagraph_capture_size=self.config.max_cudagraph_capture_size,
                use_cuda_graphs=not self.config.enforce_eager, compile_layers=self.config.compile_layers,
                fuse_projections=self.config.fuse_projections, cpu_prepack_weights=self.config.cpu_prepack_weights,
            )
        except BaseException:
            self.close()  # the model gets its attention back
            raise
        # seconds: the KV pool's sizing (on CUDA a profiled forward) and the runner's start (fused or compiled layers)
        self.startup_times = {"kv_sizing_s": sizing_s, "runner_s": time.perf_counter() - t0}
        logger.info("paged_transformers: KV pool of %d blocks of %d tokens, sized in %.1f s; runner ready in %.1f s",
                    self.cache.block_manager.num_blocks, self.config.block_size, sizing_s, self.startup_times["runner_s"])
        self.peak_num_used_blocks = 0
        self.num_pipelined_steps = 0  # steps launched before the previous step's tokens were read
        self._weights = WeightsSnapshot.take(model)  # after fusion: fusing moves the projections' storage
        self._fingerprint = WeightsFingerprint.take(model)  # the checksums the next attach() compares with

    def _make_pool(self, device: torch.device, dtype: torch.dtype) -> float:
        """Size and allocate the KV pool (``self.cache``). Returns the sizing time in seconds.

        Raises:
            ValueError: a pool too small for one ``max_model_len`` sequence (with the numbers).
        """
        num_layers, num_kv_heads, head_dim = self._kv_shape()
        block_size = self.config.block_size
        bytes_per_block = KVPool.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        t0 = time.perf_counter()
        num_blocks = self._agree_num_blocks(num_kv_blocks(self.model, self.config, self.max_model_len, bytes_per_block))
        sizing_s = time.perf_counter() - t0
        needed = -(-self.max_model_len // block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV pool holds {num_blocks} blocks of {block_size} tokens "
                f"({num_blocks * block_size} tokens, {bytes_per_block} bytes per block), fewer than the "
                f"{needed} blocks one max_model_len={self.max_model_len} sequence needs; raise the KV budget or lower max_model_len"
            )
        self.cache = KVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        return sizing_s

    def _kv_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of this process's pool. Raises ValueError for ``tensor_parallel_size
        != 1``: sharded models run in ``paged_transformers.distributed``'s engines, which override this and the next."""
        if self.config.tensor_parallel_size != 1:
            raise ValueError(f"LLMEngine runs one process, got tensor_parallel_size={self.config.tensor_parallel_size}; "
                             "use LLM(path, tensor_parallel_size=N) or paged_transformers.distributed")
        return model_kv_shape(self.model.config)

    def _agree_num_blocks(self, num_blocks: int) -> int:
        return num_blocks  # a tensor-parallel rank takes the least of all ranks' sizes

    # -- requests --------------------------------------------------------------------------------
    @property
    def requests(self) -> dict[str, EngineRequest]:
        """The unfinished requests by id, in arrival order (read-only outside the engine)."""
        return self.output_processor.requests

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (``engine_inputs.tokenize``: string prompts need the tokenizer).

        Raises:
            ValueError: a string prompt without a tokenizer, a tensor or array that is not 1-D, or a prompt
                of another type.
        """
        return tokenize(self.tokenizer, prompt)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Check a tokenized prompt against the vocabulary and the engine's limits (``engine_inputs.validate_prompt``).

        Raises:
            ValueError: empty, an id that is not an integer or outside the vocabulary, no room for an output
                under ``max_model_len``, longer than ``max_num_batched_tokens`` with chunked prefill off.
        """
        validate_prompt(prompt_token_ids, self.vocab_size, self.max_model_len, self.config)

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    *, stopping_criteria: list[Callable] | None = None) -> None:
        """Queue a request; it joins the batch at the next step that has room. Its stop conditions
        (``output_processor.StopConditions``) are fixed here: the EOS ids the engine knows now, the params' stop
        ids and strings and lengths, ``stopping_criteria``.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (needs the tokenizer) or token ids.
            sampling_params: default ``SamplingParams()``. The request keeps a copy; ``PerRequest``
                entries of its ``logits_processors`` are built fresh for each of its sequences.
            stopping_criteria: callables with the transformers ``StoppingCriteria`` signature, called after
                every new token as ``criterion(input_ids [1, num_tokens] int64, None)`` on prompt + output; a true
                result finishes the request (``finish_reason="stop"``, the last token kept, as ``generate()``
                keeps it). Only for ``n == 1``.

        Raises:
            ValueError: a ``request_id`` that is not a string or already in use, a ``SamplingParams`` field
                out of range (``SamplingParams.validate``, run again here), ``n > max_num_seqs``,
                ``logprobs`` or ``prompt_logprobs`` over ``vocab_size``, ``stop_token_ids`` outside the vocabulary,
                ``stop`` strings without a tokenizer, ``stopping_criteria`` with ``n > 1``, or a bad prompt
                (``validate_prompt``); nothing is queued or allocated then.
            RuntimeError: the engine is closed, or the model's attention was switched away from ours.
        """
        self._check_usable()
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        sampling_params = check_sampling_params(sampling_params, self.config, self.vocab_size, self.tokenizer)
        stops = StopConditions.resolve(sampling_params, self.eos_token_ids, self.max_model_len, stopping_criteria)
        prompt_token_ids = self.tokenize(prompt)
        self.validate_prompt(prompt_token_ids)
        seqs = fan_out(request_id, prompt_token_ids, sampling_params)
        # Registered last, after every check passed: a refused request leaves no trace.
        self.output_processor.add_request(EngineRequest(
            request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids, sampling_params, seqs,
            RequestMetrics(arrival_time=time.perf_counter()), stops,
        ))
        for seq in seqs:  # the sampler's state of each sequence
            self.sampling_batch.add(seq.seq_id, request_id, seq.sampling_params, make_generator(sampling_params, seq.index, self.device),
                                    prompt_token_ids, stops.min_tokens_ids(self.vocab_size))
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
        in_flight, live = self._in_flight, self.scheduler.seqs
        if in_flight is not None and not any(entry.seq_id in live for entry in in_flight.plan.seqs):
            self._in_flight = None

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns the outputs of the requests that got a token or finished in it;
        a finished request is returned once, then forgotten by the engine.

        With ``EngineConfig.async_scheduling`` a decode step may be left running on the device when this
        returns: the call launches step N+1 before reading step N's tokens, then returns N's outputs; the
        next call collects N+1. Otherwise (and whenever the scheduler cannot plan N+1 before N's tokens
        are known: ``Scheduler.schedule_ahead``) it is the synchronous loop: schedule, run, sample, read
        back, update::

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
        if self.config.async_scheduling:
            ahead = self.scheduler.schedule_ahead()
            if ahead is not None:
                self._in_flight = self._launch(ahead, current.launch.tokens_of(current.plan.sampled_seq_ids, ahead.seqs))
                self.num_pipelined_steps += 1
        outputs = self._collect(current)
        self._drop_dead_in_flight()
        return outputs

    def _launch(self, plan: SchedulerOutput, input_ids: torch.Tensor | None = None) -> _InFlight:
        """Run ``plan`` on the model and enqueue its sampling, without waiting for the device (unless a
        row's sampling needs host work). ``input_ids``: a decode step's device input ids (a step planned ahead)."""
        now = time.perf_counter()
        requests = self.requests
        for entry in plan.seqs:
            metrics = requests[entry.request_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        self.peak_num_used_blocks = max(self.peak_num_used_blocks, self.cache.block_manager.num_used_blocks)
        logits = self.runner.execute(plan, input_ids)
        metadata = self.sampling_batch.prepare(plan)
        num_sampled = len(metadata) if metadata is not None else 0
        prompt_logprobs = None
        if plan.prompt_logprob_rows:  # their rows come after the sampled ones
            logits, prompt_logits = logits[:num_sampled], logits[num_sampled:]
            states = self.sampling_batch.states
            ks = [states[rows.seq_id].params.prompt_logprobs for rows in plan.prompt_logprob_rows]
            prompt_logprobs = self.sampler.launch_prompt_logprobs(prompt_logits, plan.prompt_logprob_rows, ks)
        return _InFlight(plan, self.sampler.launch(logits, metadata) if metadata is not None else None, prompt_logprobs)

    def _collect(self, current: _InFlight) -> list[RequestOutput]:
        """Read ``current``'s sampled tokens and prompt logprobs (waiting for them only), apply them
        (``update_from_output``), end the sequences that stop, and return the outputs of its requests that are still
        unfinished or just finished."""
        prompt_logprobs = {}
        if current.prompt_logprobs is not None:
            prompt_logprobs = self.sampler.collect_prompt_logprobs(current.prompt_logprobs)
        output = ModelRunnerOutput({}, {}, {}, prompt_logprobs)
        if current.launch is not None:
            result = self.sampler.collect(current.launch)
            ids = current.plan.sampled_seq_ids
            output = ModelRunnerOutput(
                {seq_id: token for seq_id, token in zip(ids, result.token_ids) if token is not None},
                {ids[i]: logprobs for i, logprobs in result.logprobs.items()},
                {ids[i]: error for i, error in result.errors.items()},
                prompt_logprobs,
            )
        self.sampling_batch.record(output)
        updated = self.scheduler.update_from_output(current.plan, output)
        for seq, status in self.output_processor.check_stops(updated):
            self.scheduler.finish(seq, status)
        return self.output_processor.make_outputs(updated, time.perf_counter())

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


def run_engine(engine: LLMEngine) -> Iterator[list[RequestOutput]]:
    """Step ``engine`` until it is idle, yielding each step's outputs (requests may be added meanwhile)."""
    while engine.has_unfinished_requests():
        yield engine.step()

