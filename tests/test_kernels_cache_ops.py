"""``reshape_and_cache`` (Triton) writes exactly what ``reshape_and_cache_ref`` (PyTorch) writes.

Without CUDA the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set in conftest.py and
here). Caches start filled with random values, so a write to a wrong slot or a skipped token shows up
as a difference anywhere in the cache; key/value come as strided views (row strides != contiguous).
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from paged_transformers.kernels.api import reshape_and_cache, reshape_and_cache_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "num_tokens, num_kv_heads, head_dim, block_size, dtype",
    [
        (9, 2, 64, 16, torch.float32),
        (5, 1, 80, 32, torch.float16),
        (12, 3, 96, 16, torch.bfloat16),
        (4, 8, 128, 64, torch.bfloat16),
        (3, 2, 256, 128, torch.float16),
    ],
)
def test_matches_reference(num_tokens, num_kv_heads, head_dim, block_size, dtype):
    seed = random.randrange(1 << 31)
    g = torch.Generator().manual_seed(seed)
    num_blocks = 2 + num_tokens // block_size + 2
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    # key: a slice of a wider tensor (row strides of a fused QKV output); value: every other row
    wide = torch.randn(num_tokens, num_kv_heads + 2, head_dim + 8, generator=g).to(dtype).to(DEVICE)
    key = wide[:, 1 : num_kv_heads + 1, :head_dim]
    value = torch.randn(2 * num_tokens, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)[::2]
    assert not key.is_contiguous() and not value.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1  # padding tokens
    slots = slots.to(DEVICE)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, want_k, want_v, slots)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k), f"seed {seed}: key_cache differs"
    assert torch.equal(value_cache, want_v), f"seed {seed}: value_cache differs"


def _args():
    key = torch.randn(4, 2, 64, device=DEVICE)
    cache = torch.randn(3, 16, 2, 64, device=DEVICE)
    return [key, key.clone(), cache, cache.clone(), torch.arange(4, device=DEVICE)]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.__setitem__(0, a[0].half()), "dtype"),
        (lambda a: a.__setitem__(0, a[0][:, :1]), "key and value"),
        (lambda a: a.__setitem__(1, a[1][..., :32]), "key and value"),
        (lambda a: (a.__setitem__(0, a[0][..., :32]), a.__setitem__(1, a[1][..., :32])), "do not match"),
        (lambda a: a.__setitem__(0, a[0].transpose(1, 2).contiguous().transpose(1, 2)), "stride 1"),
        (lambda a: a.__setitem__(2, a[2].transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
        (lambda a: a.__setitem__(4, a[4].int()), "slot_mapping"),
        (lambda a: a.__setitem__(4, a[4][:3]), "slot_mapping"),
        (lambda a: a.__setitem__(4, torch.arange(4, device="meta")), "is on meta"),
    ],
)
def test_rejects_bad_inputs(mutate, match):
    args = _args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        reshape_and_cache(*args)
