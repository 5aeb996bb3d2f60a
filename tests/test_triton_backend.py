"""``attention_backend="triton"`` gives the same greedy tokens as ``"torch"`` through ``paged_generate``.

The torch backend (``paged_attention_ref``) is itself checked against stock ``generate()`` in
test_engine_equivalence.py. Without CUDA the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``,
set in conftest.py). A small token budget forces chunked prefill, so steps mix prefill chunks with
cached context and decode tokens; Gemma-2's sliding window (40 < prompt lengths) and logit soft-capping
(5) go through the kernels' window and softcap paths.
"""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from conftest import random_prompts  # noqa: E402
from paged_transformers import EngineConfig, SamplingParams, paged_generate  # noqa: E402
from paged_transformers.core.attention import resolve_backend  # noqa: E402
from paged_transformers.config import AttentionBackend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPTS = random_prompts(5, 1, 90, seed=1)
MAX_TOKENS = 6


def generate(model, backend: str) -> list[list[int]]:
    config = EngineConfig(attention_backend=backend, block_size=16, max_num_batched_tokens=64, num_gpu_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = paged_generate(model, PROMPTS, params, engine_config=config, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.slow
def test_triton_matches_torch_backend(arch, tiny_model):
    model = copy.deepcopy(tiny_model(arch)).to(DEVICE)  # a copy: Module.to moves the shared cached model in place
    want = generate(model, "torch")
    got = generate(model, "triton")
    assert all(len(t) == MAX_TOKENS for t in got)
    assert got == want


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend(AttentionBackend.TRITON, torch.device("cpu"))


def test_triton_backend_can_be_captured():
    """The Triton wrappers read nothing back from the device (test_kernels_attention.py::test_no_host_sync_with_bounds),
    so the backend says a CUDA graph can capture it; the runner reads that flag."""
    from paged_transformers.kernels.api import paged_attention, reshape_and_cache

    ops = resolve_backend(AttentionBackend.TRITON, DEVICE)
    assert (ops.write_kv, ops.attend, ops.graph_capturable) == (reshape_and_cache, paged_attention, True)
