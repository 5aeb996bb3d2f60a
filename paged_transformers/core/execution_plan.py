"""``ExecutionPlan``: how the runner runs the model's layers, decided once per engine from the configuration, the
model and the device (``resolve_execution_plan``, a pure function of those three), then read, never re-decided.

A decoder layer runs one of four ways (``LayerPath``)::

    fused      the fused eager layers of the Llama family (compilation/fused_layers.py): hand-fused Triton kernels,
               q|k|v and gate|up one GEMM each, no compiler. Their kernels need CUDA or the Triton interpreter.
    compiled   torch.compile of each layer around the paged attention (compilation/layers.py), q|k|v and gate|up
               fused inside unless fuse_projections=False.
    onednn     the model's own forward with its fp32 nn.Linear products through oneDNN (cpu_linear.py): eager fp32
               on an x86-64 CPU.
    eager      the model's own forward, untouched.

The rule (``EngineConfig``'s ``compile_layers``, ``fuse_projections``, ``enforce_eager``):

1. Decode CUDA graphs: asked for (not ``enforce_eager``), on CUDA, with an attention backend a graph can capture.
2. The fused layers are tried unless ``compile_layers=True``, when ``fuse_projections=True``, or by default on CUDA;
   they run when they can run the model on this device (``ModelFacts.fused_layers_unsupported``).
3. Otherwise the layers are compiled when ``compile_layers=True``, or by default when decode graphs are on; not
   after a failed compile (``compile_error``).
4. Otherwise eager: through oneDNN where the device has it and the model computes in fp32.

``fuse_projections=True`` with layers that end up neither fused nor compiled is a ValueError naming why, raised before
anything changes the model.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Literal

import torch

from . import cpu_linear

_HALF = (torch.float16, torch.bfloat16)


class LayerPath(enum.Enum):
    """How the decoder layers run (the module docstring describes each)."""

    EAGER = "eager"
    ONEDNN = "onednn"
    FUSED = "fused"
    COMPILED = "compiled"


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """What the rule needs to know of the device and the attention backend.

    Attributes:
        type: ``torch.device.type`` (``"cuda"``, ``"cpu"``, ...).
        triton_interpreter: Triton's interpreter is on (``TRITON_INTERPRET=1``): Triton kernels run on the CPU.
        onednn_linear: the oneDNN linear op is there on an x86-64 CPU (``cpu_linear.available``).
        graph_capturable_attention: the attention backend can be recorded in a CUDA graph
            (``AttentionOps.graph_capturable``).
    """

    type: str
    triton_interpreter: bool
    onednn_linear: bool
    graph_capturable_attention: bool

    @classmethod
    def of(cls, device: torch.device, graph_capturable_attention: bool) -> DeviceFacts:
        """The facts of ``device`` in this process."""
        return cls(device.type, os.environ.get("TRITON_INTERPRET") == "1", cpu_linear.available(),
                   graph_capturable_attention)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the rule needs to know of the model.

    Attributes:
        dtype: the compute dtype (``sizing.model_compute_dtype``).
        fused_layers_unsupported: why the fused eager layers cannot run this model on this device (a sentence), or
            None when they can.
    """

    dtype: torch.dtype
    fused_layers_unsupported: str | None

    @classmethod
    def of(cls, model: torch.nn.Module, dtype: torch.dtype, device: DeviceFacts) -> ModelFacts:
        """The facts of ``model`` (compute dtype ``dtype``) on ``device``; the fused layers' check looks at the model
        only where their kernels can run (CUDA or the Triton interpreter)."""
        if device.type != "cuda" and not device.triton_interpreter:
            reason = f"their kernels need CUDA or the Triton interpreter (TRITON_INTERPRET=1) on {device.type}"
        else:
            from ..compilation import fused_layers_unsupported

            reason = fused_layers_unsupported(model)
        return cls(dtype, reason)


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """How the runner runs the model (``resolve_execution_plan``); ``engine.execution_plan``.

    Attributes:
        layers: the decoder layers' path (``LayerPath``).
        fuse_projections: q|k|v and gate|up computed as one GEMM each (where a layer's projections can be fused).
        gemv_at_batch_1: one-row products of plain fp16/bf16 projections take the Triton GEMV (fused or compiled
            layers on CUDA).
        cuda_graphs: decode-only steps replay a CUDA graph of their batch-size bucket.
        cuda_graph_sizes: the buckets (sequences), ascending; empty without CUDA graphs.
        precompile_kernels: the dummy forwards at construction compile our Triton kernels' variants (uncompiled
            layers on CUDA with the Triton attention; compiled layers get them from their own warm-ups).
        cpu_weight_packing: the oneDNN projections' packed weights (``EngineConfig.cpu_prepack_weights``):
            ``"when_unchanged"`` (None), ``"always"`` (True) or ``"off"`` (False, or not the oneDNN path).
        fused_layers_unsupported: why the fused layers do not run the model where the rule tried them, else None.
        compile_error: why compiling the layers failed (the layers then run eagerly), else None.
    """

    layers: LayerPath
    fuse_projections: bool
    gemv_at_batch_1: bool
    cuda_graphs: bool
    cuda_graph_sizes: tuple[int, ...]
    precompile_kernels: bool
    cpu_weight_packing: Literal["off", "when_unchanged", "always"]
    fused_layers_unsupported: str | None = None
    compile_error: str | None = None

    def __str__(self) -> str:
        """One line: the path and what it uses, then the reasons for a fallback."""
        sizes = self.cuda_graph_sizes
        parts = [f"layers={self.layers.value}", f"fuse_projections={self.fuse_projections}",
                 f"gemv_at_batch_1={self.gemv_at_batch_1}",
                 f"cuda_graphs={f'{len(sizes)} buckets {sizes[0]}-{sizes[-1]}' if sizes else 'off'}",
                 f"precompile_kernels={self.precompile_kernels}", f"cpu_weight_packing={self.cpu_weight_packing}"]
        if self.fused_layers_unsupported is not None:
            parts.append(f"fused layers not used: {self.fused_layers_unsupported}")
        if self.compile_error is not None:
            parts.append(f"compile failed: {self.compile_error}")
        return ", ".join(parts)


def resolve_execution_plan(*, cuda_graphs: bool, compile_layers: bool | None, fuse_projections: bool | None,
                           cpu_prepack_weights: bool | None, max_cudagraph_capture_size: int, model: ModelFacts,
                           device: DeviceFacts, compile_error: str | None = None) -> ExecutionPlan:
    """The plan for ``EngineConfig``'s knobs (``cuda_graphs`` is ``not enforce_eager``) on ``model`` and ``device``,
    by the rule of the module docstring; ``max_cudagraph_capture_size``: the largest decode graph bucket (sequences).
    ``compile_error``: a failed compile of the layers this rule chose to
    compile (the runner resolves again with it).

    Raises:
        ValueError: ``fuse_projections=True`` with layers that would be neither fused nor compiled, naming why the
            fused layers cannot run the model.
    """
    graphs = cuda_graphs and device.type == "cuda" and device.graph_capturable_attention
    try_fused = compile_layers is not True and (fuse_projections or (fuse_projections is None and device.type == "cuda"))
    fused = try_fused and model.fused_layers_unsupported is None
    compile_wanted = not fused and (compile_layers if compile_layers is not None else graphs)
    if fuse_projections and try_fused and not fused and not compile_wanted:
        raise ValueError("fuse_projections=True with uncompiled layers needs the fused eager layers, which cannot run "
                         f"this model: {model.fused_layers_unsupported}")
    if fused:
        layers = LayerPath.FUSED
    elif compile_wanted and compile_error is None:
        layers = LayerPath.COMPILED
    elif device.type == "cpu" and device.onednn_linear and model.dtype == torch.float32:
        layers = LayerPath.ONEDNN
    else:
        layers = LayerPath.EAGER
    sizes = ()
    if graphs:
        from ..compilation import graph_batch_sizes

        sizes = tuple(graph_batch_sizes(max_cudagraph_capture_size))
    packing = "off"
    if layers is LayerPath.ONEDNN and cpu_prepack_weights is not False:
        packing = "always" if cpu_prepack_weights else "when_unchanged"
    fast = layers in (LayerPath.FUSED, LayerPath.COMPILED)
    return ExecutionPlan(
        layers=layers,
        fuse_projections=fused or (layers is LayerPath.COMPILED and fuse_projections is not False),
        gemv_at_batch_1=fast and device.type == "cuda" and model.dtype in _HALF,
        cuda_graphs=graphs,
        cuda_graph_sizes=sizes,
        precompile_kernels=device.type == "cuda" and device.graph_capturable_attention and layers is not LayerPath.COMPILED,
        cpu_weight_packing=packing,
        fused_layers_unsupported=model.fused_layers_unsupported if try_fused and not fused else None,
        compile_error=compile_error,
    )
