"""``Compilation``: everything the engine installs in the unmodified model to make it fast, behind one
apply / restore pair.

- compiled decoder layers, rotary embedding, norm and LM head (``layers.py``), traced under
  ``layers.tracing_settings``;
- q|k|v and gate|up fused into one GEMM each inside them (``fusion.py``), the batch-1 projections routed to the
  Triton GEMV (``gemv_routing.py``, an Inductor pass of the compile);
- or, in place of compiled layers (and the default where they apply), the fused eager decoder layers of the Llama
  family (``fused_layers.py``: the same kernel sequence without a compiler) with those fused projections;
- the decode steps' CUDA graphs (``cuda_graphs.py``).

``apply()`` installs the compiled forwards and fused projections in the model for an engine call, ``restore()``
gives the model its own modules back between calls (keeping the compiled code, so the next ``apply()`` neither
recompiles nor re-fuses), ``undo()`` removes it all for good (engine close).
"""

import contextlib
import logging
from typing import Callable, Iterable

import torch

from . import fused_layers, fusion
from .cuda_graphs import DecodeGraphs
from .layers import compile_layers, tracing_settings, uncompile_layers

logger = logging.getLogger("paged_transformers")


def fused_layers_unsupported(model: torch.nn.Module) -> str | None:
    """Why the fused eager layers cannot run ``model`` (``fused_layers.unsupported``, or the projection groups that
    could not be fused, the first three named), or None when they can."""
    reason = fused_layers.unsupported(model)
    skipped = fusion.unfusable(model) if reason is None else []
    return reason or ("projections not fused: " + "; ".join(skipped[:3]) if skipped else None)


class Compilation:
    """The compiled layers, fused projections and decode graphs of one engine's model.

    Args:
        model: the transformers model (its decoder layers subclass ``GradientCheckpointingLayer``).
        device: the model's device.
        max_cudagraph_capture_size: the largest decode graph bucket (sequences).
        cuda_graphs: capture decode graphs (``DecodeGraphs``); the caller checks that the device and the attention
            backend allow it.

    Attributes:
        graphs: the ``DecodeGraphs``, or None without CUDA graphs.
        modules: ``(module, previous instance forward or None)`` per compiled module (empty: eager layers).
        fused_modules: the same for the fused eager layers (``fuse_layers``; empty otherwise).
        fusion: the ``fusion.FusionHandle`` while projections are fused, else None.
        compile_error: why compiling failed (the layers then stay eager), or None.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, max_cudagraph_capture_size: int, cuda_graphs: bool):
        self.model = model
        self.graphs = DecodeGraphs(device, max_cudagraph_capture_size) if cuda_graphs else None
        self.modules: list[tuple[torch.nn.Module, object]] = []
        self.fused_modules: list[tuple[torch.nn.Module, object]] = []
        self.fusion: fusion.FusionHandle | None = None
        self.compile_error: str | None = None
        # (owner, attribute, ours, the model's own or None: no instance attribute), swapped by apply / restore
        self._swaps: list[tuple[torch.nn.Module, str, object, object | None]] = []
        self.applied = True

    @torch.inference_mode()
    def compile(self, fuse: bool, warmups: Iterable[Callable[[], object]]) -> None:
        """Fuse the projections (if ``fuse``), compile the layers and run ``warmups`` (dummy forwards), which trace
        every graph the real steps need, under ``scope()``. An error there (an op Dynamo or Inductor cannot
        handle) undoes it all and leaves the layers eager, with ``compile_error`` set; an interrupt re-raises."""
        if fuse:
            self.fusion = fusion.fuse_projections(self.model)
        self.modules = compile_layers(self.model, fusion.COMPILE_OPTIONS if fuse else None)
        try:
            for warmup in warmups:
                with self.scope():
                    warmup()
        except BaseException as e:
            self.undo()
            if not isinstance(e, Exception):
                raise
            self.compile_error = f"{type(e).__name__}: {e}"
            logger.warning("torch.compile of the decoder layers failed, they run eagerly: %s", self.compile_error)
            return
        self._record_swaps(self.modules)

    def fuse_layers(self) -> None:
        """Fuse the projections and install the fused eager decoder layers (``fused_layers``) instead of compiling.

        Raises:
            ValueError: they cannot run the model (``fused_layers_unsupported``, checked by the caller's plan first);
                the model is then left untouched.
        """
        reason = fused_layers_unsupported(self.model)
        if reason is not None:
            raise ValueError(f"the fused eager layers cannot run this model: {reason}")
        self.fusion = fusion.fuse_projections(self.model)
        self.fused_modules = fused_layers.install(self.model, self.fusion.groups)
        self._record_swaps(self.fused_modules)
        return None

    def _record_swaps(self, changed: list[tuple[torch.nn.Module, object]]) -> None:
        """The swaps of ``apply`` / ``restore``: the forwards ``changed`` set, then the fused projection modules."""
        self._swaps = [(module, "forward", vars(module)["forward"], previous) for module, previous in changed]
        for parent, originals, _ in self.fusion.groups if self.fusion is not None else ():
            self._swaps += [(parent, name, getattr(parent, name), original) for name, original in originals]

    def scope(self) -> contextlib.AbstractContextManager:
        """What every engine forward runs under: ``layers.tracing_settings`` when layers are compiled (Dynamo
        traces and recompiles there), else nothing."""
        return tracing_settings() if self.modules else contextlib.nullcontext()

    def apply(self) -> None:
        """Install the compiled forwards and the fused projections in the model (the same objects each time, so
        Dynamo's compiled code is reused, not recompiled). Idempotent."""
        if not self.applied:
            for owner, name, ours, _ in self._swaps:
                setattr(owner, name, ours)
            self.applied = True

    def restore(self) -> None:
        """Give the model its own forwards and projection modules back, keeping the compiled wrappers and fused
        modules for ``apply``. The original projections' weights stay views into the fused weights, so in-place
        writes to them (an optimizer step, ``load_state_dict``) are what the fused modules compute with. Idempotent."""
        if self.applied:
            for owner, name, _, theirs in self._swaps:
                if theirs is not None:
                    setattr(owner, name, theirs)
                elif name in vars(owner):
                    delattr(owner, name)  # the class's forward again
            self.applied = False

    def undo(self) -> None:
        """Give the model's decoder layers their own ``forward`` and unfused projections back, for good (engine
        close): the original projections get contiguous copies of their weights. The graphs are dropped."""
        self.restore()
        self._swaps = []
        uncompile_layers(self.modules)
        self.modules = []
        self.fused_modules = []  # restore() gave them their own forwards
        if self.fusion is not None:
            fusion.unfuse_projections(self.fusion)
            self.fusion = None
        if self.graphs is not None:
            self.graphs.release()
