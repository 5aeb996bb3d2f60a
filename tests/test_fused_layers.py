"""The fused eager decoder layers (``compilation/fused_layers.py``) and their kernels (``kernels.layer_ops``).

References: the PyTorch references of the kernels (transformers' own ops: ``LlamaRMSNorm``, ``apply_rotary_pos_emb``,
``silu``) and, for the engine, stock ``model.generate()`` (fp32, each prompt alone) on a model that never saw an
engine. On the CPU the kernels and the Triton attention run in Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``); there the fused layers are on only when asked for (``fuse_projections=True`` with
uncompiled layers), on CUDA by default for the model families they run.
"""

import pytest
import torch
from conftest import engine_greedy, make_tiny_model, random_prompts, stock_greedy

from paged_transformers import EngineConfig, LLMEngine, SamplingParams, paged_generate, release
from paged_transformers.compilation.fusion import FusedLinearSlice
from paged_transformers.compilation.layers import decoder_layers
from paged_transformers.core.execution_plan import LayerPath
from paged_transformers.integration.warm import current_engine

pytest.importorskip("triton")

from paged_transformers.kernels.layer_ops import (  # noqa: E402
    rms_norm,
    rms_norm_ref,
    rotary_embedding,
    rotary_embedding_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


# -- kernels ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 96])  # 96: off the power-of-two block
def test_rms_norm_equals_transformers_with_and_without_residual(dtype, D):
    g = torch.Generator().manual_seed(D)
    x, r = (torch.randn(5, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    norm = LlamaRMSNorm(D, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=g))
        torch.testing.assert_close(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x), **_tol(dtype))
        out, s = rms_norm(x, norm.weight, norm.variance_epsilon, residual=r)
        assert torch.equal(s, r + x)
        torch.testing.assert_close(out, norm(r + x), **_tol(dtype))
        ref_out, ref_s = rms_norm_ref(x, norm.weight, norm.variance_epsilon, residual=r)
        assert torch.equal(ref_s, r + x)
        torch.testing.assert_close(ref_out, norm(r + x), atol=0, rtol=0)


def test_rms_norm_of_strided_rows_and_an_fp32_weight():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 80, generator=g).to(DEVICE, torch.float16)
    x = wide[:, 8:72]  # row stride 80
    w = torch.randn(64, generator=g).to(DEVICE)  # fp32 weight: fp32 output, as eager's promotion
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_of_strided_heads_equals_transformers(dtype):
    g = torch.Generator().manual_seed(1)
    T, H, D = 4, 11, 16  # 11 heads: off the 8-head block
    qkv = torch.randn(T, H * D + 8, generator=g).to(DEVICE, dtype)
    x = qkv[:, 8:].view(T, H, D)  # heads as a column slice of a fused product
    cos, sin = (torch.randn(T, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    got = rotary_embedding(x, cos, sin)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want[0].transpose(0, 1), **_tol(dtype))
    torch.testing.assert_close(rotary_embedding_ref(x, cos, sin), want[0].transpose(0, 1), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2 * 1500, generator=g).to(DEVICE, dtype)  # 1500 columns: two blocks, the last partial
    want = torch.nn.functional.silu(x[:, :1500]) * x[:, 1500:]
    torch.testing.assert_close(silu_and_mul(x), want, **_tol(dtype))
    assert torch.equal(silu_and_mul_ref(x), want)


def test_kernels_take_no_rows_and_refuse_bad_input():
    x = torch.randn(0, 32, device=DEVICE)
    assert rms_norm(x, torch.ones(32, device=DEVICE), 1e-6).shape == (0, 32)
    assert silu_and_mul(x).shape == (0, 16)
    with pytest.raises(ValueError, match=r"weight must be \[32\]"):
        rms_norm(torch.randn(2, 32, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"residual must be \[2, 32\] torch.float32"):
        rms_norm(torch.randn(2, 32, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6,
                 residual=torch.randn(2, 32, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(torch.randn(32, 2, device=DEVICE).t(), torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 2, got 12"):
        rotary_embedding(torch.randn(2, 3, 12, device=DEVICE), torch.randn(2, 12, device=DEVICE),
                         torch.randn(2, 12, device=DEVICE))
    with pytest.raises(ValueError, match=r"sin must be \[2, 16\]"):
        rotary_embedding(torch.randn(2, 3, 16, device=DEVICE), torch.randn(2, 16, device=DEVICE),
                         torch.randn(3, 16, device=DEVICE))
    with pytest.raises(ValueError, match="width 7"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16, got torch.int64"):
        silu_and_mul(torch.ones(2, 8, dtype=torch.int64, device=DEVICE))


# -- the layers on the engine ---------------------------------------------------------------------------


def _config(backend: str, **kw) -> EngineConfig:
    return EngineConfig(fuse_projections=True, compile_layers=False, attention_backend=backend, max_model_len=128,
                        max_num_seqs=4, **kw)


@pytest.mark.parametrize("arch,backend", [("llama", "triton"), ("qwen2", "triton"), ("mistral", "triton"),
                                          ("llama", "torch")])
@pytest.mark.slow
def test_fused_layers_equal_stock_generate(tiny_model, arch, backend):
    """Llama; Qwen2 (q/k/v with bias); Mistral (a 48-token sliding window, prompts and outputs past it); on the
    Triton attention and on the torch one. Close gives the model its own layers and projections back."""
    model = tiny_model(arch, seed=21)
    prompts = random_prompts(3, 3, 60, seed=4)
    max_tokens = [8, 5, 12]
    refs = [stock_greedy(model, p, n)[0] for p, n in zip(prompts, max_tokens)]
    originals = [layer.get_submodule(p) for layer in decoder_layers(model) for p in PROJ]
    model.to(DEVICE)  # the fused layers' kernels: CUDA, else the interpreter
    try:
        with LLMEngine(model, engine_config=_config(backend)) as engine:
            assert engine.execution_plan.layers is LayerPath.FUSED
            assert all("forward" in vars(layer) for layer in decoder_layers(model))
            assert "forward" in vars(model.model.norm)
            assert all(isinstance(layer.get_submodule(p), FusedLinearSlice)
                       for layer in decoder_layers(model) for p in PROJ)
            assert engine_greedy(engine, prompts, max_tokens) == refs
    finally:
        model.cpu()
    assert [layer.get_submodule(p) for layer in decoder_layers(model) for p in PROJ] == originals
    assert all("forward" not in vars(m) for m in [*decoder_layers(model), model.model.norm])
    assert [stock_greedy(model, p, n)[0] for p, n in zip(prompts, max_tokens)] == refs


@pytest.mark.slow
def test_between_calls_the_model_is_stock_and_weight_updates_are_used():
    """The warm engine (``paged_generate``) with fused eager layers: between calls plain forwards and a training
    step equal a twin that never saw an engine; the next call generates with the updated weights."""
    model, twin = (make_tiny_model("llama", seed=22).to(DEVICE) for _ in range(2))
    prompts = random_prompts(3, 3, 40, seed=9)
    params = SamplingParams(temperature=0, max_tokens=6)
    got = [o.outputs[0].token_ids for o in paged_generate(model, prompts, params, engine_config=_config("triton"),
                                                          use_tqdm=False)]
    assert got == [stock_greedy(twin, p, 6)[0] for p in prompts]
    assert current_engine(model).execution_plan.layers is LayerPath.FUSED
    ids = torch.tensor([prompts[0]], device=DEVICE)
    assert torch.equal(model(ids).logits, twin(ids).logits)

    batch = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    losses = []
    for m in (model, twin):
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        loss = m(batch, labels=batch).loss
        loss.backward()
        opt.step()
        m.eval()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    want = [stock_greedy(twin, p, 6)[0] for p in prompts]
    assert want != got, "the step must change the greedy tokens for this test"
    again = [o.outputs[0].token_ids for o in paged_generate(model, prompts, params, engine_config=_config("triton"),
                                                            use_tqdm=False)]
    assert again == want
    release(model)
    assert torch.equal(model(ids).logits, twin(ids).logits)


def test_other_models_run_their_own_layers_by_default(tiny_model):
    """``fuse_projections=None`` with uncompiled layers: on the CPU the model's own forward; Gemma-2 (a layer class
    the fused layers do not cover) also on CUDA, where Llama's layers take them."""
    gemma, llama = tiny_model("gemma2", seed=23), tiny_model("llama", seed=23)
    prompts = random_prompts(2, 3, 30, seed=5)
    for model, fused in ((gemma, False), (llama, DEVICE.type == "cuda")):
        model.to(DEVICE)
        try:
            refs = [stock_greedy(model.cpu(), p, 6)[0] for p in prompts]
            model.to(DEVICE)
            config = EngineConfig(compile_layers=False, attention_backend="triton", max_model_len=64, max_num_seqs=2)
            with LLMEngine(model, engine_config=config) as engine:
                assert (engine.execution_plan.layers is LayerPath.FUSED) is fused
                assert engine_greedy(engine, prompts, [6, 6]) == refs
        finally:
            model.cpu()


def test_a_model_they_refuse_is_left_untouched(tiny_model):
    """``fuse_projections=True`` with uncompiled layers on a Llama whose gate_proj has a hook (which fusion leaves
    alone): a ValueError naming why, and no projection replaced or its weight moved to new storage."""
    model = tiny_model("llama", seed=25).to(DEVICE)
    handle = model.model.layers[1].mlp.gate_proj.register_forward_hook(lambda *a: None)
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    try:
        with pytest.raises(ValueError, match=r"cannot run this model: projections not fused: .*1\.mlp: hooks"):
            LLMEngine(model, engine_config=_config("triton"))
        assert {name: p.data_ptr() for name, p in model.named_parameters()} == weights
        assert not any(isinstance(m, FusedLinearSlice) for m in model.modules())
    finally:
        handle.remove()
        model.cpu()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the default on CUDA (decode graphs)")
def test_cuda_default_runs_fused_layers_and_compiles_the_layers_they_cannot_run(tiny_model):
    """``EngineConfig()`` on CUDA: Llama's layers run the fused eager forward in decode graphs, uncompiled; Gemma-2's
    (a class the fused layers do not cover) are compiled by Inductor. Both equal stock greedy."""
    prompts = random_prompts(2, 3, 30, seed=6)
    for arch, fused in (("llama", True), ("gemma2", False)):
        model = tiny_model(arch, seed=24)
        refs = [stock_greedy(model, p, 6)[0] for p in prompts]
        model.to(DEVICE)
        try:
            with LLMEngine(model, engine_config=EngineConfig(max_model_len=64, max_num_seqs=2)) as engine:
                assert engine.execution_plan.cuda_graphs
                assert engine.execution_plan.layers is (LayerPath.FUSED if fused else LayerPath.COMPILED), arch
                assert engine_greedy(engine, prompts, [6, 6]) == refs, arch
        finally:
            model.cpu()
