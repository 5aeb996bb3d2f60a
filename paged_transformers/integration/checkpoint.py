"""From vLLM's ``model=`` argument to a loaded model and tokenizer, with vLLM's rules: a local checkpoint folder
or a hub id (``hub.resolve_model_path``: the local cache first, ``HF_HUB_OFFLINE`` honoured), ``dtype="auto"``, and ``quantization``
checked against the checkpoint's own ``quantization_config``.

Each check here reads at most the checkpoint's small JSON files, so a bad argument is refused before any
weight is loaded.
"""

import json
import os

import torch

from ..hub import resolve_model_path
from ..quantization import load_model, read_quantization_config
from ..core.sizing import model_compute_dtype

QUANTIZATION_METHODS = ("gptq", "awq")  # the formats load_model reads natively (GPTQ v1, AWQ GEMM)

# vLLM's ModelDType names
DTYPE_NAMES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "float": torch.float32, "float32": torch.float32}  # fmt: skip

def parse_dtype(dtype) -> torch.dtype | None:
    """``"auto"`` -> None (decided per checkpoint by ``resolve_dtype``); a name of ``DTYPE_NAMES`` or a torch
    float16/bfloat16/float32 dtype -> that dtype.

    Raises:
        ValueError: any other value, naming it and the allowed ones.
    """
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    if dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES.values():
        return dtype
    raise ValueError(f"dtype must be 'auto', one of {sorted(DTYPE_NAMES)} or a torch float dtype, got {dtype!r}")


def check_quantization(quantization) -> None:
    """Raises ValueError unless ``quantization`` is None (read from the checkpoint) or a name in
    ``QUANTIZATION_METHODS``."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be None (read from the checkpoint's config) or one of {list(QUANTIZATION_METHODS)}, "
            f"got {quantization!r}"
        )


def read_config(folder: str) -> dict:
    """The checkpoint's ``config.json`` as a dict.

    Raises:
        ValueError: no ``config.json`` in ``folder``, or one that is not JSON.
    """
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model {folder}: no readable config.json, so not a transformers checkpoint ({e})") from e


def check_checkpoint(folder: str, config_dict: dict, quantization: str | None, max_model_len: int | None) -> None:
    """Check the arguments against the checkpoint's config, before any weight is read.

    Raises:
        ValueError: ``quantization`` given and not the checkpoint's method (naming both); ``max_model_len`` over the
            config's ``max_position_embeddings``.
        NotImplementedError: a quantization format ``load_model`` does not read (named).
    """
    qcfg = read_quantization_config(folder, config_dict)
    found = qcfg.method.value if qcfg is not None else None
    if quantization is not None and quantization != found:
        what = f"quantized with {found!r}" if found else "not quantized (no quantization_config)"
        raise ValueError(
            f"quantization={quantization!r}, but the checkpoint {folder} is {what}; leave quantization=None to use "
            "the checkpoint's own"
        )
    text_config = config_dict.get("text_config") or config_dict
    max_positions = text_config.get("max_position_embeddings")
    if max_model_len is not None and max_positions is not None and max_model_len > max_positions:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_positions}")


def resolve_dtype(dtype: torch.dtype | None, config_dict: dict, device: torch.device) -> torch.dtype:
    """The dtype to load in: ``dtype`` when given; for ``"auto"`` (None) vLLM's rule on CUDA — the config's dtype,
    with float32 (and a missing one) cast down to bfloat16 (float16 on devices without bfloat16) — and float32 on
    CPU, where half-precision matmuls are slower than float32 (vLLM's CPU backend picks bfloat16 here)."""
    if dtype is not None:
        return dtype
    if device.type != "cuda":
        return torch.float32
    half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    declared = DTYPE_NAMES.get(str(config_dict.get("dtype") or config_dict.get("torch_dtype")))
    if declared in (None, torch.float32) or (declared is torch.bfloat16 and half is torch.float16):
        return half
    return declared


def load_tokenizer(source, trust_remote_code: bool = False):
    """``AutoTokenizer.from_pretrained(source)``.

    Raises:
        ValueError: no usable tokenizer there (the loader's message on one line).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {source}: no usable tokenizer in it ({' '.join(str(e).split())})") from e


def load_checkpoint(folder: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False) -> torch.nn.Module:
    """``load_model`` (GPTQ/AWQ natively, plain checkpoints through transformers), in eval mode.

    Raises:
        ValueError: weights that cannot be read (named by ``load_model``, or the loader's OSError on one line).
    """
    try:
        return load_model(folder, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise ValueError(f"model {folder}: cannot load its weights ({' '.join(str(e).split())})") from e


def load_from_checkpoint(model, tokenizer, skip_tokenizer_init: bool, trust_remote_code: bool, dtype: torch.dtype | None,
                         quantization: str | None, max_model_len: int | None, device: torch.device):
    """``(model, tokenizer)`` from a folder or cached hub id; the config is checked before the tokenizer and the
    tokenizer loaded before the weights, so that a mistake costs no weight loading."""
    folder = resolve_model_path(model)
    config_dict = read_config(folder)
    check_checkpoint(folder, config_dict, quantization, max_model_len)
    dtype = resolve_dtype(dtype, config_dict, device)
    tokenizer = tokenizer_for(tokenizer, folder, skip_tokenizer_init, trust_remote_code)
    return load_checkpoint(folder, dtype, device, trust_remote_code), tokenizer


def check_loaded_model(model: torch.nn.Module, dtype: torch.dtype | None, quantization, device) -> torch.nn.Module:
    """A loaded model is used as it is: asking for another dtype or device, or for a quantization, is refused."""
    own_dtype, param = model_compute_dtype(model), next(model.parameters())
    if dtype is not None and own_dtype != dtype:
        raise ValueError(f"dtype={dtype} but the given model is {own_dtype}; convert it first (model.to(dtype))")
    if device is not None and param.device.type != device.type:
        raise ValueError(f"device={device} but the given model is on {param.device}; move it first (model.to(device))")
    if quantization is not None:
        raise ValueError(f"quantization={quantization!r} applies to checkpoints; the given model is already loaded")
    return model


def tokenizer_for(tokenizer, source: str | None, skip_tokenizer_init: bool, trust_remote_code: bool):
    """The tokenizer object: ``tokenizer`` itself, loaded from it when a name, else from the model's folder."""
    if skip_tokenizer_init:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(tokenizer, trust_remote_code)
    if tokenizer is None and source is not None:
        return load_tokenizer(source, trust_remote_code)
    return tokenizer
