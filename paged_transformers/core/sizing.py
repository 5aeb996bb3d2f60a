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


# NOTE: decode CUDA graphs keep a private memory pool (activations of the largest bucket's forward and every
# bucket's static logits), captured after the KV pool exists; this reserve, at least, keeps them from meeting OOM.
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
    the softmax: 3 x ``max_num_seqs x vocab_size x 4`` bytes) and, unless ``enforce_eager``, the decode graphs'
    pool (``graph_pool_bytes``). ``config`` is the engine's resolved one (``core.batch_defaults``).

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
    if config.enforce_eager:
        return peak + sampler
    itemsize = model_compute_dtype(model).itemsize
    return peak + sampler + graph_pool_bytes(config.max_cudagraph_capture_size, vocab_size, itemsize, peak, num_tokens)


def graph_pool_bytes(max_cudagraph_capture_size: int, vocab_size: int, logits_itemsize: int, step_peak_bytes: int,
                     num_tokens: int) -> int:
    """Bytes the decode graphs' private pool may reach, and at least ``CUDA_GRAPH_RESERVE_BYTES``.

    Each bucket's graph keeps its static logits ``[1, bucket, vocab_size]`` (the model's dtype, ``logits_itemsize``
    bytes each) for good; the activations of one capture are freed for the next, so the largest bucket's count. Those
    are estimated as its share of ``step_peak_bytes``, the profiled peak of a ``num_tokens``-token step (activations
    grow with the tokens: the paged attention keeps no score matrix). Llama-3-8B's vocabulary (128,256), bf16: 0.56
    GB of logits for the 20 buckets up to 256 rows, 2.17 GB for the 36 up to 512.
    """
    from ..compilation.cuda_graphs import graph_batch_sizes

    logits = sum(graph_batch_sizes(max_cudagraph_capture_size)) * vocab_size * logits_itemsize
    activations = step_peak_bytes * min(max_cudagraph_capture_size, num_tokens) // num_tokens
    return max(CUDA_GRAPH_RESERVE_BYTES, logits + activations)


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
