"""The oneDNN route's memory stays bounded over calls of every size (``cpu_linear.ROW_BUCKETS``).

oneDNN makes a primitive per product shape and keeps it in two process-wide caches (torch's ideep and oneDNN's
own, 1024 entries each, 0.3-1 MiB per entry): before the row buckets, every new row count held memory for good.
Here: 1,000 ``paged_generate`` calls of varying batch and prompt sizes on a tiny model after a warm-up of the same
kind; the process's resident memory may grow by at most 50 MiB (stock ``generate()``'s products through
``F.linear`` stay flat). Slow: about a minute.
"""

import os
import random

import pytest
import torch

from conftest import make_tiny_model
from paged_transformers import EngineConfig, SamplingParams, paged_generate
from paged_transformers.core import cpu_linear

CONFIG = EngineConfig(num_gpu_blocks=128)  # a pool of 1 MiB (2 layers, 2 KV heads of 16): its pages count for nothing

pytestmark = [
    pytest.mark.skipif(not cpu_linear.available(), reason="oneDNN linear needs x86-64 torch with mkldnn"),
    pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc"),
]


def resident_mib() -> float:
    """The process's resident set size, MiB (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def calls(model, num: int, rng: random.Random) -> None:
    """``num`` greedy calls of 1-4 prompts of 1-250 tokens (so prefill steps of many row counts), 1-3 new tokens."""
    for _ in range(num):
        prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(1, 250))] for _ in range(rng.randint(1, 4))]
        paged_generate(model, prompts, SamplingParams(temperature=0, max_tokens=rng.randint(1, 3)), use_tqdm=False,
                       engine_config=CONFIG)


@pytest.mark.slow
def test_resident_memory_is_bounded_over_calls_of_every_size():
    model = make_tiny_model("llama", seed=50)
    rng = random.Random(0)
    calls(model, 200, rng)  # the pool, the packs and a primitive per (weight shape, row bucket)
    warm = resident_mib()
    calls(model, 1000, rng)
    grown = resident_mib() - warm
    assert grown < 50, f"resident memory grew by {grown:.0f} MiB over 1,000 calls after the warm-up ({warm:.0f} MiB)"


@pytest.mark.parametrize("rows", [9, 37, 63, 65, 300])
@pytest.mark.parametrize("packed", [False, True])
def test_padded_and_large_products_match_functional_linear(rows, packed):
    """Rows padded to their bucket (9 -> 12, 37 -> 48, 63 -> 64) and rows above the largest bucket (F.linear)
    give ``F.linear``'s product, through the plain and the packed weight."""
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(64, 96)
    x = torch.randn(rows, 64, generator=g)
    if packed:
        routes = cpu_linear.RoutedLinears(torch.nn.Sequential(linear), prepack=True)
        got = routes.packed_routes[0][1](x)
        assert routes.num_packed_products == (rows <= cpu_linear.ROW_BUCKETS[-1])
    else:
        got = cpu_linear._forward(linear, x)
    want = torch.nn.functional.linear(x, linear.weight, linear.bias)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
