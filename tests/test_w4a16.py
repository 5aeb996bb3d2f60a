"""The W4A16 Triton kernels against their PyTorch reference (``w4a16_matmul_ref``), under the Triton
interpreter on CPU (tiny shapes: the interpreter is slow) and at a real size on CUDA when present: every kernel
a tuning table or the fallback rule can pick, with its configs (``test_every_table_config_matches_reference``) and off
them.

The reference dequantizes exactly in float32; with float32 activations the kernel must agree to
float32 rounding (1e-5 relative), with fp16 activations to fp16 rounding of the weight and the
output (2e-3 relative).
"""

import dataclasses
from pathlib import Path

import pytest
import torch

# NOTE: without CUDA, conftest.py sets TRITON_INTERPRET=1 before triton is imported. Never set it here: on
# a CUDA machine that would switch every kernel defined later in the session to the interpreter.
pytest.importorskip("triton")

from paged_transformers.kernels import w4a16 as k  # noqa: E402
from paged_transformers.kernels.w4a16 import dispatch, matmul  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
# the interpreter runs fp32 x (its tl.dot on bf16 operands is wrong: ~1e11 relative error at M = 2-16, found in the
# eighth session's new-user trial; the same kernels match the reference in bf16 on the H200); CUDA fp16/bf16
DTYPE_X = torch.bfloat16 if HAS_CUDA else torch.float32


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


A = k.W4A16Algo
# (M, K, N, bits, group_size, config), one case per algo and group layout: K not a multiple of BLOCK_K,
# per-channel (group = K), several groups per tile, one group spanning tiles, 8-bit, split-K with bias.
CASES = [
    # GEMV: a whole group per step + split-K + bias, per-channel K % BLOCK_K != 0, 8 K steps over 3 splits (3, 3, 2),
    # groups smaller than the tile, 8-bit
    (1, 256, 48, 4, 128, k.W4A16Config(1, 16, 128, 2, algo=A.GEMV)),
    (1, 264, 40, 4, 264, k.W4A16Config(1, 32, 64, 2, algo=A.GEMV)),
    (1, 512, 32, 4, 64, k.W4A16Config(1, 32, 64, 3, algo=A.GEMV)),
    (1, 96, 40, 4, 32, k.W4A16Config(1, 32, 64, 1, algo=A.GEMV)),
    (1, 128, 64, 8, 64, k.W4A16Config(1, 32, 64, 2, algo=A.GEMV)),
    (5, 256, 48, 4, 128, k.W4A16Config(16, 16, 128, 2, algo=A.DOT)),
    (3, 96, 40, 4, 96, k.W4A16Config(16, 32, 64, 2, algo=A.DOT)),  # per-channel spanning tiles
    (5, 256, 48, 4, 32, k.W4A16Config(16, 16, 128, 1, algo=A.DOT_SWAP)),
    (2, 128, 64, 8, 64, k.W4A16Config(16, 32, 64, 2, algo=A.DOT_SWAP)),
    (3, 264, 40, 4, 264, k.W4A16Config(16, 32, 64, 1, algo=A.DEQUANT_MATMUL)),
]


@pytest.mark.parametrize("M,K,N,bits,group_size,config", CASES)
def test_kernel_matches_reference_fp32(M, K, N, bits, group_size, config):
    if HAS_CUDA:
        pytest.skip("float32 activations are an interpreter-only case (the CUDA kernel takes fp16/bf16)")
    _, qweight, scales, zeros = random_layer(K, N, bits, group_size)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2)) if config.split_k > 1 or config.algo == A.DEQUANT_MATMUL else None
    out = k.w4a16_matmul(x, qweight, scales, zeros, bits, group_size, bias=bias, config=config)
    ref = k.w4a16_matmul_ref(x, qweight, scales, zeros, bits, group_size, bias=bias)
    assert rel(out, ref) < 1e-5
    if config.split_k > 1:
        ws, locks = matmul._WORKSPACE._buffers[x.device]
        assert not ws.any() and not locks.any(), "split-K must leave its workspace zeroed"


def test_kernel_default_config_fp16():
    # default config (M = 4: tl.dot, split-K), fp16 activations and output
    _, qweight, scales, zeros = random_layer(256, 64, 4, 64)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, 64)
    assert out.dtype == torch.float16 and out.shape == (4, 64)
    assert rel(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 64)) < 2e-3


# (dtype, bits, K, group_size, BLOCK_K, split_k, bias): bf16 (read as int32 pairs, a code path of its own) and fp16,
# groups of 8, 32, 64, 128 and per-channel, one group per step and several, K % BLOCK_K != 0 (the last pair masked),
# split-K, bias, 8-bit
HALF_GEMV_CASES = [
    (torch.bfloat16, 4, 200, 8, 64, 2, False),
    (torch.float16, 4, 200, 8, 64, 2, False),
    (torch.bfloat16, 4, 256, 128, 128, 2, True),
    (torch.float16, 4, 192, 64, 128, 1, False),
    (torch.bfloat16, 4, 160, 32, 64, 3, False),
    (torch.float16, 4, 264, 264, 64, 2, True),
    (torch.bfloat16, 8, 128, 64, 64, 2, True),
    (torch.float16, 8, 136, 136, 64, 1, False),
]


@pytest.mark.parametrize("dtype,bits,K,group_size,block_k,split_k,bias", HALF_GEMV_CASES)
def test_gemv_half_activations(dtype, bits, K, group_size, block_k, split_k, bias):
    # the bias B_J of each field and the zero point are removed once per group and column (gemv_kernels._gemv_step);
    # its error bound (docstring) is far below the half-precision output rounding checked here
    N = 40
    _, qweight, scales, zeros = random_layer(K, N, bits, group_size, seed=7)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE) if bias else None
    cfg = k.W4A16Config(1, 32, block_k, split_k, algo=A.GEMV)
    out = k.w4a16_matmul(x, qweight, scales, zeros, bits, group_size, bias=b, config=cfg)
    ref = k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, bits, group_size, bias=b)
    assert out.dtype == dtype and out.shape == (1, N)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # output rounding: 2**-9 (bf16), 2**-12 (fp16) relative
    assert rel(out, ref) < tol
    # the check can fail: a zero point off by one (4-bit; 16 for 8-bit: one step of the high nibble), what a wrong
    # bias B_J looks like, is far outside the tolerance
    off = 1 << (bits - 4)
    assert rel(k.w4a16_matmul_ref(x.float(), qweight, scales, zeros + off, bits, group_size, bias=b), ref) > 5 * tol


@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_fields_exact(bits):
    # every value in every field position, x_k = 1 + k % 7 (integers): every partial sum of P = sum x (B + q) stays an
    # integer below 2**24, so P, C = sum x B and X = sum x are exact and the output must equal the integer
    # sum_k x_k (q_k - z) exactly; a misplaced field, a wrong B_J or a wrong zero term changes it
    if HAS_CUDA:
        pytest.skip("float32 activations are an interpreter-only case (the CUDA kernel takes fp16/bf16)")
    K, N = 128, 1 << bits
    q = (torch.arange(K).view(K, 1) + torch.arange(N).view(1, N)) % N  # column n: value (k + n) % N at row k
    q = q.to(torch.int32)
    scales = torch.ones(1, N, dtype=torch.float16)
    for z in (0, N):
        zeros = torch.full((1, N), z, dtype=torch.int16)
        x = (1 + torch.arange(K) % 7).float().view(1, K)
        out = k.w4a16_matmul(x, k.pack_rows(q, bits), scales, zeros, bits, K,
                             config=k.W4A16Config(1, N if bits == 4 else 64, 128, 1, algo=A.GEMV))
        expected = (x.double() @ (q - z).double()).float()
        assert torch.equal(out, expected), (out - expected).abs().max()


def test_magic_number_fields_exact():
    # the per-field unpack takes fields 0..4 (4-bit) in place and 5..7 from p >>> 16; every 4-bit value in
    # every field position must dequantize exactly (fp32 activations: 1e-5 above is fp32 rounding of the sum)
    q = torch.arange(16, dtype=torch.int32).repeat(8, 1).t().reshape(16 * 8, 1).repeat(1, 16)  # [128, 16]
    q = q.roll(1, 0).contiguous()
    qweight = k.pack_rows(q, 4).to(DEVICE)
    scales = torch.ones(1, 16, dtype=torch.float16, device=DEVICE)
    zeros = torch.full((1, 16), 16, dtype=torch.int16, device=DEVICE)  # GPTQ v1's largest zero (15 + 1)
    eye = torch.eye(128, device=DEVICE, dtype=torch.float16 if HAS_CUDA else torch.float32)
    cfg = k.W4A16Config(16, 16, 128, 1, algo=A.DOT) if HAS_CUDA else k.W4A16Config(128, 16, 128, 1, algo=A.DOT)
    out = k.w4a16_matmul(eye, qweight, scales, zeros, 4, 128, config=cfg)  # = the dequantized weight
    assert torch.equal(out.float().cpu(), (q - 16).float())


def test_config_validation():
    assert k.W4A16Config(1, 16, 64, algo="gemv").algo is A.GEMV
    with pytest.raises(ValueError, match="algo"):
        k.W4A16Config(1, 16, 64, algo="cutlass")
    with pytest.raises(ValueError, match="positive"):
        k.W4A16Config(1, 16, 64, split_k=0)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        k.W4A16Config(16, 48, 64)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        k.W4A16Config(16, 16, 64, num_warps=3)
    for bad in (True, 48.5):
        with pytest.raises(ValueError, match="block_n must be a positive int"):
            k.W4A16Config(1, bad, 64)
    assert k.split_k_for(num_tiles=32, k_iters=32, num_sms=132) == 17
    assert k.split_k_for(num_tiles=1000, k_iters=32, num_sms=132) == 1
    assert k.split_k_for(num_tiles=1, k_iters=8, num_sms=132) == 8
    with pytest.raises(ValueError, match="M >= 1"):
        k.default_config(0, 64, 64, 64, torch.device("cpu"))


def test_empty_batch_gives_empty_output():
    # M = 0 (an empty batch) and N = 0: torch.matmul's empty result, not a launch over an empty grid
    _, qweight, scales, zeros = random_layer(128, 32, 4, 64)
    out = k.w4a16_matmul(torch.randn(0, 128, device=DEVICE).to(DTYPE_X), qweight, scales, zeros, 4, 64)
    assert out.shape == (0, 32) and out.dtype == DTYPE_X
    empty = torch.zeros(16, 0, dtype=torch.int32, device=DEVICE)
    out = k.w4a16_matmul(torch.randn(2, 128, device=DEVICE).to(DTYPE_X), empty, scales[:, :0].contiguous(),
                         zeros[:, :0].contiguous(), 4, 64)
    assert out.shape == (2, 0)


def test_kernel_rejects_bad_arguments():
    _, qweight, scales, zeros = random_layer(64, 16, 4, 32)
    x = torch.randn(2, 64).to(DEVICE).half()
    with pytest.raises(ValueError, match="qweight"):
        k.w4a16_matmul(x, qweight[:-1].contiguous(), scales, zeros, 4, 32)
    with pytest.raises(ValueError, match="group_size"):
        k.w4a16_matmul(x, qweight, scales, zeros, 4, 48)
    with pytest.raises(ValueError, match="zeros"):
        k.w4a16_matmul(x, qweight, scales, zeros.int(), 4, 32)
    with pytest.raises(ValueError, match="block_m == 1"):
        k.w4a16_matmul(x, qweight, scales, zeros, 4, 32, config=k.W4A16Config(2, 16, 64, algo=A.GEMV))
    with pytest.raises(ValueError, match="M == 1"):
        k.w4a16_matmul(x, qweight, scales, zeros, 4, 32, config=k.W4A16Config(1, 16, 64, algo=A.GEMV))


def table_configs(algos=None) -> list[k.W4A16Config]:
    """Every launch configuration a shipped tuning table or the fallback rule can pick (``tables.py``), of ``algos``
    (default: all), with the table's split-K count for a ``fixed`` candidate and 1 otherwise."""
    from paged_transformers.kernels.w4a16 import tables

    names = [p.stem.replace("_", " ") for p in (Path(dispatch.__file__).parent / "configs").glob("*.json")]
    candidates = [c for name in names for b in tables.table_named(name).buckets for c in b.candidates]
    candidates += [c for M in range(1, 300) for c in tables.fallback_candidates(M)]
    configs = {k.W4A16Config(c.block_m, c.block_n, c.block_k, c.split_k if c.split_k_rule == "fixed" else 1,
                             c.num_warps, c.num_stages, A(c.algo)) for c in candidates}
    return sorted((c for c in configs if algos is None or c.algo in algos), key=str)


# every algorithm the tables can pick but WGMMA (Gluon has no interpreter: test_w4a16_wgmma.py), on a tiny layer off
# the tile grid (N % BLOCK_N != 0), with split-K and bias
INTERPRETED = table_configs([A.GEMV, A.DOT, A.DOT_SWAP, A.TC, A.DEQUANT_MATMUL])


def test_the_tables_pick_every_algorithm_but_wgmma_here():
    assert {c.algo for c in INTERPRETED} == {A.GEMV, A.DOT, A.DOT_SWAP, A.TC, A.DEQUANT_MATMUL}


@pytest.mark.parametrize("cfg", INTERPRETED, ids=str)
def test_every_table_config_matches_reference(cfg):
    # under the interpreter with fp32 x against the reference (the TC kernel there unpacks with bit ops instead of its
    # inline PTX); group 128, K of 2 groups
    if HAS_CUDA:
        pytest.skip("float32 activations are an interpreter-only case; CUDA: test_kernel_real_size_cuda")
    M, N, K, group_size = (1 if cfg.algo is A.GEMV else min(cfg.block_m + 3, 20)), cfg.block_n + 8, 256, 128
    cfg = dataclasses.replace(cfg, split_k=2)
    _, qweight, scales, zeros = random_layer(K, N, 4, group_size, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2))
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, group_size, bias=bias, config=cfg)
    ref = k.w4a16_matmul_ref(x, qweight, scales, zeros, 4, group_size, bias=bias)
    assert rel(out, ref) < 1e-5
    # the check can fail: the zero point off by one (what a misplaced field or wrong magic looks like) is far outside
    assert rel(k.w4a16_matmul_ref(x, qweight, scales, zeros + 1, 4, group_size, bias=bias), ref) > 1e-3


def test_custom_op_is_one_node_under_torch_compile():
    # Dynamo must not trace into the launch (validation, workspace): fullgraph=True fails on a graph break,
    # aot_eager runs the fake implementation for the output's shape and dtype
    _, qweight, scales, zeros = random_layer(256, 48, 4, 128)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    x = x.half() if HAS_CUDA else x
    bias = torch.randn(48).to(x)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: k.w4a16_matmul_op(x, qweight, scales, zeros, 4, 128, bias) * 2, fullgraph=True, backend="aot_eager")
    out = fn(x)
    assert out.shape == (1, 48) and out.dtype == x.dtype
    assert rel(out, 2 * k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 128, bias=bias.float())) < 2e-3


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (real-size check)")
@pytest.mark.parametrize("M,K,N", [
    (1, 4096, 4096), (1, 4096, 6144), (4, 4096, 4096), (16, 4096, 4096), (256, 4096, 4096), (64, 4096, 14336),
    (33, 4096, 14336), (64, 14336, 4096), (40, 14336, 4096), (64, 4096, 4096), (300, 4096, 4096)])
def test_kernel_real_size_cuda(M, K, N):
    # the config default_config picks on this GPU for the engine's shapes, from one row to a prefill chunk
    _, qweight, scales, zeros = random_layer(K, N, 4, 128)
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, 128)
    assert rel(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 128)) < 1e-2


# W4A16Algo.TC: (M, K, N, group_size, config, x dtype). The interpreter runs only fp32/fp16 x (its bf16 arithmetic
# and bf16 tl.dot are wrong: DOT_SWAP fails there too). Cases: split-K + bias, groups of 64 = BLOCK_K and 128 = 2
# steps, per-channel with K % BLOCK_K != 0 (masked last step), BLOCK_K 32 and 64, M past one BLOCK_M tile,
# N % BLOCK_N != 0.
TC_CASES = [
    (5, 256, 48, 128, k.W4A16Config(16, 16, 64, 2, algo=A.TC), torch.float32),
    (3, 264, 40, 264, k.W4A16Config(16, 32, 64, 1, algo=A.TC), torch.float32),
    (3, 264, 40, 264, k.W4A16Config(16, 32, 32, 3, algo=A.TC), torch.float32),
    (2, 256, 64, 64, k.W4A16Config(16, 32, 64, 2, algo=A.TC), torch.float32),
    (18, 128, 24, 128, k.W4A16Config(16, 16, 64, 1, algo=A.TC), torch.float16),
    (4, 256, 64, 64, k.W4A16Config(16, 32, 64, 2, algo=A.TC), torch.float16),
    # the 64-row tiles of the wide and tall 17 <= M <= 64 rules: M below one tile, and two M tiles
    (40, 128, 32, 128, k.W4A16Config(64, 32, 64, 1, algo=A.TC), torch.float32),
    (70, 128, 16, 64, k.W4A16Config(64, 16, 64, 1, algo=A.TC), torch.float16),
]


@pytest.mark.parametrize("M,K,N,group_size,config,dtype", TC_CASES)
def test_tc_matches_reference(M, K, N, group_size, config, dtype):
    if HAS_CUDA:
        pytest.skip("interpreter cases (fp32 x); CUDA: test_tc_cuda")
    _, qweight, scales, zeros = random_layer(K, N, 4, group_size, seed=11)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(12)).to(dtype)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(13)).to(dtype) if config.split_k > 1 else None
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, group_size, bias=bias, config=config)
    ref = k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, group_size, bias=None if bias is None else bias.float())
    assert out.dtype == dtype and out.shape == (M, N)
    # fp32: the dot of exact integers q - z, scaled in fp32 (rounding only); fp16: the output's 2**-11 rounding
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel(out, ref) < tol
    # the check can fail: the zero point off by one (what a misplaced field or wrong magic looks like) is far outside
    assert rel(k.w4a16_matmul_ref(x.float(), qweight, scales, zeros + 1, 4, group_size), ref) > 20 * tol
    if config.split_k > 1:
        ws, locks = matmul._WORKSPACE._buffers[x.device]
        assert not ws.any() and not locks.any(), "split-K must leave its workspace zeroed"


def test_tc_fields_exact():
    # every 4-bit value at every field position, x = the identity: out = the dequantized weight's transpose, exactly
    # (a field landing on the wrong input row or a wrong x column order would move values)
    if HAS_CUDA:
        pytest.skip("float32 activations are an interpreter-only case")
    K, N = 64, 16
    q = ((torch.arange(K).view(K, 1) * 3 + torch.arange(N).view(1, N)) % 16).to(torch.int32)
    scales = torch.ones(1, N, dtype=torch.float16)
    zeros = torch.full((1, N), 16, dtype=torch.int16)
    out = k.w4a16_matmul(torch.eye(K), k.pack_rows(q, 4), scales, zeros, 4, K, config=k.W4A16Config(K, N, 64, 1, algo=A.TC))
    assert torch.equal(out, (q - 16).float())


def test_tc_rejects_what_it_cannot_run():
    _, qweight, scales, zeros = random_layer(128, 32, 4, 32, device="cpu")
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="multiple of block_k"):  # a K step would span 2 groups
        k.w4a16_matmul(x, qweight, scales, zeros, 4, 32, config=k.W4A16Config(16, 16, 64, algo=A.TC))
    _, q8, s8, z8 = random_layer(128, 32, 8, 128, device="cpu")
    with pytest.raises(ValueError, match="4-bit"):
        k.w4a16_matmul(x, q8, s8, z8, 8, 128, config=k.W4A16Config(16, 16, 64, algo=A.TC))
    with pytest.raises(ValueError, match="block_k % 32"):
        k.w4a16_matmul(x, qweight, scales, zeros, 4, 32, config=k.W4A16Config(16, 16, 16, algo=A.TC))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (inline PTX; bf16 tl.dot)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tc_cuda(dtype):
    _, qweight, scales, zeros = random_layer(4096, 1000, 4, 128)
    x = torch.randn(7, 4096, device=DEVICE, dtype=dtype)
    bias = torch.randn(1000, device=DEVICE, dtype=dtype)
    cfg = k.W4A16Config(16, 128, 128, 4, algo=A.TC)
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, 128, bias=bias, config=cfg)
    ref = k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 128, bias=bias.float())
    assert rel(out, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (inline PTX; bf16 tl.dot)")
@pytest.mark.parametrize("M,K,N,group_size,cfg", [
    # the wide 17 <= M <= 64 rule, off the tile grid: N % 128 != 0, per-channel K % 128 != 0 with bias
    (40, 4096, 1000, 128, k.W4A16Config(64, 128, 128, 1, 8, 3, A.TC)),
    (64, 4104, 1000, 4104, k.W4A16Config(64, 128, 128, 1, 8, 3, A.TC)),
    # several M tiles, and split-K
    (200, 4096, 1024, 128, k.W4A16Config(128, 128, 128, 1, 8, 3, A.TC)),
    (200, 4096, 1024, 128, k.W4A16Config(64, 128, 128, 5, 8, 3, A.TC)),
    # the tall 17 <= M <= 64 rule (split-K), off the grid: a part-filled row tile, per-channel K % 128 != 0,
    # N % 128 != 0, with bias; and the config default_config picks for down at 17 rows
    (40, 4104, 1000, 4104, k.W4A16Config(64, 128, 128, 33, 8, 3, A.TC)),
    (17, 14336, 4096, 128, None),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tc_large_tiles_cuda(M, K, N, group_size, cfg, dtype):
    _, qweight, scales, zeros = random_layer(K, N, 4, group_size)
    x = torch.randn(M, K, device=DEVICE, dtype=dtype)
    bias = torch.randn(N, device=DEVICE, dtype=dtype)
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, group_size, bias=bias, config=cfg)
    ref = k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, group_size, bias=bias.float())
    assert rel(out, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3)
