"""``AutoModelForCausalLM.from_pretrained`` for GPTQ / AWQ checkpoints without a quantization library.

While ``paged_transformers.patch()`` is active, ``AutoModelForCausalLM.from_pretrained(folder, ...)`` on a
local folder whose config declares ``quant_method`` ``gptq`` or ``awq`` (or that has AutoGPTQ's
``quantize_config.json``) loads through ``paged_transformers.load_model``: our own format readers and
W4A16 kernels, no gptqmodel / AutoAWQ. Every other call is stock ``from_pretrained``.
"""

import json
import logging
import os

import torch
from transformers import AutoModelForCausalLM

logger = logging.getLogger("paged_transformers")

_NATIVE_METHODS = ("gptq", "awq")
_ORIGINAL: list = []  # while patched: [stock bound from_pretrained, the class's own __dict__ entry or None]


def _native_quantized_folder(path) -> bool:
    """A local checkpoint folder that ``load_model`` reads natively (GPTQ / AWQ)."""
    try:
        folder = os.fspath(path)
    except TypeError:
        return False
    if not os.path.isdir(folder) or not os.path.isfile(os.path.join(folder, "config.json")):
        return False
    with open(os.path.join(folder, "config.json")) as f:
        qcfg = json.load(f).get("quantization_config")
    if qcfg is None:
        return os.path.isfile(os.path.join(folder, "quantize_config.json"))
    return str(qcfg.get("quant_method", "")).lower() in _NATIVE_METHODS


def _from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs):
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    device = kwargs.pop("device_map", None)
    if model_args or kwargs or not _native_quantized_folder(pretrained_model_name_or_path):
        if dtype is not None:
            kwargs["dtype"] = dtype
        if device is not None:
            kwargs["device_map"] = device
        return _ORIGINAL[0](pretrained_model_name_or_path, *model_args, **kwargs)
    from ..quantization import load_model

    if isinstance(device, (str, torch.device)) and str(device) != "auto":
        target = device
    else:
        target = None  # load_model's default: CUDA when available
    return load_model(pretrained_model_name_or_path, dtype=None if dtype == "auto" else dtype, device=target)


def patch_from_pretrained() -> None:
    """Install the GPTQ / AWQ route on ``AutoModelForCausalLM.from_pretrained`` (idempotent)."""
    if not _ORIGINAL:
        _ORIGINAL.extend([AutoModelForCausalLM.from_pretrained, AutoModelForCausalLM.__dict__.get("from_pretrained")])
        AutoModelForCausalLM.from_pretrained = staticmethod(_from_pretrained)


def unpatch_from_pretrained() -> None:
    """Restore stock ``AutoModelForCausalLM.from_pretrained`` (a no-op when not patched)."""
    if _ORIGINAL:
        own = _ORIGINAL[1]
        if own is None:
            del AutoModelForCausalLM.from_pretrained  # the inherited classmethod shows again
        else:
            AutoModelForCausalLM.from_pretrained = own
        _ORIGINAL.clear()
