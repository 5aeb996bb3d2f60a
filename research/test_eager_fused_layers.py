"""``research/eager_fused_layers.py``: its kernels against the transformers ops they replace, and its decoder layer
on the paged engine against stock ``generate()`` (fp32 greedy tokens). Without CUDA the kernels and the engine's
Triton attention run in Triton's interpreter: ``pytest research/test_eager_fused_layers.py`` (CPU, about a minute)."""

import importlib.util
import os
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb  # noqa: E402

_PATH = pathlib.Path(__file__).resolve().parent / "eager_fused_layers.py"
_spec = importlib.util.spec_from_file_location("eager_fused_layers", _PATH)
efl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(efl)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 96])
def test_rms_norm_with_and_without_residual(dtype, D):
    g = torch.Generator().manual_seed(D)
    x, r = (torch.randn(5, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    norm = LlamaRMSNorm(D, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=g))
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(efl.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x), **tol)
        out, s = efl.rms_norm(x, norm.weight, norm.variance_epsilon, residual=r)
    assert torch.equal(s, r + x)
    torch.testing.assert_close(out, norm(r + x), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(3, 2 * 1500, generator=g).to(DEVICE, dtype)  # I off the 1024 block
    want = torch.nn.functional.silu(gu[:, :1500]) * gu[:, 1500:]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(efl.silu_mul(gu), want, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_of_strided_heads(dtype):
    g = torch.Generator().manual_seed(1)
    T, H, D = 4, 11, 16  # H off the 8-head block
    qkv = torch.randn(T, H * D + 8, generator=g).to(DEVICE, dtype)  # heads as a column slice, as in the layer
    x = qkv[:, 8:].view(T, H, D)
    cos, sin = (torch.randn(T, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    # transformers' layout: [B, H, T, D] heads, [B, T, D] cos/sin
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    got = efl.rope(x, cos, sin)
    assert got.is_contiguous()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, want[0].transpose(0, 1), **tol)


def test_layer_on_the_engine_equals_stock_generate(monkeypatch):
    from paged_transformers import EngineConfig, SamplingParams, paged_generate, release
    from paged_transformers.integration.warm import attached_engine

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).to(DEVICE).eval()
    prompts = [[3, 17, 5, 9, 1, 44, 2], [7, 7, 60, 21]]
    stock = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=6, do_sample=False, min_new_tokens=6)
        stock.append(out[0, len(p):].tolist())
    engine_config = EngineConfig(attention_backend="triton", compile_layers=False, max_model_len=64, block_size=16)
    paged_generate(model, prompts[:1], SamplingParams(temperature=0, max_tokens=1), engine_config=engine_config,
                   use_tqdm=False)  # builds the warm engine
    with attached_engine(model):
        efl.install(model)
    calls = []
    rope = efl.rope
    monkeypatch.setattr(efl, "rope", lambda *a: calls.append(1) or rope(*a))  # the fused layers really ran
    outs = paged_generate(model, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    release(model)
    assert len(calls) == 2 * 2 * 6  # q and k, 2 layers, 6 steps (the two prompts batched)
    assert [list(o.outputs[0].token_ids) for o in outs] == stock
