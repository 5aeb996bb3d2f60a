"""``load_model``: load GPTQ v1 / AWQ GEMM checkpoints natively (no quantization library), or a plain
checkpoint through transformers.

Quantized path, in order:

1. parse ``quantization_config`` (``config.py``); unsupported formats raise before any weight is read;
2. build the transformers model skeleton from its config with every *parameter* on the meta device
   (buffers such as RoPE's ``inv_freq`` are computed for real), so no full-precision weight of a
   quantized layer is ever allocated;
3. for every ``<prefix>.qweight`` in the safetensors shards, convert that layer to the kernel layout
   on the target device and swap the ``nn.Linear`` at ``<prefix>`` for a ``QuantLinear``;
4. load every other tensor (embeddings, norms, ``lm_head``, biases) in ``dtype`` on the device, tie
   the embeddings if the config says so, and check nothing is left on the meta device.

Which linears are quantized is read from the checkpoint (the layers that have a ``qweight``), so
``lm_head`` and ``modules_to_not_convert`` stay ``nn.Linear`` exactly when their plain ``weight`` is
stored.
"""

import contextlib
import json
import os
import warnings

import torch
from safetensors import safe_open
from torch import nn

from ..hub import resolve_model_path
from .config import QuantizationConfig, QuantMethod, read_quantization_config
from .formats import awq_to_kernel_layout, gptq_to_kernel_layout
from .linear import QuantLinear

_QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # stored by some old checkpoints, recomputed by the model


def load_model(
    path_or_id: str | os.PathLike, *, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load a causal LM checkpoint: GPTQ v1 / AWQ GEMM natively, anything else through transformers.

    Args:
        path_or_id: a local folder with ``config.json`` and ``*.safetensors`` (sharded or not), or a
            hub id (``hub.resolve_model_path``: from the local cache when offline, else downloaded).
        dtype: the activation / non-quantized-weight dtype (``torch.float16``, ``torch.bfloat16``,
            ``torch.float32`` or their names). None or ``"auto"``: the checkpoint's dtype, as
            ``from_pretrained(dtype="auto")`` reads it (``config.dtype`` / ``torch_dtype``; fp16 for a
            quantized checkpoint that declares none). An fp16-declared quantized checkpoint runs in
            bf16 as is: its fp16 scales are kept and converted to fp32 inside the kernel.
        device: where to put the model; default ``"cuda"`` if available, else ``"cpu"``.
        trust_remote_code: let transformers run the checkpoint's own modeling/config code (``auto_map``).

    Returns:
        The model in eval mode, with its ``generation_config`` from the folder. Quantized linears are
        ``QuantLinear`` (Triton W4A16 on CUDA in fp16/bf16, the PyTorch reference otherwise).

    Raises:
        NotImplementedError: an unsupported ``quant_method``, format, version or bit width (named).
        ValueError: a local folder that does not exist or a hub id that is not available
            (``hub.resolve_model_path``); a checkpoint tensor whose shape does not match the model (the
            tensor is named), a tensor with no place in the model, or a model tensor the checkpoint lacks.

    Examples:
        >>> model = load_model("../shared/fixtures/models/tiny-llama-gptq-4bit-g32-actorder-asym",
        ...                    dtype=torch.float32, device="cpu")  # doctest: +SKIP
        >>> type(model.model.layers[0].self_attn.q_proj).__name__  # doctest: +SKIP
        'QuantLinear'
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(dtype, str) and dtype == "auto":
        dtype = None  # as from_pretrained's "auto": the checkpoint's own dtype
    folder = resolve_model_path(path_or_id)
    with open(os.path.join(folder, "config.json")) as f:
        config_dict = json.load(f)
    qcfg = read_quantization_config(folder, config_dict)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if qcfg is None:
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=_to_dtype(dtype) if dtype is not None else "auto", trust_remote_code=trust_remote_code
        )
        return model.to(device).eval()

    dtype = _to_dtype(dtype if dtype is not None else config_dict.get("dtype") or config_dict.get("torch_dtype") or "float16")
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model = build_skeleton(config, dtype, trust_remote_code=trust_remote_code)
    with _Checkpoint(folder) as ckpt:
        quantized = sorted({n[: -len(".qweight")] for n in ckpt.names if n.endswith(".qweight")})
        for prefix in quantized:
            _load_quantized_layer(model, prefix, ckpt, qcfg, dtype, device)
        taken = {f"{p}.{s}" for p in quantized for s in _QUANT_SUFFIXES + ("bias",)}
        _load_plain_tensors(model, [n for n in ckpt.names if n not in taken], ckpt, dtype, device)
    finish_loading(model, device)
    _set_generation_config(model, folder)
    return model.eval()


# -- skeleton -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _parameters_on_meta():
    """Every ``nn.Parameter`` registered inside goes to the meta device; buffers stay real.

    The same trick as accelerate's ``init_empty_weights(include_buffers=False)``: parameters become
    meta at registration, so the initialisers that run afterwards cost nothing, while buffers computed
    in ``__init__`` (RoPE ``inv_freq``) keep their values.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_skeleton(config, dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` with all parameters on the meta device.

    The ``quantization_config`` is dropped from the model's config copy first, so transformers does
    not try to set up its own (gptqmodel-based) quantizer.
    """
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with _parameters_on_meta(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return model


def finish_loading(model: nn.Module, device: torch.device) -> None:
    """Tie the embeddings (if the config says so), move the real buffers to ``device``, and check
    that no parameter or buffer is left on the meta device.

    Raises:
        ValueError: tensors the checkpoint did not provide (named).
    """
    text_config = model.config.get_text_config()
    if getattr(text_config, "tie_word_embeddings", False) or getattr(model.config, "tie_word_embeddings", False):
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and inp is not None and out.weight.device.type == "meta":
            out.weight = inp.weight
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device and buf.device.type != "meta":
                module._buffers[name] = buf.to(device)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} model tensors, e.g. {missing[:5]}")


# -- tensors ------------------------------------------------------------------------------------------


class _Checkpoint:
    """Name -> shard map over ``model.safetensors`` or ``model.safetensors.index.json`` shards."""

    def __init__(self, folder: str):
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._file_of = {n: os.path.join(folder, s) for n, s in weight_map.items()}
        else:
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors") and not f.startswith("layer0_dequant"))
            if not files:
                raise ValueError(f"no .safetensors files in {folder}")
            self._file_of = {}
            for fname in files:
                with safe_open(os.path.join(folder, fname), framework="pt") as h:
                    self._file_of.update({n: os.path.join(folder, fname) for n in h.keys()})
        self.names = list(self._file_of)
        self._handles: dict[str, object] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def has(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._handles[path].get_tensor(name)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


def _load_quantized_layer(model, prefix: str, ckpt: _Checkpoint, qcfg: QuantizationConfig, dtype, device) -> None:
    """Convert ``<prefix>.qweight/...`` and put a ``QuantLinear`` at ``prefix`` in place of its ``nn.Linear``."""
    try:
        linear = model.get_submodule(prefix)
    except AttributeError:
        raise ValueError(f"checkpoint tensor {prefix + '.qweight'!r} has no matching module in {type(model).__name__}") from None
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"checkpoint tensor {prefix + '.qweight'!r} belongs to a {type(linear).__name__}, not an nn.Linear")
    K, N, bits = linear.in_features, linear.out_features, qcfg.bits
    pack = 32 // bits
    gs = K if qcfg.group_size == -1 else qcfg.group_size
    G = -(-K // gs)
    t = {s: ckpt.get(f"{prefix}.{s}").to(device) for s in ("qweight", "qzeros", "scales")}
    if qcfg.method is QuantMethod.GPTQ:
        shapes = {"qweight": (K // pack, N), "qzeros": (G, N // pack), "scales": (G, N)}
    else:
        shapes = {"qweight": (K, N // pack), "qzeros": (G, N // pack), "scales": (G, N)}
    for s, shape in shapes.items():
        _check_shape(f"{prefix}.{s}", t[s], shape)
    if qcfg.method is QuantMethod.GPTQ:
        g_idx = ckpt.get(f"{prefix}.g_idx").to(device) if ckpt.has(f"{prefix}.g_idx") else None
        if g_idx is not None:
            _check_shape(f"{prefix}.g_idx", g_idx, (K,))
        packed = gptq_to_kernel_layout(t["qweight"], t["qzeros"], t["scales"], g_idx, bits, qcfg.group_size)
    else:
        packed = awq_to_kernel_layout(t["qweight"], t["qzeros"], t["scales"], qcfg.group_size)
    has_bias = ckpt.has(f"{prefix}.bias")
    module = QuantLinear(
        K, N, bits, qcfg.group_size, bias=has_bias, act_order=packed.perm is not None,
        dtype=dtype, scales_dtype=packed.scales.dtype, device=device,
    )  # fmt: skip
    module.load_packed(packed, prefix)
    if has_bias:
        bias = ckpt.get(f"{prefix}.bias")
        _check_shape(f"{prefix}.bias", bias, (N,))
        module.bias.copy_(bias)
    model.set_submodule(prefix, module)


def _load_plain_tensors(model, names: list[str], ckpt: _Checkpoint, dtype, device) -> None:
    """Put each checkpoint tensor into the parameter/buffer of the same name (floats cast to ``dtype``)."""
    unexpected = []
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            module = None
        if module is None or (leaf not in module._parameters and leaf not in module._buffers):
            if not name.endswith(_IGNORED_SUFFIXES):
                unexpected.append(name)
            continue
        tensor = ckpt.get(name)
        current = module._parameters.get(leaf) if leaf in module._parameters else module._buffers.get(leaf)
        if current is not None:
            _check_shape(name, tensor, tuple(current.shape))
        tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[leaf] = tensor
    if unexpected:
        raise ValueError(f"{len(unexpected)} checkpoint tensors have no place in {type(model).__name__}, e.g. {unexpected[:5]}")


# -- small helpers ------------------------------------------------------------------------------------


def _to_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype or its name, got {dtype!r}")
    return value


def _set_generation_config(model, folder: str) -> None:
    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
