"""The step limits picked by device and usage context (``core.batch_defaults``): vLLM's table, written out here from
``vllm/engine/arg_utils.py`` (``get_batch_defaults``) and ``vllm/config/vllm.py`` (``_set_cudagraph_sizes``), on faked
device descriptions (no GPU needed); explicit values winning; and every entry point getting them."""

import dataclasses

import pytest
import torch

from conftest import make_tiny_model
from paged_transformers import LLM, EngineConfig, LLMEngine, SamplingParams, engine_for, paged_generate, patch, release, unpatch
from paged_transformers.core import batch_defaults
from paged_transformers.core.batch_defaults import DeviceDescription, resolve_batch_limits
from paged_transformers.core.sizing import graph_pool_bytes
from paged_transformers.integration.warm import current_engine

GiB = 1 << 30
H100 = DeviceDescription("cuda", "NVIDIA H100 80GB HBM3", 79 * GiB + 500 * (1 << 20))  # what torch reports: ~79.1 GiB
H200 = DeviceDescription("cuda", "NVIDIA H200", 140 * GiB)
A100_80 = DeviceDescription("cuda", "NVIDIA A100-SXM4-80GB", 79 * GiB)
A100_40 = DeviceDescription("cuda", "NVIDIA A100-SXM4-40GB", 39 * GiB + 400 * (1 << 20))
L4_24 = DeviceDescription("cuda", "NVIDIA L4", 22 * GiB + 500 * (1 << 20))
CPU = DeviceDescription("cpu")


def limits(device: DeviceDescription, max_model_len: int = 8192, **fields) -> tuple[int, int, int]:
    config = resolve_batch_limits(EngineConfig(**fields), device, max_model_len)
    return config.max_num_seqs, config.max_num_batched_tokens, config.max_cudagraph_capture_size


# (max_num_seqs, max_num_batched_tokens, largest decode graph) by vLLM's rule; the graph: min(2 * seqs, 512, tokens),
# then at most max_num_seqs here (decode-only graphs)
@pytest.mark.parametrize("device, llm_class, server", [
    (H100, (1024, 16384, 512), (1024, 8192, 512)),
    (H200, (1024, 16384, 512), (1024, 8192, 512)),
    (A100_80, (256, 8192, 256), (256, 2048, 256)),  # 80 GB, but an A100: vLLM's exception
    (A100_40, (256, 8192, 256), (256, 2048, 256)),
    (L4_24, (256, 8192, 256), (256, 2048, 256)),
    (CPU, (256, 8192, 256), (256, 8192, 256)),  # CPU keeps the earlier values (vLLM: 256 / 4096, 128 / 2048)
], ids=["h100", "h200", "a100-80gb", "a100-40gb", "24gb", "cpu"])  # fmt: skip
def test_defaults_by_device_and_usage_context(device, llm_class, server):
    assert limits(device) == llm_class
    assert limits(device, usage_context="OPENAI_API_SERVER") == server


def test_explicit_values_win():
    assert limits(H100, max_num_seqs=256, max_num_batched_tokens=8192, max_cudagraph_capture_size=256) == (256, 8192, 256)
    assert limits(H100, max_num_seqs=64) == (64, 16384, 64)  # the graph: min(128, 512, 16384) capped at 64 sequences
    assert limits(H100, max_num_batched_tokens=4096) == (1024, 4096, 512)
    assert limits(CPU, max_num_seqs=1024, max_num_batched_tokens=16384) == (1024, 16384, 512)
    assert limits(H100, max_cudagraph_capture_size=128) == (1024, 16384, 128)
    # an explicit max_num_seqs under the token budget stays, even with a short max_model_len
    assert limits(H100, max_model_len=4, max_num_seqs=2048, max_num_batched_tokens=1024) == (2048, 1024, 512)


def test_explicit_graph_limit_is_capped_at_the_step_limits():
    assert limits(H100, max_cudagraph_capture_size=4096) == (1024, 16384, 1024)
    assert limits(H100, max_num_batched_tokens=300, max_cudagraph_capture_size=4096) == (300, 300, 300)


def test_defaults_are_capped_by_max_model_len():
    # vLLM: tokens = min(seqs * max_model_len, default); seqs = min(default, tokens)
    assert limits(H100, max_model_len=8) == (1024, 8192, 512)
    assert limits(A100_40, max_model_len=16) == (256, 4096, 256)
    assert limits(H100, max_model_len=8, max_num_seqs=4) == (4, 32, 4)
    # chunked prefill off: every prompt fits a step (max_model_len tokens), as vLLM's max(max_model_len, default)
    assert limits(H100, max_model_len=32768, enable_chunked_prefill=False) == (1024, 32768, 512)
    assert limits(H100, max_model_len=32768) == (1024, 16384, 512)


def test_a_bad_limit_or_usage_context_is_refused():
    with pytest.raises(ValueError, match="max_cudagraph_capture_size must be a positive integer or None, got 0"):
        EngineConfig(max_cudagraph_capture_size=0)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer or None, got -1"):
        EngineConfig(max_num_seqs=-1)
    with pytest.raises(ValueError, match="usage_context must be one of"):
        EngineConfig(usage_context="server")


def test_device_description_of_the_cpu():
    assert DeviceDescription.of("cpu") == CPU


@pytest.fixture
def on_h100(monkeypatch):
    """Every engine built in the test sees the faked H100's description (the model stays on the CPU)."""
    monkeypatch.setattr(batch_defaults.DeviceDescription, "of", classmethod(lambda cls, device: H100))


def engine_limits(engine) -> tuple[int, int, int]:
    c = engine.config
    return c.max_num_seqs, c.max_num_batched_tokens, c.max_cudagraph_capture_size


def test_the_engine_runs_with_the_picked_limits(on_h100):
    model = make_tiny_model("llama")
    with LLMEngine(model, engine_config=EngineConfig(attention_backend="torch", max_model_len=128,
                                                     kv_cache_memory_bytes=1 << 20)) as engine:
        assert engine_limits(engine) == (1024, 16384, 512)
        assert (engine.scheduler.config.max_num_seqs, engine.runner.max_num_seqs) == (1024, 1024)
        assert engine.requested_config.max_num_seqs is None  # what the warm engine compares with


def test_llm_paged_generate_and_the_patch_get_the_llm_class_defaults(on_h100):
    model = make_tiny_model("llama")
    with LLM(model, kv_cache_memory_bytes=1 << 20, attention_backend="torch") as llm:
        assert engine_limits(llm.llm_engine) == (1024, 16384, 512)
    paged_generate(model, [[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert engine_limits(engine_for(model)) == (1024, 16384, 512)
    release(model)
    patch()
    try:
        model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        assert engine_limits(current_engine(model)) == (1024, 16384, 512)  # the engine the patched call built
    finally:
        unpatch()


def test_the_server_gets_its_usage_context(on_h100):
    pytest.importorskip("fastapi")
    from paged_transformers.entrypoints.openai.cli_args import llm_arguments, make_arg_parser

    model = make_tiny_model("llama")
    args = make_arg_parser().parse_args(["--device", "cpu", "--num-gpu-blocks-override", "64", "--max-model-len", "128"])
    kwargs = {**llm_arguments(args), "attention_backend": "torch"}
    with LLM(model, **kwargs) as llm:
        assert engine_limits(llm.llm_engine) == (1024, 8192, 512)
    args = make_arg_parser().parse_args(["--device", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                                         "--num-gpu-blocks-override", "64", "--max-model-len", "128"])
    with LLM(model, **{**llm_arguments(args), "attention_backend": "torch"}) as llm:
        assert engine_limits(llm.llm_engine) == (8, 512, 8)


def test_a_default_config_reuses_the_warm_engine(on_h100):
    """The warm engine compares a call's config with the one it was built from, not with the limits it picked: an
    unchanged ``EngineConfig()`` does not rebuild it at every call."""
    model = make_tiny_model("llama")
    config = EngineConfig(attention_backend="torch", kv_cache_memory_bytes=1 << 20)
    paged_generate(model, [[1, 2, 3]], SamplingParams(max_tokens=2), engine_config=config, use_tqdm=False)
    first = engine_for(model)
    paged_generate(model, [[1, 2, 3]], SamplingParams(max_tokens=2), engine_config=dataclasses.replace(config),
                   use_tqdm=False)
    assert engine_for(model) is first and not first.closed


def test_the_graph_reserve_grows_with_the_buckets_static_logits():
    """The KV sizing's reserve for the decode graphs' pool: each bucket keeps its static logits (Llama-3-8B's
    vocabulary, bf16), plus the largest bucket's share of the profiled step peak; at least the 1 GiB of before."""
    vocab, peak = 128256, 3 << 30
    # buckets up to 512: 1, 2, 4, 8 and 16, 32, ..., 512 (32 of them): 15 + 16 * (1 + ... + 32) = 8463 rows
    assert graph_pool_bytes(512, vocab, 2, peak, 16384) == 8463 * vocab * 2 + peak * 512 // 16384
    # up to 256: 15 + 16 * (1 + ... + 16) = 2191 rows, 0.56 GB: under the 1 GiB floor
    assert 2191 * vocab * 2 + peak * 256 // 8192 < 1 << 30
    assert graph_pool_bytes(256, vocab, 2, peak, 8192) == 1 << 30
