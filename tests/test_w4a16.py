"""The W4A16 Triton kernel against its PyTorch reference (``w4a16_matmul_ref``), under the Triton
interpreter on CPU (tiny shapes: the interpreter is slow) and at a real size on CUDA when present.

The reference dequantizes exactly in float32; with float32 activations the kernel must agree to
float32 rounding (1e-5 relative), with fp16 activations to fp16 rounding of the weight and the
output (2e-3 relative).
"""

import pytest
import torch

# NOTE: without CUDA, conftest.py sets TRITON_INTERPRET=1 before triton is imported. Never set it here: on
# a CUDA machine that would switch every kernel defined later in the session to the interpreter.
pytest.importorskip("triton")

from paged_transformers.kernels import w4a16 as k  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")


def random_layer(K, N, bits, group_size, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    G = K // group_size
    q = torch.randint(0, 1 << bits, (K, N), generator=g, dtype=torch.int32)
    scales = ((0.5 + torch.rand(G, N, generator=g)) * 0.01).half()
    zeros = torch.randint(0, (1 << bits) + 1, (G, N), generator=g).to(torch.int16)
    return q.to(device), k.pack_rows(q, bits).to(device), scales.to(device), zeros.to(device)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_pack_unpack_and_dequantize_formula():
    q, qweight, scales, zeros = random_layer(64, 24, 4, 16, device="cpu")
    assert torch.equal(k.unpack_rows(qweight, 4), q)
    # the docstring formula, element by element for a few entries
    w = k.dequantize_packed(qweight, scales, zeros, 4, 16)
    for i, n in [(0, 0), (17, 5), (63, 23), (40, 11)]:
        expected = (q[i, n] - zeros[i // 16, n]).float() * scales[i // 16, n].float()
        assert w[i, n] == expected
    q8, qweight8, *_ = random_layer(32, 8, 8, 32, device="cpu")
    assert torch.equal(k.unpack_rows(qweight8, 8), q8)


# (M, K, N, bits, group_size, config): K not a multiple of BLOCK_K, per-channel (group = K),
# several groups per tile, one group spanning tiles, 8-bit, split-K with bias, the FMA (GEMV) path.
CASES = [
    (3, 96, 40, 4, 32, k.W4A16Config(16, 32, 64, 1)),
    (3, 96, 40, 4, 96, k.W4A16Config(16, 32, 64, 2)),
    (5, 256, 48, 4, 128, k.W4A16Config(16, 16, 64, 3)),
    (1, 128, 64, 8, 64, k.W4A16Config(1, 32, 32, 2, use_dot=False)),
    (2, 160, 32, 4, 32, k.W4A16Config(2, 16, 64, 1, use_dot=False)),
]


@pytest.mark.parametrize("M,K,N,bits,group_size,config", CASES)
def test_kernel_matches_reference_fp32(M, K, N, bits, group_size, config):
    if HAS_CUDA:
        pytest.skip("float32 activations are an interpreter-only case (the CUDA kernel takes fp16/bf16)")
    _, qweight, scales, zeros = random_layer(K, N, bits, group_size)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2)) if config.split_k > 1 else None
    out = k.w4a16_matmul(x, qweight, scales, zeros, bits, group_size, bias=bias, config=config)
    ref = k.w4a16_matmul_ref(x, qweight, scales, zeros, bits, group_size, bias=bias)
    assert rel(out, ref) < 1e-5
    if config.split_k > 1:
        ws, locks = k._WORKSPACE._buffers[x.device]
        assert not ws.any() and not locks.any(), "split-K must leave its workspace zeroed"


def test_kernel_default_config_fp16():
    # default config (M = 4: tl.dot, split-K), fp16 activations and output
    _, qweight, scales, zeros = random_layer(256, 64, 4, 64)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, 64)
    assert out.dtype == torch.float16 and out.shape == (4, 64)
    assert rel(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 64)) < 2e-3


def test_kernel_rejects_bad_arguments():
    _, qweight, scales, zeros = random_layer(64, 16, 4, 32)
    x = torch.randn(2, 64).to(DEVICE).half()
    with pytest.raises(ValueError, match="qweight"):
        k.w4a16_matmul(x, qweight[:-1].contiguous(), scales, zeros, 4, 32)
    with pytest.raises(ValueError, match="group_size"):
        k.w4a16_matmul(x, qweight, scales, zeros, 4, 48)
    with pytest.raises(ValueError, match="zeros"):
        k.w4a16_matmul(x, qweight, scales, zeros.int(), 4, 32)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (real-size check)")
@pytest.mark.parametrize("M", [1, 4, 16, 256])
def test_kernel_real_size_cuda(M):
    _, qweight, scales, zeros = random_layer(4096, 4096, 4, 128)
    x = torch.randn(M, 4096, device=DEVICE, dtype=torch.bfloat16)
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, 128)
    assert rel(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 128)) < 1e-2
