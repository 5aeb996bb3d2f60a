"""The tiled W4A16 GEMM (``kernels/w4a16_tiled.py``) against the PyTorch reference ``w4a16_matmul_ref``, under
the Triton interpreter on CPU (tiny shapes) and at a real size on CUDA when present.

fp32 activations (interpreter only) must agree to fp32 rounding of the sum (1e-5 relative): the kernel's
dequantized weight is exact, as the reference's. fp16 activations: 2e-3 (fp16 rounding of weight and output).
"""

import pytest
import torch

# NOTE: without CUDA, conftest.py sets TRITON_INTERPRET=1 before triton is imported (never set it here).
pytest.importorskip("triton")

from paged_transformers.kernels import w4a16 as k
from paged_transformers.kernels import w4a16_tiled as t

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
C = t.TiledConfig


def random_layer(K, N, bits, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    G = K // group_size
    q = torch.randint(0, 1 << bits, (K, N), generator=g, dtype=torch.int32)
    scales = ((0.5 + torch.rand(G, N, generator=g)) * 0.01).half()
    zeros = torch.randint(0, (1 << bits) + 1, (G, N), generator=g).to(torch.int16)
    return q, k.pack_rows(q, bits).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# (M, K, N, bits, group_size, config): every unpack variant and operand order; K not a multiple of BLOCK_K
# (per-channel, group = K), several groups per tile (group 32 < BLOCK_K), 8-bit, split-K, M and N not multiples
# of the tile, several M-tiles in a partial grouped-order group (M = 40 with BLOCK_M 16, GROUP_M 2)
CASES = [
    (40, 96, 48, 4, 32, C(16, 16, 64, group_m=2, unpack=2)),  # 3 M-tiles, 2 groups per tile, N % BLOCK_N == 0
    (20, 136, 40, 4, 136, C(16, 32, 32, group_m=2, split_k=2, swap=True, unpack=2)),  # per-channel, K % 32 = 8
    (17, 128, 32, 8, 64, C(16, 16, 64, split_k=2, unpack=1)),  # 8-bit
    (33, 128, 24, 4, 128, C(32, 16, 64, swap=True, unpack=0)),  # GemLite rows, swap, N % BLOCK_N != 0
]


@pytest.mark.parametrize("M,K,N,bits,group_size,config", CASES, ids=[str(c[-1]) for c in CASES])
def test_tiled_matches_reference_fp32(M, K, N, bits, group_size, config):
    if HAS_CUDA:
        pytest.skip("float32 activations are an interpreter-only case (the CUDA kernel takes fp16/bf16)")
    _, qweight, scales, zeros = random_layer(K, N, bits, group_size)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2))
    out = t.w4a16_tiled_matmul(x, qweight, scales, zeros, bits, group_size, bias=bias, config=config)
    ref = k.w4a16_matmul_ref(x, qweight, scales, zeros, bits, group_size, bias=bias)
    assert rel(out, ref) < 1e-5
    if config.split_k > 1:
        ws, locks = k._WORKSPACE._buffers[x.device]
        assert not ws.any() and not locks.any(), "split-K must leave its workspace zeroed"


def test_tiled_dequantizes_exactly():
    # x = I: the output is the dequantized weight itself, every 4-bit value in every field position, GPTQ v1's
    # largest zero point (16); the unit scale makes any error in the unpack or the magic numbers an integer off
    q = torch.arange(16, dtype=torch.int32).repeat(8, 1).t().reshape(128, 1).repeat(1, 16).roll(1, 0).contiguous()
    qweight = k.pack_rows(q, 4).to(DEVICE)
    scales = torch.ones(1, 16, dtype=torch.float16, device=DEVICE)
    zeros = torch.full((1, 16), 16, dtype=torch.int16, device=DEVICE)
    eye = torch.eye(128, device=DEVICE, dtype=torch.float16 if HAS_CUDA else torch.float32)
    for cfg in (C(64, 16, 64, unpack=2), C(64, 16, 64, swap=True, unpack=1)):
        out = t.w4a16_tiled_matmul(eye, qweight, scales, zeros, 4, 128, config=cfg)
        assert torch.equal(out.float().cpu(), (q - 16).float()), cfg


def test_tiled_default_config_fp16():
    _, qweight, scales, zeros = random_layer(128, 32, 4, 64)
    x = torch.randn(24, 128, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    out = t.w4a16_tiled_matmul(x, qweight, scales, zeros, 4, 64, config=None if HAS_CUDA else C(16, 16, 64, unpack=2))
    assert out.dtype == torch.float16 and out.shape == (24, 32)
    assert rel(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 64)) < 2e-3


def test_tiled_rejects_bad_arguments():
    _, qweight, scales, zeros = random_layer(64, 16, 4, 32)
    x = torch.randn(20, 64).to(DEVICE).half()
    with pytest.raises(ValueError, match="qweight"):
        t.w4a16_tiled_matmul(x, qweight[:-1].contiguous(), scales, zeros, 4, 32)
    with pytest.raises(ValueError, match="group_size"):
        t.w4a16_tiled_matmul(x, qweight, scales, zeros, 4, 48)
    with pytest.raises(ValueError, match="scales"):
        t.w4a16_tiled_matmul(x, qweight, scales[:1].contiguous(), zeros, 4, 32)
    with pytest.raises(ValueError, match="block_k"):
        t.w4a16_tiled_matmul(x, qweight, scales, zeros, 4, 32, config=C(16, 16, 36))
    with pytest.raises(ValueError, match="unpack"):
        C(16, 16, 64, unpack=3)
    with pytest.raises(ValueError, match="positive"):
        C(16, 16, 64, split_k=0)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (real-size check)")
@pytest.mark.parametrize("M", [17, 256, 1000])
def test_tiled_real_size_cuda(M):
    _, qweight, scales, zeros = random_layer(4096, 4096, 4, 128)
    x = torch.randn(M, 4096, device=DEVICE, dtype=torch.bfloat16)
    out = t.w4a16_tiled_matmul(x, qweight, scales, zeros, 4, 128)
    assert rel(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 128)) < 1e-2


def test_w4a16_matmul_dispatches_tiled():
    # W4A16Algo.TILED in kernels/w4a16.py's launcher runs this kernel (join unpack, the config's tile and split)
    _, qweight, scales, zeros = random_layer(128, 32, 4, 32)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    x = x.half() if HAS_CUDA else x
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, 32, config=k.W4A16Config(16, 16, 64, 2, algo="tiled"))
    assert rel(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 32)) < (2e-3 if HAS_CUDA else 1e-5)
