"""The engine's life around calls: attach / detach (the model is its user's between calls), sleep / wake_up
(the KV pool freed and allocated again) and close.

``detach()`` gives the model back to its user (its own attention, forwards and projection modules) and
``attach()`` installs the engine's again, checking the weights (``weights.py``); ``sleep()`` / ``wake_up()``
free and restore the KV pool. ``warm.py`` keeps one such engine per model.
"""

import logging
import os

import torch

from .attention import ATTENTION_NAME
from ..compat import attn_implementation
from ..forward_context import install_step_hooks
from .weights import StaleWeightsError, WeightsChange, WeightsSnapshot

logger = logging.getLogger(__name__)


class EngineLifecycle:
    """``LLMEngine``'s lifecycle methods (a mixin: the state is the engine's; see ``LLMEngine``)."""

    def _install(self) -> None:
        """Our attention implementation and the step hooks on the model (the runner's modules: ``runner.attach``)."""
        self._previous_attn = attn_implementation(self.model.config)
        self.model.set_attn_implementation(ATTENTION_NAME)
        self._step_hooks = install_step_hooks(self.model)
        self.attached = True

    def _uninstall(self) -> None:
        """Undo ``_install``: the step hooks removed, the model's previous attention implementation back."""
        for hook in self._step_hooks:
            hook.remove()
        self._step_hooks = []
        if attn_implementation(self.model.config) == ATTENTION_NAME:
            self.model.set_attn_implementation(self._previous_attn)
        self.attached = False

    def attach(self) -> None:
        """Install the engine in the model for a call: our attention implementation, the compiled forwards, the
        fused projection modules and the step hooks (cheap swaps of objects the engine keeps: nothing is
        recompiled or captured again). Checks the weights (``weights.py``) against the snapshot of ``detach()`` and
        the checksums of the previous ``attach()`` (one read of every weight): written in place since then (an
        optimizer step, ``load_state_dict``, a write through ``.data``) -> the prefix cache and the copies derived
        from the weights are dropped (``runner.weights_changed``); the EOS ids are read again from the model's
        generation config (and the tokenizer), for the requests added after this call (a request keeps the stop
        conditions it was added with). Idempotent.

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
        check_not_attached(self.model)
        change, detail = self._weights.compare(self.model)
        if change is WeightsChange.REPLACED:
            raise StaleWeightsError(f"the model's weights were replaced since this engine last ran ({detail}); "
                                    "close it and build a new one")
        # the checksums see what the version counters miss (writes through .data, fused optimizers): weights.py;
        # the same storages as the last fingerprint's (nothing was replaced), so it reads them without a model walk
        fingerprint = self._fingerprint.again()
        changed_values = self._fingerprint.compare(fingerprint)
        self._fingerprint = fingerprint
        if change is WeightsChange.NONE and changed_values:
            change, detail = WeightsChange.UPDATED, changed_values
        self._install()
        self.runner.attach()
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)  # for the requests added from now on
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

    @property
    def execution_plan(self):
        """How the runner runs the model (``execution_plan.ExecutionPlan``: the layers' path, fused projections, the
        batch-1 GEMV, CUDA graphs and their buckets, CPU weight packing), resolved once at construction."""
        return self.runner.execution_plan

    def capture_cudagraphs(self) -> int:
        """Capture every decode bucket's CUDA graph now, as vLLM does at start-up (its model runner's
        ``capture_model``), instead of at each bucket's first step: a server calls it before it takes requests, so
        that no request waits for a capture (each runs a dummy decode step of its bucket twice, then records it;
        ``compilation.cuda_graphs.graph_batch_sizes`` lists the buckets: 20 for 256 sequences). ``paged_generate``
        and the patched ``generate()`` keep capturing lazily, so that a process that only decodes at batch 1
        captures one graph. ``sleep()`` drops the graphs; call this again after ``wake_up()``.

        A detached engine (a warm engine between calls: ``LLM(...).llm_engine``) is attached for the capture and
        detached again (``attach``'s weight check included), so call it between calls, not while another thread's
        call on the model runs.

        Returns:
            The number of graphs captured (0 without CUDA graphs: CPU, ``enforce_eager``).

        Raises:
            RuntimeError: the engine is closed or asleep (``_check_usable``).
            StaleWeightsError: detached, and the model's weights were replaced since (``attach``).
        """
        if self.attached or self.closed or self.sleeping:
            self._check_usable()  # closed, or asleep (an asleep engine has no pool for the graphs to read)
            self._drain()
            return self.runner.capture_decode_graphs()
        self.attach()
        try:
            return self.runner.capture_decode_graphs()
        finally:
            self.detach()

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
        if attn_implementation(self.model.config) != ATTENTION_NAME:
            raise RuntimeError(
                f"the model's attn_implementation is {attn_implementation(self.model.config)!r}, not {ATTENTION_NAME!r}: "
                "it was switched while this engine was open (another engine on the same model closed?); use one "
                "engine per model at a time"
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def check_not_attached(model: torch.nn.Module) -> None:
    """Raises ValueError when an engine is attached to ``model`` (its attn_implementation is ours)."""
    if hasattr(model, "config") and attn_implementation(model.config) == ATTENTION_NAME:
        raise ValueError(
            f"this model's attn_implementation is already {ATTENTION_NAME!r}: another LLMEngine (or paged_generate) "
            "is open on it; close that engine first (one engine per model at a time), or switch the model back "
            "with model.set_attn_implementation('sdpa')"
        )


def eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    """EOS ids as ``generate()`` would use them: the generation config's, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)

