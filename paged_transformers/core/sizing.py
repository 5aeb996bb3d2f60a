"""How many KV blocks the pool gets: from an explicit count, a byte budget, or the free GPU memory."""

import torch

from ..config import EngineConfig


def model_kv_shape(config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers model config."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    return text_config.num_hidden_layers, num_kv_heads, head_dim


# NOTE: decode CUDA graphs keep a private memory pool (activations of a max_num_seqs-token forward and
# the static logits), captured after the KV pool exists; this reserve keeps them from meeting OOM.
CUDA_GRAPH_RESERVE_BYTES = 1 << 30


def model_compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The activation (and KV cache) dtype: the model's ``dtype`` unless that is an integer (quantized) type,
    else its first floating-point parameter's."""
    dtype = getattr(model, "dtype", None)
    if dtype is None or not dtype.is_floating_point:
        dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
    return dtype


def profile_activation_bytes(model: torch.nn.Module, config: EngineConfig) -> int:
    """Peak bytes one step adds on CUDA, from a profiled forward of ``max_num_batched_tokens`` tokens.

    The forward is one dummy sequence through the model's own attention (the paged attention needs no
    extra memory beyond its inputs and output), with logits for ``max_num_seqs`` rows. On top of the
    measured peak: the sampler's float32 copies of those logits (the runner's ``float()``, the clone and
    the softmax: 3 x ``max_num_seqs x vocab_size x 4`` bytes) and, unless ``enforce_eager``,
    ``CUDA_GRAPH_RESERVE_BYTES`` for the decode graphs.

    Returns:
        Bytes (int).
    """
    device = next(model.parameters()).device
    num_tokens = config.max_num_batched_tokens
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        ids = torch.zeros((1, num_tokens), dtype=torch.int64, device=device)
        model(input_ids=ids, use_cache=False, logits_to_keep=min(config.max_num_seqs, num_tokens))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    vocab_size = model.config.get_text_config().vocab_size
    sampler = 3 * min(config.max_num_seqs, num_tokens) * vocab_size * 4
    graphs = 0 if config.enforce_eager else CUDA_GRAPH_RESERVE_BYTES
    return peak + sampler + graphs


def num_kv_blocks(model: torch.nn.Module, config: EngineConfig, max_model_len: int, bytes_per_block: int) -> int:
    """Pool size in blocks.

    ``num_gpu_blocks`` wins; then ``kv_cache_memory_bytes``; on CUDA,
    ``gpu_memory_utilization * total - (memory in use) - (profiled activation peak)``; on CPU the
    1 GiB default, capped at ``max_num_seqs`` sequences of ``max_model_len`` tokens.
    """
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes // bytes_per_block
    device = next(model.parameters()).device
    if device.type == "cuda":
        activation = profile_activation_bytes(model, config)
        free, total = torch.cuda.mem_get_info(device)
        budget = int(config.gpu_memory_utilization * total) - (total - free) - activation
        return max(budget, 0) // bytes_per_block
    cap = config.max_num_seqs * -(-max_model_len // config.block_size)
    return min(EngineConfig.CPU_DEFAULT_KV_BYTES // bytes_per_block, cap)
