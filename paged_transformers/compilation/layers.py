"""``torch.compile`` of the model's decoder layers, split at the paged attention ("piecewise" compile).

The forward stays the model's own transformers code. Each decoder layer's ``forward`` is replaced, on
the instance, by ``torch.compile(forward, dynamic=True)``; the paged attention function is excluded from
tracing (``torch.compiler.disable`` in ``attention.py``), so Dynamo splits every layer into a graph
before and a graph after attention, and all layers of one class share those graphs (their weights are
graph inputs). Inductor fuses the small ops between the projections -- RMSNorm's upcast / mean / rsqrt /
scale, the rotary embedding's halves and concatenation, SiLU times the up projection, residual adds --
into a few Triton kernels; the projections stay cuBLAS (or our W4A16 kernel) calls, except at batch 1, where
``gemv_routing.DecodeLinearPass`` routes them to our Triton GEMV. vLLM compiles its
model definitions the same way, with the graph split at attention (its ``splitting_ops``). The rotary
embeddings, the RMSNorms and the LM head outside the layers (``outer_modules``) are compiled the same way, one graph
each.

Inductor runs with ``combo_kernels`` (independent kernels of a graph horizontally fused into one launch: the rotary
embeddings of q and of k become one kernel; about 7% fewer kernels per Llama-3-8B decode step, and less device
time at batch 1 and 256: docs/benchmark-history.md) and with
``emulate_precision_casts`` so that a fused kernel rounds to the model dtype where the
eager code does (e.g. the bf16 output of SiLU before the multiply), keeping the numbers those of the
eager model up to the order of floating-point reductions.
"""

import contextlib

import torch
import torch.fx.experimental._config as fx_config
from transformers import GradientCheckpointingLayer

from .gemv_routing import DecodeLinearPass

INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "post_grad_custom_post_pass": DecodeLinearPass(),
                    "combo_kernels": True}

# NOTE: Dynamo keeps at most ``recompile_limit`` (8 by default) compiled versions of one code object, then runs it
# eagerly, silently. transformers' wrappers (the layers' ``__call__`` / checkpointing wrappers, the rotary embedding's
# decorator) are one code object for every model class, and each model compiled in a process adds versions of them:
# with the default, the third model class's layers already ran eagerly (tiny models on CPU, compile_error None).
# ``tracing_settings`` raises it inside the engine's forwards.
RECOMPILE_LIMIT = 64


def tracing_settings() -> contextlib.ExitStack:
    """The torch settings the compiled layers are traced under, entered around every forward of an engine with
    compiled layers (where Dynamo traces and recompiles), never set process-wide:

    - ``backed_size_oblivious`` and no duck shapes: Dynamo does not specialize the row count 1 (a batch-1 decode
      step) nor tie it to the other dimensions of size 1, so one graph per layer piece serves every step shape.
      A Llama's layers, rotary embedding, norm and LM head trace 7 graphs instead of 14, which halves the Dynamo
      and Inductor time of the first engine in a process. The batch-1 projections still take the GEMV:
      ``gemv_routing.linear`` chooses at run time.
    - ``recompile_limit`` of at least ``RECOMPILE_LIMIT`` (the NOTE above).
    """
    stack = contextlib.ExitStack()
    stack.enter_context(fx_config.patch(backed_size_oblivious=True, use_duck_shape=False))
    stack.enter_context(torch._dynamo.config.patch(
        recompile_limit=max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)))
    return stack


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules that subclass transformers' ``GradientCheckpointingLayer``
    (every decoder layer of transformers 5 models does), outermost only, in module order."""
    layers, inside = [], set()
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(name.startswith(p + ".") for p in inside):
            layers.append(module)
            inside.add(name)
    return layers


def outer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules outside the decoder layers that are compiled with them: the rotary embeddings and RMSNorms (by
    transformers' class names, ``*RotaryEmbedding`` / ``*RMSNorm``: Llama's ``model.rotary_emb`` and final
    ``model.norm``), in module order, then the LM head when it is a plain ``nn.Linear``.

    NOTE: eager, the first two are a dozen small kernels per step (the rotary cos/sin: a matmul, cos, sin, cat,
    scaling and casts; the norm: mean, rsqrt, multiplies and casts), about 0.5% of a Llama-3-8B batch-1 decode
    step; compiled, one fused kernel each. The compiled LM head's matmul is routed like the layers' projections
    (``gemv_routing``): the Triton GEMV at one token (about 4% faster than cuBLAS on a 128256 x 4096 head in
    ``bench_gemv.py``), cuBLAS otherwise.
    """
    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    outer = [m for m in model.modules()
             if id(m) not in inside and type(m).__name__.endswith(("RotaryEmbedding", "RMSNorm"))]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is torch.nn.Linear:
        outer.append(head)
    return outer


def compile_layers(model: torch.nn.Module, options: dict | None = None) -> list[tuple[torch.nn.Module, object]]:
    """Replace the ``forward`` of each decoder layer, then of each of ``outer_modules``, by its ``torch.compile``d
    version (lazy: Dynamo traces on the first call, which must run under ``tracing_settings``). A ``forward``
    already set on the instance (accelerate's device-map / offload hooks, a user's wrapper) is what gets compiled,
    and is put back by ``uncompile_layers``. ``options``: Inductor options on top of ``INDUCTOR_OPTIONS``
    (``fusion.COMPILE_OPTIONS`` when projections are fused).

    Returns:
        ``(module, previous instance forward or None)`` per module changed, decoder layers first, for
        ``uncompile_layers``; empty when the model has no ``GradientCheckpointingLayer`` (nothing is changed then).
    """
    changed, options = [], {**INDUCTOR_OPTIONS, **(options or {})}
    layers = decoder_layers(model)
    for module in layers + (outer_modules(model) if layers else []):
        changed.append((module, vars(module).get("forward")))
        module.forward = torch.compile(module.forward, dynamic=True, options=options)
    return changed


def uncompile_layers(changed: list[tuple[torch.nn.Module, object]]) -> None:
    """Undo ``compile_layers``: each module gets back the ``forward`` it had before (its class's, or the
    instance attribute that was there)."""
    for module, previous in changed:
        if previous is not None:
            module.forward = previous
        elif "forward" in vars(module):
            del module.forward
