"""Turns a ``SchedulerOutput`` into one ragged, unpadded batch and runs the unmodified model forward.

Step overhead is what decides throughput once the kernels are fast, so the runner keeps every step's
metadata in buffers allocated once (vLLM's persistent input buffers; nano-vllm's ``prepare_decode``):

    host (pinned, numpy views)  --one non_blocking copy per field-->  device buffers (max sizes)

and builds them with numpy over whole arrays instead of Python loops over tokens. Decode-only steps
(every sequence one token, every sequence sampled) replay a CUDA graph of their batch-size bucket on those
same static buffers, captured the first time a decode step of that bucket runs; mixed and prefill steps run
eagerly (CUDA graphs: NVIDIA's ``cudaGraphLaunch``; bucketed capture as in vLLM's ``CUDAGraphRunner``).

The runner's compiled forwards and fused projections are installed in the model only while the engine is
attached (``attach`` / ``detach``): between calls the model runs its own modules.
"""

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import cpu_linear
from .attention import ATTENTION_NAME, AttentionMetadata, AttentionOps
from .kv_pool import KVPool
from .scheduler import SchedulerOutput
from .weights import WeightsChange

logger = logging.getLogger(__name__)

# NOTE: vLLM's bucket ladder: every size up to 4, then multiples of 8 up to 16 and of 16 after it. A
# decode step at batch S runs the smallest bucket >= S; the padding rows cost compute only (their
# weights are read anyway), and decode is bandwidth-bound, so coarse buckets above 16 are nearly free.
_SMALL_BUCKETS = (1, 2, 4, 8)
_BUCKET_STRIDE = 16


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes (sequences) a decode CUDA graph is captured for, ascending; the last is ``max_num_seqs``.

    Raises:
        ValueError: ``max_num_seqs`` not positive.
    """
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes = [s for s in _SMALL_BUCKETS if s < max_num_seqs]
    sizes += [s for s in range(_BUCKET_STRIDE, max_num_seqs, _BUCKET_STRIDE)]
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


@dataclass(slots=True)
class StepTrace:
    """One executed step, recorded when ``ModelRunner.record_steps`` is set (for the bench).

    ``start``/``end`` are CUDA events around the step's device work (metadata copies to logits); on CPU
    they are None and the host times stand in.
    """

    kind: str  # "graph" (decode replay) or "eager"
    num_tokens: int  # tokens in the step (unpadded)
    num_seqs: int  # sequences in the step
    num_context_tokens: int  # sum of seq_lens: KV tokens the attention reads
    host_start: float  # time.perf_counter() at the start of execute (seconds)
    host_end: float  # after the logits were produced (enqueued) (seconds)
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None

    def device_time_s(self) -> float | None:
        """Device time between the two events in seconds (synchronizes on ``end``); None on CPU."""
        if self.start is None:
            return None
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


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
        logits_indices [num_sampled]     the last row of each sequence that is sampled this step

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
        use_cuda_graphs: replay decode steps from CUDA graphs, each bucket's graph captured at its first
            decode step (``_graph_bucket``). Honoured only on CUDA and with a backend that says it can be captured
            (``backend.graph_capturable``; the torch backend calls ``.tolist()``, which cannot be); otherwise the
            runner stays eager.
        compile_layers: ``torch.compile`` the decoder layers around the attention (``compile.py``);
            None: exactly when decode graphs are used. Compiled at construction by dummy forwards
            (``_compile``); a compile error leaves the layers eager and
            is recorded in ``compile_error``. The runner is constructed attached (its forwards installed).
        fuse_projections: fuse q|k|v and gate|up into one GEMM each inside the compiled layers
            (``fusion.py``); None: exactly when layers are compiled. Undone by ``uncompile``.
        cpu_prepack_weights: ``EngineConfig.cpu_prepack_weights`` for the oneDNN CPU projections (below).

    Eager fp32 layers on an x86-64 CPU run their ``nn.Linear`` products through oneDNN during engine forwards
    (``cpu_linear.py``: up to 2x MKL's sgemm on the dev machine); outside them the model is untouched. While the
    weights are stable across calls they read packed copies of the weights (``weights_changed``).

    Raises:
        ValueError: a limit that is not positive; ``fuse_projections=True`` without compiled layers.
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
        use_cuda_graphs: bool = False,
        compile_layers: bool | None = None,
        fuse_projections: bool | None = None,
        cpu_prepack_weights: bool | None = None,
    ):
        assert model.config._attn_implementation == ATTENTION_NAME, model.config._attn_implementation
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
        # a decode step has num_seqs tokens, so the token buffers must hold the largest graph bucket too
        self.max_num_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_num_blocks_per_seq = -(-max_model_len // cache.block_size)
        self._alloc_buffers()
        self._staged: torch.cuda.Event | None = None  # recorded after prepare's host-to-device copies

        self.graphs_enabled = bool(use_cuda_graphs) and self.device.type == "cuda" and backend.graph_capturable
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[int, torch.Tensor] = {}  # bucket -> static [1, bucket, vocab] output
        self.graph_sizes = graph_batch_sizes(max_num_seqs) if self.graphs_enabled else []
        self.graph_capture_error: str | None = None
        self._graph_pool = None  # the memory pool all decode graphs share (created at the first capture)
        self._capture_stream: torch.cuda.Stream | None = None
        self.record_steps = False
        self.steps: list[StepTrace] = []
        self.compiled_layers: list[tuple[torch.nn.Module, object]] = []  # (layer, its previous forward)
        self.compile_error: str | None = None
        self.fusion = None  # fusion.FusionHandle while projections are fused
        # (owner, attribute, the engine's object, the model's own or None: no instance attribute), swapped by
        # attach / detach: each compiled module's forward, each fused group's FusedLinearSlices
        self._swaps: list[tuple[torch.nn.Module, str, object, object | None]] = []
        self.attached = True
        compile_on = compile_layers if compile_layers is not None else self.graphs_enabled
        if fuse_projections and not compile_on:
            raise ValueError("fuse_projections=True needs compiled layers (compile_layers), which are off here: "
                             "eagerly every fused slice computes the whole fused product")
        self.cpu_linears: cpu_linear.RoutedLinears | None = None
        if compile_on:
            self._compile(fuse=fuse_projections is not False)
        if self.device.type == "cpu" and not self.compiled_layers and cpu_linear.available():
            # eager fp32 projections through oneDNN (cpu_linear.py)
            self.cpu_linears = cpu_linear.RoutedLinears(model, prepack=cpu_prepack_weights)

    # -- buffers ----------------------------------------------------------------------------------
    def _alloc_buffers(self) -> None:
        """Pinned host staging (with numpy views) and device buffers of the maximum step sizes."""
        pin = self.device.type == "cuda"
        T, S, W = self.max_num_tokens, self.max_num_seqs, self.max_num_blocks_per_seq

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, host.numpy(), torch.zeros(shape, dtype=dtype, device=self.device)

        self.input_ids_h, self.input_ids_np, self.input_ids = pair((T,), torch.int64)
        self.positions_h, self.positions_np, self.positions = pair((T,), torch.int64)
        self.slot_mapping_h, self.slot_mapping_np, self.slot_mapping = pair((T,), torch.int64)
        self.seq_lens_h, self.seq_lens_np, self.seq_lens = pair((S,), torch.int32)
        self.query_start_loc_h, self.query_start_loc_np, self.query_start_loc = pair((S + 1,), torch.int32)
        self.logits_indices_h, self.logits_indices_np, self.logits_indices = pair((T,), torch.int64)
        # block tables: host staging is compact [num_seqs, width] for the step's width; device is full width
        self.block_tables_h, self.block_tables_np, _ = pair((S * W,), torch.int32)
        self.block_tables = torch.zeros((S, W), dtype=torch.int32, device=self.device)

    def _copy(self, host: torch.Tensor, dev: torch.Tensor, n: int) -> None:
        dev[:n].copy_(host[:n], non_blocking=True)

    # -- building a step --------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, pad_to: int | None = None) -> tuple[int, int, int, int]:
        """Fill the device buffers for ``out``; with ``pad_to`` (a decode step), pad it to that many rows.

        Returns:
            ``(num_tokens, num_sampled, max_query_len, max_seq_len)`` of the (padded) step.
        """
        # NOTE(async scheduling): the previous step's non-blocking copies read the pinned staging buffers
        # until they have run; with a step still in flight, wait for them before writing the buffers again.
        if self._staged is not None:
            self._staged.synchronize()
            self._staged = None
        seqs = out.seqs
        S = len(seqs)
        counts = np.fromiter(out.num_scheduled_tokens, dtype=np.int64, count=S)
        starts = np.fromiter([seq.num_computed_tokens for seq in seqs], dtype=np.int64, count=S)
        T = int(counts.sum())
        assert T <= self.max_num_tokens and S <= self.max_num_seqs, (T, S, self.max_num_tokens, self.max_num_seqs)
        seq_lens = starts + counts
        qsl = self.query_start_loc_np
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1 : S + 1])

        if T == S:  # every sequence one token: no slicing needed
            self.input_ids_np[:T] = [seq.token_ids[s] for seq, s in zip(seqs, starts.tolist())]
            positions = starts
        else:
            self.input_ids_np[:T] = list(itertools.chain.from_iterable(
                seq.token_ids[s : s + n] for seq, s, n in zip(seqs, starts.tolist(), counts.tolist())
            ))
            # position of row r = r - (first row of its sequence) + (its sequence's num_computed_tokens)
            positions = np.arange(T, dtype=np.int64) + np.repeat(starts - qsl[:S], counts)
        self.positions_np[:T] = positions

        block_size = self.cache.block_size
        tables = self.cache.block_manager.block_tables
        seq_tables = [tables[seq.seq_id] for seq in seqs]
        lens = np.fromiter(map(len, seq_tables), dtype=np.int64, count=S)
        width = int(lens.max())
        assert width <= self.max_num_blocks_per_seq, (width, self.max_num_blocks_per_seq)
        bt = self.block_tables_np[: S * width].reshape(S, width)
        # NOTE: all tables in one pass (the entries flattened, then scattered to (row, column)) instead of
        # one numpy assignment per sequence, whose fixed cost dominates at a few hundred sequences.
        total = int(lens.sum())
        flat = np.fromiter(itertools.chain.from_iterable(seq_tables), dtype=np.int32, count=total)
        row_starts = np.arange(S, dtype=np.int64) * width
        bt.reshape(-1)[np.arange(total, dtype=np.int64) + np.repeat(row_starts - (np.cumsum(lens) - lens), lens)] = flat
        seq_index = np.repeat(np.arange(S), counts) if T != S else np.arange(S)
        self.slot_mapping_np[:T] = bt[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size
        self.seq_lens_np[:S] = seq_lens

        sampled = np.array(out.sample_mask, dtype=bool)
        num_sampled = int(sampled.sum())
        self.logits_indices_np[:num_sampled] = (qsl[1 : S + 1] - 1)[sampled]
        max_query_len = int(counts.max())
        max_seq_len = int(seq_lens.max())

        rows, seqs_n = T, S
        if pad_to is not None and pad_to > S:
            assert T == S and num_sampled == S, "only decode steps are padded"
            self.input_ids_np[S:pad_to] = 0
            self.positions_np[S:pad_to] = 0
            self.slot_mapping_np[S:pad_to] = -1
            self.seq_lens_np[S:pad_to] = 1
            qsl[S + 1 : pad_to + 1] = np.arange(S + 1, pad_to + 1)
            self.logits_indices_np[S:pad_to] = np.arange(S, pad_to)
            rows = seqs_n = num_sampled = pad_to

        for host, dev in ((self.input_ids_h, self.input_ids), (self.positions_h, self.positions),
                          (self.slot_mapping_h, self.slot_mapping), (self.logits_indices_h, self.logits_indices)):
            self._copy(host, dev, rows if host is not self.logits_indices_h else num_sampled)
        self._copy(self.seq_lens_h, self.seq_lens, seqs_n)
        self._copy(self.query_start_loc_h, self.query_start_loc, seqs_n + 1)
        self.block_tables[:S, :width].copy_(self.block_tables_h[: S * width].view(S, width), non_blocking=True)
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
        return rows, num_sampled, max_query_len, max_seq_len

    def _forward(self, num_tokens: int, num_seqs: int, num_sampled: int, max_query_len: int, max_seq_len: int):
        """The model forward on the first rows of the device buffers. Returns logits ``[1, num_sampled, vocab]``."""
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
        with self.cpu_linears.routed() if self.cpu_linears is not None else contextlib.nullcontext():
            return self.model(
                input_ids=self.input_ids[:num_tokens].unsqueeze(0),
                position_ids=self.positions[:num_tokens].unsqueeze(0),
                use_cache=False,
                paged_metadata=metadata,
                # every row sampled (a decode step): the indices are 0 .. num_tokens - 1, and the int 0 keeps every
                # row as a slice, without the gather kernel of an index tensor
                logits_to_keep=0 if num_sampled == num_tokens else self.logits_indices[:num_sampled],
            ).logits

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

    @torch.inference_mode()
    def _compile(self, fuse: bool = False) -> None:
        """Compile the decoder layers now (first fusing their projections if ``fuse``). Dummy forwards trace the
        graphs the first real steps need, so that no call recompiles: one token (batch-1 decode, where the
        projections are routed to the GEMV), two sequences of one token (the dynamic-shape graph), and one
        sequence of three tokens with one row sampled (a prompt step: Dynamo specializes a dimension of size 1,
        here the sequence count, and the LM head then gets an index)."""
        from . import fusion
        from .compile import compile_layers

        if fuse:
            self.fusion = fusion.fuse_projections(self.model)
        self.compiled_layers = compile_layers(self.model, fusion.COMPILE_OPTIONS if fuse else None)
        try:
            for n in (1, min(2, self.max_num_seqs)):
                self._forward(*self._dummy_step(n))
            if self.max_num_tokens >= 3:
                self._forward(*self._dummy_prefill(3))
        except BaseException as e:  # an op Dynamo or Inductor cannot handle: stay eager; an interrupt: re-raise
            self.uncompile()
            if not isinstance(e, Exception):
                raise
            self.compile_error = f"{type(e).__name__}: {e}"
            logger.warning("torch.compile of the decoder layers failed, they run eagerly: %s", self.compile_error)
            return
        self._swaps = [(module, "forward", vars(module)["forward"], previous) for module, previous in self.compiled_layers]
        for parent, originals, _ in self.fusion.groups if self.fusion is not None else ():
            self._swaps += [(parent, name, getattr(parent, name), original) for name, original in originals]

    def attach(self) -> None:
        """Install the compiled forwards and the fused projections in the model (the same objects each time, so
        Dynamo's compiled code is reused, not recompiled). Idempotent."""
        if not self.attached:
            for owner, name, ours, _ in self._swaps:
                setattr(owner, name, ours)
            self.attached = True

    def detach(self) -> None:
        """Give the model its own forwards and projection modules back, keeping the compiled wrappers and fused
        modules for ``attach``. The original projections' weights stay views into the fused weights, so in-place
        writes to them (an optimizer step, ``load_state_dict``) are what the fused modules compute with. Idempotent."""
        if self.attached:
            for owner, name, _, theirs in self._swaps:
                if theirs is not None:
                    setattr(owner, name, theirs)
                elif name in vars(owner):
                    delattr(owner, name)  # the class's forward again
            self.attached = False

    def uncompile(self) -> None:
        """Give the model's decoder layers their eager ``forward`` and unfused projections back, for good (the
        engine calls this on close): the original projections get contiguous copies of their weights."""
        from .compile import uncompile_layers
        from .fusion import unfuse_projections

        self.detach()
        self._swaps = []
        uncompile_layers(self.compiled_layers)
        self.compiled_layers = []
        if self.fusion is not None:
            unfuse_projections(self.fusion)
            self.fusion = None

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs and their memory pool (they hold the KV pool's addresses: the engine's
        ``sleep`` and ``close``). Later decode steps capture their buckets' graphs again."""
        self.graphs.clear()
        self.graph_logits.clear()
        self._graph_pool = None

    def weights_changed(self, change: WeightsChange) -> None:
        """How the weights changed since the previous call (``LLMEngine.attach``, once per call): the packed CPU
        weights are made or dropped by their policy (``cpu_linear.RoutedLinears.weights_changed``)."""
        if self.cpu_linears is not None:
            self.cpu_linears.weights_changed(change)

    def drop_packed_weights(self) -> None:
        """Free the packed CPU weights, if any (engine ``sleep``, ``close``, ``reset_prefix_cache``); the next call
        with unchanged weights packs again."""
        if self.cpu_linears is not None:
            self.cpu_linears.drop()

    def release(self) -> None:
        """Drop the captured CUDA graphs, the packed CPU weights and the cache reference (engine close)."""
        self.release_graphs()
        self.drop_packed_weights()
        self.cache = None

    # -- CUDA graphs --------------------------------------------------------------------------------
    def _graph_bucket(self, out: SchedulerOutput) -> int | None:
        """The graph bucket that runs ``out``, or None to run it eagerly.

        A decode-only step (every sequence one token, every one sampled) of ``S <= max_num_seqs`` sequences runs
        the smallest bucket ``>= S``; the bucket's graph is captured now when this is its first step. A failed
        capture turns graphs off for good (``_capture``).
        """
        if not self.graphs_enabled:
            return None
        S = len(out.seqs)
        # every sequence one token, and every one sampled (not a one-token chunk of a prompt)
        if S > self.graph_sizes[-1] or out.num_scheduled_tokens.count(1) != S or not all(out.sample_mask):
            return None
        size = next(size for size in self.graph_sizes if size >= S)
        if size not in self.graphs and not self._capture(size):
            return None
        return size

    def _capture(self, size: int) -> bool:
        """Capture the decode graph of bucket ``size`` (``_record_graph``). Returns False when the capture failed:
        then every graph is dropped, the runner stays eager from now on, and ``graph_capture_error`` says why."""
        try:
            self.graphs[size], self.graph_logits[size] = self._record_graph(self._dummy_step(size))
        except Exception as e:  # an op that syncs or allocates on the host inside the forward
            self.release_graphs()
            self.graphs_enabled = False
            self.graph_capture_error = f"{type(e).__name__}: {e}"
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", self.graph_capture_error)
            return False
        return True

    def _record_graph(self, args: tuple) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record ``_forward(*args)`` (a padded dummy decode step) as a CUDA graph in the shared memory pool.

        The step runs eagerly twice first, on the capture stream (Triton JIT, cuBLAS workspaces); every
        ``slot_mapping`` entry is -1, so the KV cache is not written. The graph is recorded with
        ``max_seq_len = max_model_len`` (a host-side upper bound the kernels size their grids from).

        Returns:
            ``(graph, logits)``: the graph and its static output ``[1, bucket, vocab]``.
        """
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
            self._capture_stream = torch.cuda.Stream(self.device)
        stream, current = self._capture_stream, torch.cuda.current_stream(self.device)
        try:
            stream.wait_stream(current)  # the steps before (and the dummy step's buffer writes) come first
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(*args)
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool, stream=stream):
                logits = self._forward(*args)
        finally:
            torch.cuda.synchronize(self.device)  # the real step's buffer writes come after the capture's reads
        return graph, logits

    # -- a step ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step. Returns float32 logits ``[num_sampled, vocab_size]``, rows in ``out.seqs`` order.

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
            self.graphs[bucket].replay()
            logits = self.graph_logits[bucket][0, :S].float()
        else:
            logits = self._forward(T, S, num_sampled, max_query_len, max_seq_len)[0].float()
        if start is not None:
            end.record()
        if self.record_steps:
            context = sum(seq.num_computed_tokens for seq in out.seqs) + sum(out.num_scheduled_tokens)
            self.steps.append(StepTrace("graph" if bucket is not None else "eager", sum(out.num_scheduled_tokens), S,
                                        context, host_start, time.perf_counter(), start, end))
        return logits
