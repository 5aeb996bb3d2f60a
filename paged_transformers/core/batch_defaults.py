"""The default step limits by device and usage context: vLLM's rule for ``max_num_seqs``, ``max_num_batched_tokens``
and the largest decode CUDA graph, applied to the ``EngineConfig`` fields left None.

vLLM's ``EngineArgs.get_batch_defaults`` and ``_set_default_max_num_seqs_and_batched_tokens_args``
(``vllm/engine/arg_utils.py``), and ``VllmConfig._set_cudagraph_sizes`` (``vllm/config/vllm.py``)::

    device                                    LLM class              OpenAI server
                                              tokens / seqs          tokens / seqs
    CUDA, >= 70 GiB and not an A100           16384 / 1024           8192 / 1024    (H100, H200, MI300x)
    CUDA otherwise (A100, 40 GiB, 24 GiB)      8192 /  256           2048 /  256
    CPU (kept from before; vLLM: 4096 / 256    8192 /  256           8192 /  256
         and 2048 / 128 per rank)

    then, for the defaulted fields only:
    max_num_batched_tokens = min(max_num_seqs * max_model_len, default)
                             (with chunked prefill off: max(max_model_len, default) first, so any prompt fits)
    max_num_seqs           = min(default, max_num_batched_tokens)
    max_cudagraph_capture_size = min(max_num_seqs * 2, 512), capped at max_num_batched_tokens

A value given explicitly is never changed, except that ``max_cudagraph_capture_size`` is capped at
``max_num_batched_tokens`` (as in vLLM) and at ``max_num_seqs``: the decode graphs here hold decode steps only, one
row per sequence.
"""

import dataclasses

import torch

from ..config import EngineConfig, UsageContext

GiB = 1 << 30
LARGE_GPU_MEMORY_BYTES = 70 * GiB  # vLLM's threshold of device memory for its larger step limits
MAX_CUDAGRAPH_CAPTURE_SIZE = 512  # vLLM's cap of the default largest graph

# (max_num_batched_tokens, max_num_seqs) per usage context
_LARGE_GPU = {UsageContext.LLM_CLASS: (16384, 1024), UsageContext.OPENAI_API_SERVER: (8192, 1024)}
_OTHER_GPU = {UsageContext.LLM_CLASS: (8192, 256), UsageContext.OPENAI_API_SERVER: (2048, 256)}
_CPU = {UsageContext.LLM_CLASS: (8192, 256), UsageContext.OPENAI_API_SERVER: (8192, 256)}


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceDescription:
    """What the rule reads of a device: its type (``"cuda"``, ``"cpu"``, ...), its name (``"NVIDIA H100 80GB
    HBM3"``; empty off CUDA) and its total memory in bytes (0 off CUDA)."""

    type: str
    name: str = ""
    total_memory: int = 0

    @classmethod
    def of(cls, device: torch.device) -> "DeviceDescription":
        """The description of ``device`` (on CUDA: ``torch.cuda.get_device_properties``)."""
        device = torch.device(device)
        if device.type != "cuda":
            return cls(device.type)
        props = torch.cuda.get_device_properties(device)
        return cls("cuda", props.name, props.total_memory)


def batch_defaults(device: DeviceDescription, usage_context: UsageContext) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` before the ``max_model_len`` caps (the table in the module
    docstring). A device other than CUDA and CPU gets the smaller GPU values, as vLLM does where it cannot read the
    device's memory."""
    if device.type == "cpu":
        return _CPU[usage_context]
    large = device.type == "cuda" and device.total_memory >= LARGE_GPU_MEMORY_BYTES and "a100" not in device.name.lower()
    return (_LARGE_GPU if large else _OTHER_GPU)[usage_context]


def default_max_cudagraph_capture_size(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """vLLM's default largest CUDA graph: ``min(max_num_seqs * 2, 512, max_num_batched_tokens)``."""
    return min(max_num_seqs * 2, MAX_CUDAGRAPH_CAPTURE_SIZE, max_num_batched_tokens)


def resolve_batch_limits(config: EngineConfig, device: DeviceDescription, max_model_len: int) -> EngineConfig:
    """A copy of ``config`` with ``max_num_seqs``, ``max_num_batched_tokens`` and ``max_cudagraph_capture_size``
    set: each one given keeps its value, each one None gets the rule's (module docstring), for ``device`` and
    ``config.usage_context``; ``max_cudagraph_capture_size`` is then capped at the other two. ``max_model_len`` is the
    engine's (the model's maximum where the config has None).

    Raises:
        ValueError: a bad field of ``config`` (``EngineConfig.validate``).
    """
    config = dataclasses.replace(config)  # validated, and the caller's object stays as given
    default_tokens, default_seqs = batch_defaults(device, config.usage_context)
    seqs = config.max_num_seqs if config.max_num_seqs is not None else default_seqs
    tokens = config.max_num_batched_tokens
    if tokens is None:
        if not config.enable_chunked_prefill:
            default_tokens = max(max_model_len, default_tokens)
        tokens = min(seqs * max_model_len, default_tokens)
    if config.max_num_seqs is None:
        seqs = min(seqs, tokens)
    capture = config.max_cudagraph_capture_size
    if capture is None:
        capture = default_max_cudagraph_capture_size(seqs, tokens)
    # a decode step has one row per sequence, so a graph larger than max_num_seqs would never run
    return dataclasses.replace(config, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                               max_cudagraph_capture_size=min(capture, tokens, seqs))
