"""``argmax_rows`` (two-stage Triton row argmax; interpreted on CPU) against ``torch.argmax``."""

import pytest
import torch

from paged_transformers.kernels.argmax import argmax_rows

BLOCK = 16  # a small stage-1 block, so that small rows span several chunks under the interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: TRITON_INTERPRET=1 (conftest)


def _check(x: torch.Tensor) -> None:
    x = x.to(DEVICE)
    got = argmax_rows(x, block=BLOCK)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [1, 7, BLOCK, 5 * BLOCK + 3])
def test_random_rows(dtype, V):
    g = torch.Generator().manual_seed(V)
    _check(torch.randn(3, V, generator=g).to(dtype))


def test_ties_go_to_the_first_index_across_and_within_chunks():
    V = 2 * BLOCK + 5
    x = torch.zeros(4, V)
    x[0, [BLOCK + 1, 3]] = 5.0  # two chunks hold the maximum: the earlier chunk's index
    x[1, [2 * BLOCK + 4, BLOCK + 2]] = 5.0
    x[2, [10, 11]] = 1.0  # within one chunk
    # row 3: all equal -> index 0
    _check(x)


def test_infinities_and_nan():
    V = 2 * BLOCK + 5
    x = torch.full((5, V), float("-inf"))  # row 0: all -inf -> 0
    x[1, BLOCK + 7] = float("inf")
    x[1, 2 * BLOCK] = float("nan")  # NaN beats +inf, though later
    x[2, [5, 2 * BLOCK + 1]] = float("nan")  # two NaNs: the first
    x[3, :] = 0.0
    x[3, V - 1] = float("nan")  # NaN in the last, partial chunk
    x[4, :] = torch.randn(V)
    _check(x)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter flushes bf16 subnormals to zero before comparing")
def test_subnormal_maxima_cuda():
    for dtype, small in ((torch.bfloat16, 1e-39), (torch.float16, 1e-7), (torch.float32, 1e-39)):
        x = torch.zeros(2, 5 * BLOCK, dtype=dtype)
        x[0, [3, 2 * BLOCK + 1]] = torch.tensor([small, 2 * small], dtype=dtype)  # the larger one in a later chunk
        x[1, [4, BLOCK]] = torch.tensor([-small, -2 * small], dtype=dtype)  # 0 is the maximum: index 0
        _check(x)


def test_row_stride_and_empty():
    wide = torch.randn(3, BLOCK + 40, device=DEVICE)
    _check(wide[:, : BLOCK + 9])  # the first vocab_size columns of padded logits
    assert argmax_rows(torch.empty(0, 5, device=DEVICE)).shape == (0,)


def test_default_block():
    x = torch.randn(2, 5000, device=DEVICE)  # 3 chunks of the default 2048
    x[1, 4500] = x[1, 100] = 9.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(5), "shape"),
    (torch.zeros(2, 0), "shape"),
    (torch.zeros(2, 3, dtype=torch.int64), "dtype|int64"),
    (torch.zeros(3, 2).t(), "stride"),
])
def test_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        argmax_rows(bad)


@pytest.mark.parametrize("block", [0, 24, 2.0, True, 2**17])
def test_bad_block(block):
    with pytest.raises(ValueError, match="block"):
        argmax_rows(torch.zeros(2, 3), block=block)
