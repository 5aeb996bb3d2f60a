"""The execution plan's rule (``resolve_execution_plan``) on described devices and models, CUDA ones included, and the
plan an engine on this machine resolves, logs and exposes."""

import logging

import pytest
import torch

from conftest import make_tiny_model
from paged_transformers import EngineConfig, LLMEngine
from paged_transformers.core import cpu_linear
from paged_transformers.core.execution_plan import (
    DeviceFacts,
    LayerPath,
    ModelFacts,
    resolve_execution_plan,
)

H100 = DeviceFacts("cuda", triton_interpreter=False, onednn_linear=False, graph_capturable_attention=True)
X86 = DeviceFacts("cpu", triton_interpreter=False, onednn_linear=True, graph_capturable_attention=False)
LLAMA_BF16 = ModelFacts(torch.bfloat16, fused_layers_unsupported=None)
GEMMA_BF16 = ModelFacts(torch.bfloat16, fused_layers_unsupported="layer 0 is a Gemma2DecoderLayer")
CPU_REASON = "their kernels need CUDA or the Triton interpreter (TRITON_INTERPRET=1) on cpu"


def plan(model, device, *, cuda_graphs=True, compile_layers=None, fuse_projections=None, cpu_prepack_weights=None,
         max_cudagraph_capture_size=8, compile_error=None):
    """``resolve_execution_plan`` with ``EngineConfig``'s defaults (8 sequences)."""
    return resolve_execution_plan(cuda_graphs=cuda_graphs, compile_layers=compile_layers,
                                  fuse_projections=fuse_projections, cpu_prepack_weights=cpu_prepack_weights,
                                  max_cudagraph_capture_size=max_cudagraph_capture_size, model=model, device=device,
                                  compile_error=compile_error)


def test_cuda_default_runs_the_llama_family_fused_in_graphs():
    p = plan(LLAMA_BF16, H100)
    assert p.layers is LayerPath.FUSED and p.fuse_projections and p.gemv_at_batch_1
    assert p.cuda_graphs and p.cuda_graph_sizes == (1, 2, 4, 8)
    assert p.precompile_kernels and p.cpu_weight_packing == "off"
    assert p.fused_layers_unsupported is None and p.compile_error is None


def test_cuda_default_compiles_other_models_and_says_why():
    p = plan(GEMMA_BF16, H100, max_cudagraph_capture_size=40)
    assert p.layers is LayerPath.COMPILED and p.fuse_projections and p.gemv_at_batch_1
    assert p.cuda_graph_sizes == (1, 2, 4, 8, 16, 32, 40)
    assert not p.precompile_kernels  # the compile's warm-ups compile the kernels
    assert p.fused_layers_unsupported == "layer 0 is a Gemma2DecoderLayer"
    assert "layers=compiled" in str(p) and "Gemma2DecoderLayer" in str(p)


def test_cuda_without_graphs_or_with_the_torch_attention():
    eager = plan(GEMMA_BF16, H100, cuda_graphs=False)  # enforce_eager: nothing compiles by default
    assert eager.layers is LayerPath.EAGER and not eager.fuse_projections and not eager.gemv_at_batch_1
    assert not eager.cuda_graphs and eager.cuda_graph_sizes == () and eager.precompile_kernels
    assert plan(LLAMA_BF16, H100, cuda_graphs=False).layers is LayerPath.FUSED
    torch_attention = DeviceFacts("cuda", False, False, graph_capturable_attention=False)
    p = plan(LLAMA_BF16, torch_attention)
    assert p.layers is LayerPath.FUSED and not p.cuda_graphs and not p.precompile_kernels
    assert plan(GEMMA_BF16, torch_attention).layers is LayerPath.EAGER


def test_cuda_knobs():
    assert plan(LLAMA_BF16, H100, compile_layers=True).layers is LayerPath.COMPILED
    unfused = plan(LLAMA_BF16, H100, compile_layers=True, fuse_projections=False)
    assert unfused.layers is LayerPath.COMPILED and not unfused.fuse_projections
    # fuse_projections=False: no fused layers, so the default compiles (graphs are on) without fusion
    p = plan(LLAMA_BF16, H100, fuse_projections=False)
    assert p.layers is LayerPath.COMPILED and not p.fuse_projections and p.fused_layers_unsupported is None
    p = plan(LLAMA_BF16, H100, compile_layers=False, fuse_projections=False)
    assert p.layers is LayerPath.EAGER and p.cuda_graphs and p.precompile_kernels
    # fp32 weights: no GEMV (it takes fp16/bf16)
    assert not plan(ModelFacts(torch.float32, None), H100).gemv_at_batch_1


def test_cpu_fp32_takes_onednn_and_its_packing_policy():
    for prepack, packing in ((None, "when_unchanged"), (True, "always"), (False, "off")):
        p = plan(ModelFacts(torch.float32, CPU_REASON), X86, cpu_prepack_weights=prepack)
        assert p.layers is LayerPath.ONEDNN and p.cpu_weight_packing == packing
        assert not p.cuda_graphs and not p.fuse_projections and not p.gemv_at_batch_1 and not p.precompile_kernels
        assert p.fused_layers_unsupported is None  # not tried on a CPU by default
    assert plan(ModelFacts(torch.bfloat16, CPU_REASON), X86).layers is LayerPath.EAGER
    no_onednn = DeviceFacts("cpu", False, onednn_linear=False, graph_capturable_attention=False)
    assert plan(ModelFacts(torch.float32, CPU_REASON), no_onednn).layers is LayerPath.EAGER
    compiled = plan(ModelFacts(torch.float32, CPU_REASON), X86, compile_layers=True)
    assert compiled.layers is LayerPath.COMPILED and compiled.fuse_projections and compiled.cpu_weight_packing == "off"


def test_fuse_projections_true_needs_fused_or_compiled_layers():
    with pytest.raises(ValueError, match="cannot run this model: their kernels need CUDA or the Triton interpreter"):
        plan(ModelFacts(torch.float32, CPU_REASON), X86, fuse_projections=True)
    with pytest.raises(ValueError, match="cannot run this model: layer 0 is a Gemma2DecoderLayer"):
        plan(GEMMA_BF16, H100, fuse_projections=True, compile_layers=False)
    # with decode graphs the default compiles them instead, fused
    p = plan(GEMMA_BF16, H100, fuse_projections=True)
    assert p.layers is LayerPath.COMPILED and p.fuse_projections
    interpreter = DeviceFacts("cpu", triton_interpreter=True, onednn_linear=True, graph_capturable_attention=True)
    p = plan(ModelFacts(torch.float32, None), interpreter, fuse_projections=True)
    assert p.layers is LayerPath.FUSED and not p.cuda_graphs and not p.gemv_at_batch_1


def test_a_failed_compile_falls_back_to_eager():
    p = plan(GEMMA_BF16, H100, compile_error="RuntimeError: inductor says no")
    assert p.layers is LayerPath.EAGER and not p.fuse_projections and not p.gemv_at_batch_1
    assert p.cuda_graphs and p.compile_error == "RuntimeError: inductor says no"
    cpu = plan(ModelFacts(torch.float32, CPU_REASON), X86, compile_layers=True, compile_error="boom")
    assert cpu.layers is LayerPath.ONEDNN and cpu.cpu_weight_packing == "when_unchanged"


def test_model_facts(monkeypatch):
    """The fused layers' check names the model's layer class where their kernels can run, the device elsewhere."""
    llama, gemma = make_tiny_model("llama", seed=1), make_tiny_model("gemma2", seed=1)
    interpreter = DeviceFacts("cpu", triton_interpreter=True, onednn_linear=False, graph_capturable_attention=True)
    assert ModelFacts.of(llama, torch.float32, interpreter) == ModelFacts(torch.float32, None)
    assert "Gemma2DecoderLayer" in ModelFacts.of(gemma, torch.float32, interpreter).fused_layers_unsupported
    assert ModelFacts.of(llama, torch.float32, X86).fused_layers_unsupported == CPU_REASON
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not DeviceFacts.of(torch.device("cpu"), False).triton_interpreter


def test_the_engine_logs_and_exposes_its_plan(caplog):
    """An fp32 engine on this CPU: the oneDNN path where this torch has it, logged in one line."""
    model = make_tiny_model("llama", seed=2)
    with caplog.at_level(logging.INFO, logger="paged_transformers"):
        with LLMEngine(model, engine_config=EngineConfig(attention_backend="torch", max_model_len=64)) as engine:
            got = engine.execution_plan
    lines = [r.getMessage() for r in caplog.records if "execution plan" in r.getMessage()]
    assert len(lines) == 1 and "layers=" in lines[0] and "\n" not in lines[0]
    assert got.layers is (LayerPath.ONEDNN if cpu_linear.available() else LayerPath.EAGER)
    assert not got.cuda_graphs and not got.fuse_projections
    assert (engine.runner.cpu_linears is not None) == (got.layers is LayerPath.ONEDNN)
