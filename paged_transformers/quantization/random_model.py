"""``build_random_quantized_model``: a GPTQ/AWQ model of any transformers config shape with random
packed weights, built directly on the device (benchmarks: no 8B quantized checkpoint is available
offline)."""

import torch
from torch import nn

from .formats import awq_to_kernel_layout, gptq_to_kernel_layout
from .linear import QuantLinear
from .loader import build_skeleton, finish_loading

# Scale of the random weights: about N(0, 0.02^2) elementwise, like transformers' initializer_range.
_WEIGHT_STD = 0.02


def build_random_quantized_model(
    config,
    method: str = "gptq",
    bits: int = 4,
    group_size: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    seed: int = 0,
    desc_act: bool = False,
) -> nn.Module:
    """A causal LM of ``config``'s shape whose linears (all but the LM head) are random quantized
    layers, generated in the checkpoint format of ``method`` and converted exactly as ``load_model``
    converts real checkpoints.

    GPTQ layers are symmetric (stored zero ``2**(bits-1) - 1``) with optional act-order (a random
    ``g_idx`` permutation); AWQ layers get random zero points. Scales are fp16, sized so the weights
    have a standard deviation near 0.02. Embeddings and the LM head are N(0, 0.02) in ``dtype``, norm
    weights 1, biases 0. Nothing full-precision of the quantized layers is ever allocated.

    Args:
        config: a transformers ``PretrainedConfig`` of a causal LM (e.g. ``LlamaConfig``).
        method: ``"gptq"`` or ``"awq"``.
        bits: 4 or 8 for GPTQ; 4 for AWQ.
        group_size: rows per group; -1 for per channel (GPTQ).
        dtype: activation / embedding dtype (fp16 or bf16 for the Triton path, fp32 on CPU).
        device: default ``"cuda"`` if available, else ``"cpu"``.
        seed: seeds a ``torch.Generator`` on ``device``.
        desc_act: GPTQ act-order (exercises the input permutation).

    Returns:
        The model in eval mode.

    Raises:
        ValueError: an unknown ``method``, or a bits/group_size combination the method does not have,
            or layer sizes not divisible by the packing/group size.

    Examples:
        >>> from transformers import LlamaConfig
        >>> cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                   num_attention_heads=2, num_key_value_heads=1)
        >>> model = build_random_quantized_model(cfg, "awq", group_size=32, dtype=torch.float32, device="cpu")
        >>> type(model.model.layers[0].mlp.down_proj).__name__, model(torch.tensor([[1, 2]])).logits.shape
        ('QuantLinear', torch.Size([1, 2, 64]))
    """
    if method not in ("gptq", "awq"):
        raise ValueError(f"method must be 'gptq' or 'awq', got {method!r}")
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise ValueError(f"{method} does not support bits={bits}")
    if method == "awq" and group_size == -1:
        raise ValueError("awq needs a positive group_size")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=device).manual_seed(seed)
    model = build_skeleton(config, dtype)
    lm_head = model.get_output_embeddings()
    for name, linear in list(model.named_modules()):
        if not isinstance(linear, nn.Linear) or linear is lm_head:
            continue
        packed = _random_layer(linear.in_features, linear.out_features, method, bits, group_size, desc_act, device, gen)
        module = QuantLinear(
            linear.in_features, linear.out_features, bits, group_size, bias=linear.bias is not None,
            act_order=packed.perm is not None, dtype=dtype, scales_dtype=torch.float16, device=device,
        )  # fmt: skip
        module.load_packed(packed, name)
        if module.bias is not None:
            module.bias.zero_()
        model.set_submodule(name, module)
    for module_name, module in model.named_modules():
        for leaf, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if param.dim() >= 2:
                value = torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32) * _WEIGHT_STD
            elif leaf == "weight":
                value = torch.ones(param.shape, device=device)  # norm weights
            else:
                value = torch.zeros(param.shape, device=device)
            module._parameters[leaf] = nn.Parameter(value.to(dtype), requires_grad=False)
    finish_loading(model, device)
    return model.eval()


def _random_layer(K: int, N: int, method: str, bits: int, group_size: int, desc_act: bool, device, gen):
    """Random checkpoint tensors of one layer, converted to the kernel layout."""
    pack = 32 // bits
    gs = K if group_size == -1 else group_size
    if K % pack or N % pack or K % gs:
        raise ValueError(f"layer {K}x{N}: sizes must be multiples of {pack} and K of group_size={gs}")
    G = K // gs
    levels = 1 << bits
    # (q - z) is about uniform on [-levels/2, levels/2): std ~ levels / sqrt(12)
    scale = _WEIGHT_STD / (levels / 12**0.5)
    scales = ((0.5 + torch.rand(G, N, generator=gen, device=device)) * scale).to(torch.float16)
    if method == "gptq":
        qweight = torch.randint(-(2**31), 2**31, (K // pack, N), generator=gen, device=device, dtype=torch.int32)
        stored_zero = (levels // 2) - 1  # v1 symmetric: zero - 1
        word = sum(stored_zero << (bits * j) for j in range(pack))
        word = word - 2**32 if word >= 2**31 else word
        qzeros = torch.full((G, N // pack), word, dtype=torch.int32, device=device)
        g_idx = None
        if desc_act:
            g_idx = (torch.arange(K, device=device) // gs)[torch.randperm(K, generator=gen, device=device)].to(torch.int32)
        return gptq_to_kernel_layout(qweight, qzeros, scales, g_idx, bits, group_size)
    qweight = torch.randint(-(2**31), 2**31, (K, N // pack), generator=gen, device=device, dtype=torch.int32)
    qzeros = torch.randint(-(2**31), 2**31, (G, N // pack), generator=gen, device=device, dtype=torch.int32)
    return awq_to_kernel_layout(qweight, qzeros, scales, group_size)
