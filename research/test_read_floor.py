"""``research/read_floor.py``, the read-only kernel: its program checksums add up to ``checksum_ref`` (every packed
word once, each group's scale and zero rows once per split that touches them), so the floor it times cannot skip
bytes; and ``empty_launch``, the launch cost under it. Without CUDA it runs in Triton's interpreter:
``TRITON_INTERPRET=1 python -m pytest research/test_read_floor.py``."""

import importlib.util
import pathlib

import pytest
import torch

_PATH = pathlib.Path(__file__).resolve().parent / "read_floor.py"
_spec = importlib.util.spec_from_file_location("read_floor", _PATH)
read_floor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(read_floor)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _layer(K, N, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), generator=g, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(K // group, N, generator=g) * 2 - 1).to(torch.float16)
    zeros = torch.randint(-2**15, 2**15 - 1, (K // group, N), generator=g, dtype=torch.int64).to(torch.int16)
    return qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


@pytest.mark.parametrize("K,N,group,block_n,bkp,split_k", [
    (256, 96, 32, 64, 4, 3),  # N off the tile, splits that straddle groups, the last split short
    (256, 128, 128, 128, 8, 1),  # one split
    (128, 64, 16, 32, 2, 8),  # a split per group
    (64, 32, 64, 32, 2, 7),  # more splits than rows of a step: empty programs
])
def test_checksums_cover_every_byte(K, N, group, block_n, bkp, split_k):
    q, s, z = _layer(K, N, group)
    out = read_floor.read_floor(q, s, z, group, block_n, bkp, split_k, num_warps=1)
    assert out.shape == (split_k, -(-N // block_n))
    assert int(out.to(torch.int64).sum()) % 2**32 == read_floor.checksum_ref(q, s, z, group, split_k, bkp)


def test_checksum_sees_a_changed_word():
    q, s, z = _layer(256, 96, 32)
    ref = read_floor.checksum_ref(q, s, z, 32, 3, 4)
    q[31, 95] += 1  # the last word
    out = read_floor.read_floor(q, s, z, 32, 64, 4, 3, num_warps=1)
    assert int(out.to(torch.int64).sum()) % 2**32 == (ref + 1) % 2**32


@pytest.mark.parametrize("group,block_n,bkp,split_k,match", [
    (12, 32, 2, 1, "group_size must be a positive multiple of 8 dividing K=128, got 12"),
    (48, 32, 2, 1, "dividing K=128, got 48"),
    (64, 24, 2, 1, "block_n must be a power of two, got 24"),
    (64, 32, 3, 1, "bkp must be a power of two, got 3"),
    (64, 32, 2, 0, "split_k must be >= 1, got 0"),
])
def test_bad_arguments(group, block_n, bkp, split_k, match):
    q, s, z = _layer(128, 32, 64)
    with pytest.raises(ValueError, match=match):
        read_floor.read_floor(q, s, z, group, block_n, bkp, split_k, num_warps=1)


def test_empty_launch_runs_every_program():
    assert read_floor.empty_launch(5, 1, DEVICE).tolist() == [0, 1, 2, 3, 4]
