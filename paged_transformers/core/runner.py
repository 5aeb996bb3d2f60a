"""Turns a ``SchedulerOutput`` into one ragged, unpadded batch and runs the unmodified model forward.

The step's metadata lives in buffers allocated once, next to the running sequences' block tables, which
the plans update by diffs (``input_batch.InputBatch``). Decode-only steps
(every sequence one token, every sequence sampled) replay a CUDA graph of their batch-size bucket on those
same static buffers, captured the first time a decode step of that bucket runs; mixed and prefill steps run
eagerly (``compilation/cuda_graphs.py``).

The compiled layers, fused projections and decode graphs are the runner's ``compilation``
(``paged_transformers.compilation``), installed in the model only while the engine is attached (``attach`` /
``detach``): between calls the model runs its own modules.
"""

import contextlib
import logging
import time

import torch

from . import cpu_linear
from .attention import ATTENTION_NAME, AttentionMetadata, AttentionOps
from ..kernels.api import compile_only
from .draw import argmax, host_to_device
from .execution_plan import DeviceFacts, ExecutionPlan, LayerPath, ModelFacts, resolve_execution_plan
from ..compat import attn_implementation
from .input_batch import InputBatch
from .kv_pool import KVPool
from .messages import SchedulerOutput, StepTrace
from .sizing import model_compute_dtype
from ..quantization.linear import QuantLinear
from .weights import WeightsChange

logger = logging.getLogger(__name__)

# Tokens of the dummy prompt step of the warm-ups (at most max_model_len): more query rows than the attention's
# decode tile holds (16 rows of query heads: 16 // (query heads per KV head) tokens), so it takes the prefill tile as
# real prompts do.
WARMUP_PROMPT_TOKENS = 17


class ModelRunner:
    """Runs the transformers model on one packed step and returns the logits of the sampled rows.

    The step's sequences are concatenated into a single row (no padding)::

        input_ids      [1, num_tokens]   the scheduled tokens of seq 0, then seq 1, ...
        position_ids   [1, num_tokens]   each token's position in its own sequence (RoPE per token)
        slot_mapping   [num_tokens]      block_table[pos // block_size] * block_size + pos % block_size
        block_tables   [num_seqs, max_num_blocks_per_seq]  int32, full width (entries past a sequence's
                                         blocks are stale and ignored by the kernels)
        seq_lens       [num_seqs]        context length including this step's tokens
        query_start_loc [num_seqs + 1]   cumulative query rows
        logits_indices [num_sampled + num_prompt_logprob_rows]  the last row of each sequence that is sampled
                                         this step, then the rows kept for prompt logprobs (``PromptLogprobRows``)

    The model's LM head runs only on ``logits_indices`` (``logits_to_keep``).

    A decode-only step of ``S`` sequences is padded to the graph bucket ``B >= S``: padding rows get
    token 0 at position 0, ``slot_mapping = -1`` (nothing written), ``seq_len = 1`` (they attend to one
    slot of a real block: finite, and never read back), and all ``B`` rows are kept for the LM head.

    Args:
        model: a transformers causal LM whose ``attn_implementation`` is ``ATTENTION_NAME``.
        cache: the KV pool the attention reads and writes.
        backend: the attention backend's functions (``attention.resolve_backend``).
        max_num_seqs, max_num_batched_tokens: engine limits (buffer sizes); default: the batch of the
            biggest step seen is not bounded, so both must be given for the buffers (the engine does).
        max_model_len: longest sequence in tokens (block-table width; the graphs' ``max_seq_len`` bound).
        max_cudagraph_capture_size: the largest decode graph bucket (sequences), at most ``max_num_seqs``; decode
            steps of more sequences run eagerly. None: ``max_num_seqs``.
        use_cuda_graphs, compile_layers, fuse_projections, cpu_prepack_weights: ``EngineConfig``'s knobs
            (``use_cuda_graphs`` is ``not enforce_eager``), resolved once with the model and the device into
            ``execution_plan`` (``execution_plan.resolve_execution_plan`` has the rule). The runner is constructed
            attached (its forwards installed); compiled layers are compiled now by dummy forwards (``_compile``), a
            compile error leaving them eager (the plan resolved again with it); uncompiled layers on CUDA run the same
            dummy forwards to compile our Triton kernels' variants (``_precompile_kernels``). The fused projections
            are undone on ``release``.

    Eager fp32 layers on an x86-64 CPU run their ``nn.Linear`` products through oneDNN during engine forwards
    (``cpu_linear.py``); outside them the model is untouched. While the weights are stable across calls they read
    packed copies of the weights (``weights_changed``).

    Attributes:
        execution_plan: the ``ExecutionPlan`` the runner runs by.

    Raises:
        ValueError: a limit that is not positive; ``fuse_projections=True`` with uncompiled layers that the fused
            eager layers cannot run (the reason named: the model, or a CPU without the Triton interpreter).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVPool,
        backend: AttentionOps,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 4096,
        max_cudagraph_capture_size: int | None = None,
        use_cuda_graphs: bool = False,
        compile_layers: bool | None = None,
        fuse_projections: bool | None = None,
        cpu_prepack_weights: bool | None = None,
    ):
        assert attn_implementation(model.config) == ATTENTION_NAME, attn_implementation(model.config)
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.model = model
        self.cache = cache
        self.write_kv = backend.write_kv
        self.attend = backend.attend
        self.device = cache.device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_cudagraph_capture_size = max_cudagraph_capture_size or max_num_seqs
        # a decode step has num_seqs tokens, so the token buffers must hold the largest graph bucket too
        self.max_num_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_num_blocks_per_seq = -(-max_model_len // cache.block_size)
        self.batch = InputBatch(self.max_num_tokens, max_num_seqs, self.max_num_blocks_per_seq, cache.block_size, self.device)
        vars(self).update(self.batch.device_buffers())  # the forward reads the batch's tensors: self.input_ids, ...
        self.record_steps = False
        self.steps: list[StepTrace] = []
        knobs = dict(cuda_graphs=bool(use_cuda_graphs), compile_layers=compile_layers, fuse_projections=fuse_projections,
                     cpu_prepack_weights=cpu_prepack_weights, max_cudagraph_capture_size=self.max_cudagraph_capture_size)
        device = DeviceFacts.of(self.device, backend.graph_capturable)
        facts = ModelFacts.of(model, model_compute_dtype(model), device)
        self.execution_plan = resolve_execution_plan(**knobs, model=facts, device=device)
        self.cpu_linears: cpu_linear.RoutedLinears | None = None
        self._build(self.execution_plan)
        if self.compilation is not None and self.compilation.compile_error is not None:
            self.execution_plan = resolve_execution_plan(**knobs, model=facts, device=device,
                                                         compile_error=self.compilation.compile_error)
        if self.execution_plan.layers is LayerPath.ONEDNN:
            self.cpu_linears = cpu_linear.RoutedLinears(model, prepack=cpu_prepack_weights)
        logger.info("paged_transformers: execution plan: %s", self.execution_plan)

    def _build(self, plan: ExecutionPlan) -> None:
        """What ``plan`` installs in the model: the ``Compilation`` (fused or compiled layers, decode graphs), or
        None; the compile (``_compile``) or the kernels' warm-up (``_precompile_kernels``)."""
        self.compilation = None
        if plan.layers in (LayerPath.FUSED, LayerPath.COMPILED) or plan.cuda_graphs:
            from ..compilation import Compilation

            self.compilation = Compilation(self.model, self.device, self.max_cudagraph_capture_size,
                                           cuda_graphs=plan.cuda_graphs)
        if plan.layers is LayerPath.FUSED:
            self.compilation.fuse_layers()
        elif plan.layers is LayerPath.COMPILED:
            self._compile(fuse=plan.fuse_projections)
        if plan.precompile_kernels:
            self._precompile_kernels()  # the Triton backend's kernels (the torch backend has none of ours)

    @property
    def graphs(self):
        """The ``compilation.DecodeGraphs``, or None when decode steps run eagerly."""
        return self.compilation.graphs if self.compilation is not None else None

    # -- building a step (input_batch.py) ---------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, pad_to: int | None = None) -> tuple[int, int, int, int]:
        """Fill the device buffers for ``out`` (``InputBatch.prepare``); with ``pad_to`` (a decode step), pad it
        to that many rows.

        Returns:
            ``(num_tokens, num_sampled, max_query_len, max_seq_len)`` of the (padded) step.
        """
        return self.batch.prepare(out, pad_to)

    def _forward(self, num_tokens: int, num_seqs: int, num_sampled: int, max_query_len: int, max_seq_len: int,
                 num_prompt_rows: int = 0):
        """The model forward on the first rows of the device buffers. Returns logits ``[1, num_sampled +
        num_prompt_rows, vocab]``: the rows of ``logits_indices``."""
        block_tables, seq_lens = self.block_tables[:num_seqs], self.seq_lens[:num_seqs]
        query_start_loc = self.query_start_loc[: num_seqs + 1]
        make_plan = getattr(self.attend, "plan", None)  # a backend's per-step index tensors, shared by the layers
        plan = None if make_plan is None else make_plan(
            block_tables, seq_lens, query_start_loc, self.cache.block_size, num_tokens, max_query_len, max_seq_len)
        metadata = AttentionMetadata(
            cache=self.cache,
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            write_kv=self.write_kv,
            attend=self.attend,
            attend_plan=plan,
        )
        with self._forward_scope():
            return self.model(
                input_ids=self.input_ids[:num_tokens].unsqueeze(0),
                position_ids=self.positions[:num_tokens].unsqueeze(0),
                use_cache=False,
                paged_metadata=metadata,
                # every row sampled (a decode step, so no prompt rows): the indices are 0 .. num_tokens - 1, and the
                # int 0 keeps every row as a slice, without the gather kernel of an index tensor
                logits_to_keep=0 if num_sampled == num_tokens else self.logits_indices[: num_sampled + num_prompt_rows],
            ).logits

    def _forward_scope(self) -> contextlib.AbstractContextManager:
        """What every forward runs under: the compiled layers' tracing settings, the CPU projections' oneDNN route,
        or nothing."""
        if self.execution_plan.layers is LayerPath.COMPILED:
            return self.compilation.scope()
        return self.cpu_linears.routed() if self.cpu_linears is not None else contextlib.nullcontext()

    # -- torch.compile --------------------------------------------------------------------------------
    def _dummy_step(self, num_seqs: int) -> tuple:
        """Fill the buffers with a decode step of ``num_seqs`` dummy rows that write nothing (every
        ``slot_mapping`` entry -1, ``seq_len`` 1); returns the ``_forward`` arguments for it."""
        B = num_seqs
        self.input_ids[:B].zero_()
        self.positions[:B].zero_()
        self.slot_mapping[:B].fill_(-1)
        self.seq_lens[:B].fill_(1)
        self.query_start_loc[: B + 1].copy_(torch.arange(B + 1, dtype=torch.int32, device=self.device))
        self.logits_indices[:B].copy_(torch.arange(B, dtype=torch.int64, device=self.device))
        return (B, B, B, 1, self.max_model_len)

    def _dummy_prefill(self, num_tokens: int) -> tuple:
        """Fill the buffers with a prompt step: one dummy sequence of ``num_tokens`` tokens that writes nothing
        (``slot_mapping`` -1), its last row sampled (an index ``logits_to_keep``, as a real prompt step has);
        returns the ``_forward`` arguments for it."""
        T = num_tokens
        self.input_ids[:T].zero_()
        self.positions[:T].copy_(torch.arange(T, dtype=torch.int64, device=self.device))
        self.slot_mapping[:T].fill_(-1)
        self.seq_lens[:1].fill_(T)
        self.query_start_loc[:2].copy_(torch.tensor([0, T], dtype=torch.int32, device=self.device))
        self.logits_indices[:1].fill_(T - 1)
        return (T, 1, 1, T, self.max_model_len)

    def _compile(self, fuse: bool) -> None:
        """Compile the layers now (``Compilation.compile``). The dummy forwards (``_warmups``) trace the graphs the
        first real steps need, so that no call recompiles, and run under ``kernels.compile_only``: our Triton
        kernels are compiled, not run, in threads beside Dynamo and Inductor (launched, each variant's JIT would hold
        the main thread after them; their outputs are thrown away here)."""
        with compile_only():
            self.compilation.compile(fuse, self._warmups())

    @torch.inference_mode()
    def _precompile_kernels(self) -> None:
        """Eager layers on CUDA: the dummy forwards of ``_warmups`` under ``kernels.compile_only``, so that our Triton
        kernels' variants compile in threads now, several at a time, instead of one after another in the first calls
        (seven variants on a Llama-3-8B shape). An error there is logged and left to the first call that meets it, as
        without this."""
        try:
            with compile_only():
                for warmup in self._warmups():
                    warmup()
        except Exception as e:
            logger.warning("paged_transformers: the kernels' warm-up failed, they compile when first used: %s: %s",
                           type(e).__name__, e)

    def _warmups(self) -> list:
        """The dummy forwards of ``_compile`` and ``_precompile_kernels``: decode steps of one and of two sequences
        and a prompt step of up to ``WARMUP_PROMPT_TOKENS`` tokens with one row sampled (the LM head then gets an
        index), which under ``layers.tracing_settings`` all run the same graphs, one per layer piece.

        They also reach the kernel variants the first calls would otherwise compile: the prompt step has more rows
        than a decode tile holds (the attention's prefill tile) and its logits go through the greedy argmax; with
        decode graphs a decode step runs for every power-of-two bucket and the largest (the split-KV merge kernel is
        specialized on the number of splits padded to a power of two, which shrinks as the batch grows; the W4A16
        kernels on the row count's divisibility). A bucket whose split count pads otherwise compiles its variant at
        its first capture, and eager steps (no graphs) can meet other split counts as contexts grow.
        """
        sizes = [1, min(2, self.max_num_seqs)]
        if self.graphs is not None:
            sizes += [s for s in self.graphs.sizes if s > 2 and s & (s - 1) == 0] + [self.graphs.sizes[-1]]
        warmups = [lambda n=n: self._forward(*self._dummy_step(n)) for n in dict.fromkeys(sizes)]
        T = min(WARMUP_PROMPT_TOKENS, self.max_num_tokens, self.max_model_len)
        if T >= 3:
            vocab_size = self.model.config.get_text_config().vocab_size
            # the sampler's view of the logits (execute's float(), Sampler.launch's slice)
            warmups.append(lambda: argmax(self._forward(*self._dummy_prefill(T))[0].float()[:, :vocab_size]))
        return warmups

    def attach(self) -> None:
        """Install the compiled forwards and fused projections in the model (``Compilation.apply``)."""
        if self.compilation is not None:
            self.compilation.apply()

    def detach(self) -> None:
        """Give the model its own forwards and projections back, keeping the compiled code (``Compilation.restore``)."""
        if self.compilation is not None:
            self.compilation.restore()

    @torch.inference_mode()
    def capture_decode_graphs(self) -> int:
        """Capture the decode graph of every bucket now (``DecodeGraphs.capture_all``) instead of at its first step.
        Returns the number captured (0 without graphs: CPU, ``enforce_eager``)."""
        return self.graphs.capture_all(self._dummy_decode) if self.graphs is not None else 0

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs and their memory pool (the engine's ``sleep``); later decode steps capture
        their buckets' graphs again."""
        if self.graphs is not None:
            self.graphs.release()

    def weights_changed(self, change: WeightsChange) -> None:
        """How the weights changed since the previous call (``LLMEngine.attach``, once per call): the packed CPU
        weights are made or dropped by their policy (``cpu_linear.RoutedLinears.weights_changed``); on a change,
        the dequantized weights ``QuantLinear`` keeps on the CPU (the model's and the fused projections') are
        dropped. The fused projections, compiled layers and CUDA graphs read the weights' own storage: nothing
        else is a copy."""
        if self.cpu_linears is not None:
            self.cpu_linears.weights_changed(change)
        if change is not WeightsChange.NONE:
            for module in self.model.modules():
                for linear in (module, getattr(module, "fused", None)):  # a FusedLinearSlice's fused module
                    if isinstance(linear, QuantLinear):
                        linear.drop_dequantized()

    def drop_packed_weights(self) -> None:
        """Free the packed CPU weights, if any (engine ``sleep``, ``close``, ``reset_prefix_cache``); the next call
        with unchanged weights packs again."""
        if self.cpu_linears is not None:
            self.cpu_linears.drop()

    def release(self) -> None:
        """Give the model its eager layers and unfused projections back for good (``Compilation.undo``), and drop
        the CUDA graphs, the packed CPU weights and the cache reference (engine close)."""
        if self.compilation is not None:
            self.compilation.undo()
        self.drop_packed_weights()
        self.cache = None

    def _graph_bucket(self, out: SchedulerOutput) -> int | None:
        """The graph bucket that runs ``out`` (``DecodeGraphs.bucket``, which captures a bucket's graph at its first
        step), or None to run it eagerly: no graphs, or not a decode-only step (every sequence one token, every one
        sampled, not a one-token chunk of a prompt)."""
        S = len(out.seqs)
        if self.graphs is None or out.num_scheduled_tokens.count(1) != S or not all(out.sample_mask):
            return None
        return self.graphs.bucket(S, self._dummy_decode)

    def _dummy_decode(self, size: int):
        """The buffers filled with a dummy decode step of ``size`` rows; returns its forward, for capture (recorded
        with ``max_seq_len = max_model_len``, a host-side upper bound the kernels size their grids from)."""
        args = self._dummy_step(size)
        return lambda: self._forward(*args)

    # -- a step ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step. Returns float32 logits ``[len(out.sampled_seq_ids) + out.num_prompt_logprob_rows,
        vocab_size]``: the sampled rows in ``out.seqs`` order, then a copy of its parent's row for each of
        ``out.forked``, then the rows of ``out.prompt_logprob_rows`` in order.

        Args:
            out: the step's plan.
            input_ids: for a decode step (one token per sequence), its input ids as a device tensor
                ``[len(out.seqs)]`` int64, e.g. gathered from the previous step's sampled tokens that the
                host has not read yet (async scheduling). Copied over the host-staged ids after
                ``prepare``, in stream order; the sequences' last token ids are then not read.

        Raises:
            ValueError: ``input_ids`` given for a step that is not decode-only, or of the wrong shape.
        """
        host_start = time.perf_counter()
        start = end = None
        if self.record_steps and self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        self.cache.copy_blocks(out.block_copies)
        bucket = self._graph_bucket(out)
        S = len(out.seqs)
        if input_ids is not None and (tuple(input_ids.shape) != (S,) or out.num_scheduled_tokens.count(1) != S):
            raise ValueError(f"input_ids of shape {tuple(input_ids.shape)} for a step of {S} sequences and "
                             f"{sum(out.num_scheduled_tokens)} tokens: only decode steps take device input ids, one per sequence")
        T, num_sampled, max_query_len, max_seq_len = self.prepare(out, pad_to=bucket)
        if input_ids is not None:
            self.input_ids[:S].copy_(input_ids)
        if bucket is not None:
            assert not out.prompt_logprob_rows, "a decode-only step has no prompt rows"
            logits = self.graphs.replay(bucket, S).float()
        else:
            num_prompt_rows = out.num_prompt_logprob_rows
            logits = self._forward(T, S, num_sampled, max_query_len, max_seq_len, num_prompt_rows)[0].float()
        if self.batch.fork_rows is not None:  # n > 1 forks sample from copies of their parents' rows
            logits = logits[host_to_device(self.batch.fork_rows, torch.int64, logits.device)]
        if start is not None:
            end.record()
        if self.record_steps:
            context = sum(seq.num_computed_tokens for seq in out.seqs) + sum(out.num_scheduled_tokens)
            self.steps.append(StepTrace("graph" if bucket is not None else "eager", sum(out.num_scheduled_tokens), S,
                                        context, host_start, time.perf_counter(), start, end))
        return logits
