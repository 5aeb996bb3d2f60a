"""The roofline of ``paged-transformers bench``: analytic lower bound on a workload's time.

The roofline is analytic (``workload_roofline``): every request runs concurrently; prefill is bound
by the matmul rate; decode step ``k`` reads the weights once plus each active request's KV and is
bound by the copy bandwidth (or the matmul rate, whichever is slower). Both ceilings are measured
on the device first (``measure_device_peaks``), so the bound is what this device reaches, not its datasheet.
"""

import numpy as np
import torch

from .workload import BenchRequest


def measure_device_peaks(device) -> dict:
    """Device-to-device copy bandwidth (bytes read + written per second) and bf16 matmul rate (FLOP/s),
    medians of timed repeats on random data (CUDA events); None on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"copy_bytes_per_s": None, "matmul_flops_per_s": None}
    from triton.testing import do_bench

    n = 1 << 30  # bytes per buffer, far past the 60 MB L2
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm_ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * n / (copy_ms / 1e3), "matmul_flops_per_s": 2 * 8192**3 / (mm_ms / 1e3)}


def model_costs(model) -> dict:
    """Bytes of weights a step reads (all parameters but the input embedding table, of which a step
    reads only its rows; counted when tied to the LM head), KV bytes per token, FLOPs per token."""
    text = model.config.get_text_config()
    from ..core.sizing import model_kv_shape

    num_layers, num_kv_heads, head_dim = model_kv_shape(model.config)
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embed
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype in (torch.int32, torch.int8, torch.uint8))
    weight_bytes = total - (0 if tied else embed.numel() * embed.element_size())
    dense_params = sum(p.numel() for p in model.parameters()) - (0 if tied else embed.numel())
    elem = embed.element_size()
    return {
        "weight_bytes_per_step": int(weight_bytes),
        "kv_bytes_per_token": 2 * num_layers * num_kv_heads * head_dim * elem,
        "linear_flops_per_token": 2 * int(dense_params),
        # QK^T and PV: 2 x 2 FLOPs per (query token, key, head, dim) per layer
        "attention_flops_per_token_key": 4 * num_layers * text.num_attention_heads * head_dim,
    }


def workload_roofline(requests: list[BenchRequest], costs: dict, copy_bytes_per_s: float,
                      matmul_flops_per_s: float) -> dict:
    """Lower bound on the time of the workload on this device (every request at once; see module doc).

    Prefill of request i: ``(linear_flops * p_i + attn * p_i^2 / 2) / matmul_rate`` (it also produces the
    first output token). Decode step k = 1 .. max(o) - 1 over the requests with ``o_i > k``:
    ``max((weights + kv_bytes * sum(p_i + k)) / copy_bw, (linear_flops * n_k + attn * sum(p_i + k)) / matmul_rate)``.
    """
    p = np.array([len(r.prompt_token_ids) for r in requests], dtype=np.float64)
    o = np.array([r.output_len for r in requests], dtype=np.float64)
    lin, attn = costs["linear_flops_per_token"], costs["attention_flops_per_token_key"]
    prefill_s = float((lin * p + attn * p * p / 2).sum() / matmul_flops_per_s)
    decode_s = 0.0
    for k in range(1, int(o.max())):
        active = o > k
        ctx = float((p[active] + k).sum())
        n = int(active.sum())
        t_bytes = (costs["weight_bytes_per_step"] + costs["kv_bytes_per_token"] * ctx) / copy_bytes_per_s
        t_flops = (lin * n + attn * ctx) / matmul_flops_per_s
        decode_s += max(t_bytes, t_flops)
    total_s = prefill_s + decode_s
    return {"time_s": total_s, "prefill_s": prefill_s, "decode_s": decode_s,
            "output_tokens_per_s": float(o.sum() / total_s), "total_tokens_per_s": float((o.sum() + p.sum()) / total_s)}
