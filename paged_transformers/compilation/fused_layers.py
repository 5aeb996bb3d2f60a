"""Fused eager decoder layers for the Llama family: the engine's layers on CUDA by default (``compile_layers`` None
or False), in and out of decode CUDA graphs.

Eager, a transformers Llama decoder layer runs some forty kernels per step: each RMSNorm is six (upcast, square,
mean, rsqrt, two multiplies), the rotary embedding of q and of k ten more, q, k, v, gate and up one GEMM each, and
SiLU, the product and the residual adds one each, with a round trip through memory between any two. ``torch.compile``
(``layers.py``) fuses the small ops into a few Triton kernels and, with ``fusion.py``, computes q|k|v and gate|up as
one GEMM each, but Dynamo and Inductor take most of a cold engine start (about two thirds of it at the Llama-3-8B
shape). This module gives the layers the compiled layers' kernel sequence without a compiler, as
vLLM and SGLang define their Llama models (``QKVParallelLinear``, ``fused_add_rms_norm``,
``rotary_embedding``, ``silu_and_mul``)::

    rms_norm(x) -> q|k|v GEMM -> rotary(q), rotary(k) -> write K/V, paged attention -> o GEMM
    -> rms_norm(residual + attn), the sum kept -> gate|up GEMM -> silu_and_mul -> down GEMM -> + residual

seven kernels of ours (``kernels.layer_ops``, the cache write, the attention), the last residual add and four GEMMs
per layer; at one row each GEMM is the Triton GEMV, as in the compiled layers (``gemv_routing.project``). The final
norm uses the same RMSNorm kernel; the rotary embedding's cos/sin and the LM head run the model's own code (the
compiled path compiles them: ``layers.outer_modules``' NOTE puts the eager rotary and norm together at about 0.5% of
a Llama-3-8B batch-1 step, and cuBLAS's LM head slightly slower than the GEMV). Every op rounds to the model dtype
where the eager code does, so the results are the eager layers' up to the order of the RMSNorm sum and of the GEMMs'
reductions.

It applies to transformers' ``LlamaDecoderLayer``, ``MistralDecoderLayer`` and ``Qwen2DecoderLayer`` exactly (not
subclasses, whose forward may differ), with a SiLU MLP, a power-of-two head dim, no hooks or instance ``forward`` on
the layer or its parts (accelerate's offload; the tensor-parallel all-reduce hooks sit on ``o_proj`` / ``down_proj``,
which are called as modules and keep them), and q|k|v and gate|up fused in every layer (``fusion.fuse_projections``).
``unsupported`` says why not. Installed and removed by ``Compilation.fuse_layers`` / ``restore`` / ``undo``, so
between engine calls the model runs its own forward.

NOTE: on empty compile caches the engine builds about 4x faster with these layers than with the compiled ones
(Llama-3-8B shape, bf16), and decodes as fast (docs/benchmark-history.md). Hence the default for these layer
classes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..forward_context import current_metadata
from ..kernels.layer_ops import rms_norm, rotary_embedding, silu_and_mul
from .gemv_routing import project
from .layers import decoder_layers


def _layer_classes() -> dict[type, Callable[[nn.Module], int | None]]:
    """Decoder layer class -> the sliding window (tokens, or None) of one of its attention modules, as the class's
    attention forward passes it to the attention function."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    return {
        LlamaDecoderLayer: lambda attn: None,
        MistralDecoderLayer: lambda attn: getattr(attn.config, "sliding_window", None),
        Qwen2DecoderLayer: lambda attn: getattr(attn, "sliding_window", None),
    }


_SILU = ("SiLU", "SiLUActivation")  # nn.SiLU; transformers' ACT2FN["silu"]


def _hooked(module: nn.Module) -> bool:
    return "forward" in vars(module) or bool(module._forward_hooks or module._forward_pre_hooks)


def unsupported(model: nn.Module) -> str | None:
    """Why the fused eager layers cannot run ``model``'s decoder layers (the first reason found), or None when they
    can (projections are fused separately, by ``fusion.fuse_projections``)."""
    layers = decoder_layers(model)
    if not layers:
        return "no decoder layers (GradientCheckpointingLayer) found"
    classes = _layer_classes()
    for i, layer in enumerate(layers):
        if type(layer) not in classes:
            return f"layer {i} is a {type(layer).__name__}, not one of {', '.join(c.__name__ for c in classes)}"
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(m).__module__ != type(layer).__module__ for m in (attn, mlp, *norms)):
            return f"layer {i}'s attention, MLP or norms were replaced by modules of another class"
        if any(_hooked(m) for m in (layer, attn, mlp, mlp.act_fn, *norms)):
            return f"layer {i} or its attention, MLP or norms have hooks or an instance forward"
        if type(mlp.act_fn).__name__ not in _SILU:
            return f"layer {i}'s activation is {type(mlp.act_fn).__name__}, not SiLU"
        D = attn.head_dim
        if D < 2 or D & (D - 1):
            return f"head_dim {D} is not a power of two"
    return None


@dataclass(frozen=True, slots=True)
class _LayerPlan:
    """What a fused layer's forward needs, fixed at install: the fused q|k|v and gate|up modules (outside the
    module tree, held by ``fusion``'s handle) and the attention's sizes."""

    qkv: nn.Module  # [.., q_size + 2 kv_size] output
    gate_up: nn.Module  # [.., 2 intermediate_size] output
    q_size: int  # query features (heads x head_dim)
    kv_size: int  # key (= value) features
    head_dim: int
    sliding_window: int | None


def _linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for ``x [T, K]``; a plain ``nn.Linear`` without hooks through ``gemv_routing.project`` (the GEMV
    at one CUDA row), anything else (``QuantLinear``, a sharded layer's hooked ``o_proj``) as a module call."""
    if type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks):
        return project(x, module.weight, module.bias)
    return module(x)


def fused_layer_forward(layer: nn.Module, plan: _LayerPlan, hidden_states: torch.Tensor, *args,
                        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                        paged_metadata=None, **kwargs) -> torch.Tensor:
    """A Llama-family decoder layer on the paged engine (module docstring), in place of the layer's ``forward``.

    Args:
        layer: the decoder layer (its norms' weights and ``o_proj`` / ``down_proj`` are read at each call, so weights
            changed in place between calls are used).
        plan: the layer's ``_LayerPlan``.
        hidden_states: ``[1, num_tokens, hidden]`` (the engine's one packed row; any leading shape works).
        position_embeddings: the model's rotary ``(cos, sin)``, each ``[1, num_tokens, head_dim]``.
        paged_metadata: the step's ``AttentionMetadata`` (from the model's forward, else the step hooks':
            ``current_metadata``).
        args, kwargs: the rest of the layer's arguments (mask, position ids, cache flags), unused: masking comes from
            the metadata.

    Returns:
        ``hidden_states``' shape and dtype: the layer's output.

    Raises:
        RuntimeError: outside an engine step (no metadata), without ``position_embeddings``, or in training mode
            with attention dropout.
    """
    md = paged_metadata if paged_metadata is not None else current_metadata()
    attn = layer.self_attn
    if md is None or position_embeddings is None:
        raise RuntimeError(f"the fused {type(layer).__name__} runs only inside the paged engine's forward, with the "
                           "model's position_embeddings and the step's paged_metadata")
    if attn.training and attn.attention_dropout:
        raise RuntimeError(f"{type(attn).__name__} is in training mode with attention dropout "
                           f"{attn.attention_dropout}; the paged engine only runs inference: call model.eval() first")
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])  # [T, hidden]
    T, D = x.shape[0], plan.head_dim
    norm = layer.input_layernorm
    qkv = _linear(plan.qkv, rms_norm(x, norm.weight, norm.variance_epsilon))  # [T, q_size + 2 kv_size]
    cos, sin = (t.reshape(-1, D) for t in position_embeddings)  # [T, D]
    q = rotary_embedding(qkv[:, : plan.q_size].view(T, -1, D), cos, sin)
    k = rotary_embedding(qkv[:, plan.q_size : plan.q_size + plan.kv_size].view(T, -1, D), cos, sin)
    v = qkv[:, plan.q_size + plan.kv_size :].view(T, -1, D)
    key_cache, value_cache = md.cache.key_cache[attn.layer_idx], md.cache.value_cache[attn.layer_idx]
    md.write_kv(k, v, key_cache, value_cache, md.slot_mapping)
    extra = {} if md.attend_plan is None else {"plan": md.attend_plan}
    o = md.attend(q, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, attn.scaling,
                  sliding_window=plan.sliding_window, softcap=None, max_query_len=md.max_query_len,
                  max_seq_len=md.max_seq_len, **extra)  # [T, H, D]
    norm = layer.post_attention_layernorm
    h, residual = rms_norm(_linear(attn.o_proj, o.view(T, -1)), norm.weight, norm.variance_epsilon, residual=x)
    out = residual + _linear(layer.mlp.down_proj, silu_and_mul(_linear(plan.gate_up, h)))
    return out.view(shape)


def fused_norm_forward(norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The model's final RMSNorm (``kernels.layer_ops.rms_norm``) in place of its ``forward``: ``[..., hidden]`` in,
    the same shape out."""
    shape = hidden_states.shape
    out = rms_norm(hidden_states.reshape(-1, shape[-1]), norm.weight, norm.variance_epsilon)
    return out.view(*shape[:-1], out.shape[-1])


def install(model: nn.Module, groups) -> list[tuple[nn.Module, object]]:
    """Set ``fused_layer_forward`` on each decoder layer of ``model`` (checked by ``unsupported``) and
    ``fused_norm_forward`` on the final norm when it is a norm of one of those models.

    Args:
        model: the model.
        groups: ``fusion.FusionHandle.groups`` with q|k|v and gate|up fused in every layer.

    Returns:
        ``(module, its previous instance forward or None)`` per module changed, as ``layers.compile_layers``.
    """
    fused = {id(parent): module for parent, _, module in groups}
    windows = _layer_classes()
    changed = []
    for layer in decoder_layers(model):
        attn = layer.self_attn
        q_size = attn.q_proj.out_features
        plan = _LayerPlan(qkv=fused[id(attn)], gate_up=fused[id(layer.mlp)], q_size=q_size,
                          kv_size=attn.k_proj.out_features, head_dim=attn.head_dim,
                          sliding_window=windows[type(layer)](attn))
        changed.append((layer, vars(layer).get("forward")))
        layer.forward = functools.partial(fused_layer_forward, layer, plan)
    norm = getattr(getattr(model, "model", None), "norm", None)
    layer_norm = type(decoder_layers(model)[0].input_layernorm)
    if type(norm) is layer_norm and not _hooked(norm):
        changed.append((norm, None))
        norm.forward = functools.partial(fused_norm_forward, norm)
    return changed
