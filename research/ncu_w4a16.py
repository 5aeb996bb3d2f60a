"""One launch of each W4A16 default kernel (and of the bf16 matmul of the same shape) between
cudaProfilerStart/Stop, for Nsight Compute. Usage on the GPU machine (docs/benchmark-history.md, issue 7 rounds 3
and 7)::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
        --section SourceCounters python3 research/ncu_w4a16.py > $OUT/ncu_w4a16.txt

Shapes: the Llama-3-8B layers (K x N = 4096x4096, 4096x14336, 14336x4096), group 128, bf16, M = 1 and 16.
"""
import torch
from paged_transformers.kernels import w4a16 as k

dev = torch.device("cuda")
torch.manual_seed(0)
cases = []
for (K, N) in [(4096, 4096), (4096, 14336), (14336, 4096)]:
    G = K // 128
    qw = torch.randint(-(2**31), 2**31, (K // 8, N), dtype=torch.int32, device=dev)
    sc = ((0.5 + torch.rand(G, N, device=dev)) * 0.005).half()
    z = torch.randint(0, 17, (G, N), device=dev).to(torch.int16)
    w = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
    for M in (1, 16):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        cases.append((f"w4 K={K} N={N} M={M}", lambda x=x, qw=qw, sc=sc, z=z: k.w4a16_matmul(x, qw, sc, z, 4, 128)))
        if M == 1:
            cases.append((f"bf16 K={K} N={N} M={M}", lambda x=x, w=w: x @ w))
for name, fn in cases:
    for _ in range(3):
        fn()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for name, fn in cases:
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("cases:", [c[0] for c in cases])
