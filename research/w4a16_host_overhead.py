"""Host time of one ``w4a16_matmul`` launch against one cuBLAS matmul, and where it goes (GPU).

Why: capturing a decode bucket's CUDA graph (three dummy forwards, host-bound) took 130-240 ms for the GPTQ
Llama-3-8B shape against 70-135 ms for bf16 on an H100 (research/step_trace.py), and every eager step pays the
same launches. This times ``--calls`` back-to-back calls of a ``QuantLinear`` (o_proj's shape), of the custom op
``torch.ops.paged_transformers.w4a16_matmul`` on its buffers (what ``QuantLinear`` calls under ``torch.compile``)
and of an ``nn.Linear`` of the same shape, host wall time per call with the queue kept non-empty, then profiles the
W4A16 calls with cProfile and prints the functions with the most own time.

Usage (GPU, ~20 s): ``python research/w4a16_host_overhead.py --out $OUT/host_overhead.json``
"""

import argparse
import cProfile
import io
import json
import pstats
import time

import torch


def per_call_us(fn, calls: int) -> float:
    """Host microseconds per call of ``calls`` back-to-back calls (after a warm-up), synchronized at the end."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16, 128, 256])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from transformers import LlamaConfig

    from paged_transformers.kernels.w4a16 import default_config, w4a16_matmul_op
    from paged_transformers.quantization import build_random_quantized_model

    K = N = 4096  # o_proj of the Llama-3-8B shape, the QuantLinear the model calls
    config = LlamaConfig(vocab_size=256, hidden_size=K, intermediate_size=14336, num_hidden_layers=1,
                         num_attention_heads=32, num_key_value_heads=8)
    layer = build_random_quantized_model(config, "gptq", 4, 128, torch.bfloat16, "cuda").model.layers[0].self_attn.o_proj
    dense = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16, device="cuda")
    rows, report = [], {"K": K, "N": N, "calls": a.calls, "device": torch.cuda.get_device_name()}
    with torch.inference_mode():
        for M in a.ms:
            x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
            cfg = default_config(M, N, K, 128, x.device, 4, x.dtype, True)
            args = (x, layer.qweight, layer.scales, layer.zeros, 4, 128, None)
            q = per_call_us(lambda: layer(x), a.calls)
            op = per_call_us(lambda: w4a16_matmul_op(*args), a.calls)
            b = per_call_us(lambda: dense(x), a.calls)
            rows.append({"M": M, "algo": cfg.algo.value, "quantlinear_host_us": q, "custom_op_host_us": op,
                         "linear_host_us": b})
            print(f"M={M:4d} {cfg.algo.value:15s} QuantLinear {q:7.1f} us/call host, its custom op {op:7.1f}, "
                  f"nn.Linear {b:6.1f}", flush=True)
        report["rows"] = rows
        x = torch.randn(128, K, dtype=torch.bfloat16, device="cuda")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            layer(x)
        prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).strip_dirs().sort_stats("tottime").print_stats(25)
    report["cprofile_m128_tottime"] = s.getvalue()
    print(s.getvalue()[:6000])
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
