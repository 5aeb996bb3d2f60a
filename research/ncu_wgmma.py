"""One launch of the Gluon W4A16 kernel (``W4A16Algo.WGMMA``, ``kernels/w4a16/wgmma_kernels.py``) per case, and of
the bf16 matmul of the same shape, between cudaProfilerStart/Stop, for Nsight Compute: where its K steps wait. ``bash research/gpu_ncu_wgmma.sh``
runs it under ``ncu`` on the GPU machine and writes the report's details and per-instruction source pages.

Cases: the o shape (4096x4096), the gate|up shape (4096x28672) and the down shape (14336x4096) at M = 256, and gate|up
at M = 128, each with the config ``default_config`` picks.
"""
import torch

from paged_transformers.kernels.w4a16 import default_config, w4a16_matmul

dev = torch.device("cuda")
torch.manual_seed(0)
CASES = [(4096, 4096, 256), (4096, 28672, 256), (14336, 4096, 256), (4096, 28672, 128)]  # (K, N, M)
calls = []
for K, N, M in CASES:
    G = K // 128
    qw = torch.randint(-(2**31), 2**31, (K // 8, N), dtype=torch.int32, device=dev)
    sc = ((0.5 + torch.rand(G, N, device=dev)) * 0.005).half()
    z = torch.randint(0, 16, (G, N), device=dev).to(torch.int16)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
    cfg = default_config(M, N, K, 128, dev)
    calls.append((f"w4a16 K={K} N={N} M={M} {cfg}", lambda x=x, qw=qw, sc=sc, z=z, c=cfg: w4a16_matmul(x, qw, sc, z, 4, 128, config=c)))
    calls.append((f"bf16 K={K} N={N} M={M}", lambda x=x, w=w: x @ w))
for _, fn in calls:
    for _ in range(3):
        fn()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for name, fn in calls:
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("cases:", [c[0] for c in calls])
