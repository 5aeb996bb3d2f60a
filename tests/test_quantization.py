"""Native GPTQ / AWQ loading against the fixtures in ``<repo>/../shared/fixtures`` (checkpoints written
by GPTQModel 7.6 and AutoAWQ 0.2.9, goldens computed by those libraries in float32; see its README).

Tolerances on the top-50 last-position logits (max abs difference, logits are at most ~4 here):

* float32 (the reference path dequantizes exactly): ``2e-4``. An independent fp32 loader lands
  within 5e-5 of the goldens (README section 4) and ours within 5e-6; what is left is float32
  summation order (~1e-6 relative) through 2-30 layers.
* float16 activations: ``0.03`` = 15 fp16 unit roundoffs (u = 2^-11) times max|logit| = 4; the output
  cast alone is worth 4u|logit| = 0.008 and a handful of roundings per layer add up in the residual
  stream. Measured: <= 0.0094.
* bfloat16 activations (fp16 scales converted in the kernel / reference): ``0.15``, the same 10-15 u
  with u = 2^-8. Measured: <= 0.065 (GPTQModel's own bf16-scale path lands within 0.044).

Greedy tokens: random tiny models have near ties (top-2 margins down to 1e-4), so tokens are compared
exactly up to the first step whose golden margin is below twice the tolerance; beyond that, and for
fp16/bf16, a teacher-forced pass checks every golden token's logit is within the tolerance of its
row's maximum (README section 5).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from paged_transformers import SamplingParams, load_model, paged_generate
from paged_transformers.core.execution_plan import LayerPath
from paged_transformers.quantization import (
    QuantizationConfig,
    QuantLinear,
    build_random_quantized_model,
    dequantize_awq,
    dequantize_gptq,
)

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
MODELS = FIXTURES / "models"
pytestmark = pytest.mark.skipif(not MODELS.is_dir(), reason=f"fixtures folder {FIXTURES} (../shared/fixtures beside the repo) is missing")

TINY = [
    "tiny-llama-fp16",
    "tiny-qwen2-fp16",
    "tiny-llama-gptq-4bit-g32-actorder-asym",
    "tiny-qwen2-gptq-4bit-perchannel-sym",
    "tiny-llama-gptq-8bit-g64",
    "tiny-llama-awq-4bit-g64-gemm",
    "tiny-qwen2-awq-4bit-g128-gemm",
]
QUANTIZED = [n for n in TINY if "fp16" not in n] + ["smollm2-135m-instruct-gptq-4bit-g64"]
SMOLLM2 = "smollm2-135m-instruct-gptq-4bit-g64"
TOL = {torch.float32: 2e-4, torch.float16: 0.03, torch.bfloat16: 0.15}


def golden(name: str) -> dict:
    with open(MODELS / name / "golden.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def models():
    """``models(name, dtype)``: loaded once per (name, dtype) for this module, on CPU."""
    cache = {}

    def get(name, dtype=torch.float32):
        if (name, dtype) not in cache:
            cache[(name, dtype)] = load_model(MODELS / name, dtype=dtype, device="cpu")
        return cache[(name, dtype)]

    return get


@pytest.fixture
def load_released():
    """``load_released(name, dtype, device)``: a fixture model loaded for this test; after it, the model's warm engine
    (``paged_generate``'s) is released, so its KV pool, sized to most of a GPU, is free for the next test's engine."""
    from paged_transformers import release

    loaded = []

    def get(name, dtype, device):
        loaded.append(load_model(MODELS / name, dtype=dtype, device=device))
        return loaded[-1]

    yield get
    for model in loaded:
        release(model)


# -- helpers --------------------------------------------------------------------------------------


def top50_max_diff(model, prompt_ids, top50) -> float:
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids], device=device)).logits[0, -1].float().cpu()
    ids = torch.tensor([t for t, _ in top50])
    vals = torch.tensor([v for _, v in top50])
    return float((logits[ids] - vals).abs().max())


def teacher_forced_gap(model, prompt_ids, new_tokens) -> float:
    """Max over steps of (row max - logit of the golden token), one forward over prompt + golden tokens."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + new_tokens], device=device)).logits[0].float().cpu()
    rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(new_tokens)]
    return float((rows.max(-1).values - rows[torch.arange(len(new_tokens)), torch.tensor(new_tokens)]).max())


def assert_tokens_match(got, want, margins, tol, what):
    """Exact up to the first step whose golden top-2 margin is below 2 * tol (a legitimate flip)."""
    n = next((i for i, m in enumerate(margins) if m < 2 * tol), len(want))
    assert got[:n] == want[:n], f"{what}: {got} != golden {want} (compared the first {n} steps)"
    if n == len(want):
        assert got == want, f"{what}: {got} != golden {want}"


def greedy_generate(model, prompt_ids, max_new_tokens=24, ignore_eos=False):
    """Stock ``model.generate`` as the goldens ran it (tiny models: ``eos_token_id=None``)."""
    kwargs = {"eos_token_id": None} if ignore_eos else {}
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, use_cache=True, **kwargs)
    return out[0, len(prompt_ids) :].tolist()


# -- config parsing and loading errors -------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg,named",
    [
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}, "gptq_v2"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "marlin"),
        ({"quant_method": "gptq", "bits": 3}, "3-bit"),
        ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "exllama"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
        ({"quant_method": "exl2", "bits": 4}, "exl2"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
    ],
)
def test_unsupported_formats_raise_naming_them(tmp_path, cfg, named):
    with pytest.raises(NotImplementedError, match=named):
        QuantizationConfig.from_dict(cfg)
    config = json.loads((MODELS / "tiny-llama-gptq-8bit-g64" / "config.json").read_text())
    config["quantization_config"] = cfg
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match=named):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def test_shape_mismatch_names_the_tensor(tmp_path):
    src = MODELS / "tiny-llama-gptq-8bit-g64"
    for f in ("config.json", "quantize_config.json"):
        shutil.copy(src / f, tmp_path / f)
    tensors = load_file(src / "model.safetensors")
    bad = "model.layers.1.mlp.down_proj.scales"
    tensors[bad] = tensors[bad][:, :-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
        load_model(tmp_path, dtype=torch.float32, device="cpu")
    tensors = load_file(src / "model.safetensors")
    bad = "model.norm.weight"
    tensors[bad] = tensors[bad][:-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def test_quantize_config_json_alone(tmp_path, models):
    """Older checkpoints carry only quantize_config.json: same model as with quantization_config."""
    src = MODELS / "tiny-llama-gptq-4bit-g32-actorder-asym"
    for f in ("quantize_config.json", "model.safetensors"):
        shutil.copy(src / f, tmp_path / f)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    a, b = load_model(tmp_path, dtype=torch.float32, device="cpu"), models(src.name)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        assert torch.equal(a(ids).logits, b(ids).logits)


# -- packed formats ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", QUANTIZED)
def test_layer0_dequantization_is_exact(name, models):
    """Both our checkpoint decoder and the loaded QuantLinear (kernel layout, act-order rows permuted)
    reproduce layer0_dequant_fp32.safetensors bit for bit."""
    ref = load_file(MODELS / name / "layer0_dequant_fp32.safetensors")
    ckpt = load_file(MODELS / name / "model.safetensors")
    cfg = json.loads((MODELS / name / "config.json").read_text())["quantization_config"]
    model = models(name) if name != SMOLLM2 else None
    assert ref
    for key, want in ref.items():
        prefix = key[: -len(".weight")] if key.endswith(".weight") else key
        t = {s: ckpt[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales")}
        if cfg["quant_method"] == "gptq":
            got = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], ckpt[f"{prefix}.g_idx"], cfg["bits"])
        else:
            got = dequantize_awq(t["qweight"], t["qzeros"], t["scales"], cfg["group_size"])
        assert torch.equal(got, want), key
        if model is not None:
            module = model.get_submodule(prefix)
            assert isinstance(module, QuantLinear)
            assert torch.equal(module.dequantize(), want), key


@pytest.mark.parametrize("method,bits", [("awq", 4), ("gptq", 4), ("gptq", 8)])
def test_conversion_in_chunks_is_exact(method, bits, monkeypatch):
    """The kernel layout converted a few rows at a time (AWQ; GPTQ act-order), the last chunk short, dequantizes
    to what the checkpoint decoders give for the whole layer."""
    from paged_transformers.kernels.w4a16.reference import dequantize_packed
    from paged_transformers.quantization import formats

    K, N, gs = 192, 48, 32
    pack = 32 // bits
    monkeypatch.setattr(formats, "CHUNK_VALUES", 5 * pack * N)  # 5 words of rows a chunk: 192 / 40 -> 4 + a short one
    gen = torch.Generator().manual_seed(3)
    scales = (torch.rand(K // gs, N, generator=gen) + 0.5).half()
    word = lambda *shape: torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int32)  # noqa: E731
    if method == "awq":
        qweight, qzeros = word(K, N // 8), word(K // gs, N // 8)
        packed = formats.awq_to_kernel_layout(qweight, qzeros, scales, gs)
        want = dequantize_awq(qweight, qzeros, scales, gs)
    else:
        qweight, qzeros = word(K // pack, N), word(K // gs, N // pack)
        g_idx = (torch.arange(K) // gs)[torch.randperm(K, generator=gen)].to(torch.int32)
        packed = formats.gptq_to_kernel_layout(qweight, qzeros, scales, g_idx, bits, gs)
        want = dequantize_gptq(qweight, qzeros, scales, g_idx, bits)
        assert packed.perm is not None
        want = want[:, packed.perm]  # kernel row k is input feature perm[k]
    got = dequantize_packed(packed.qweight, packed.scales, packed.zeros, bits, gs).t()
    assert torch.equal(got, want)


def test_act_order_is_reordered_once_at_load(models):
    model = models("tiny-llama-gptq-4bit-g32-actorder-asym")
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.perm is not None and sorted(q_proj.perm.tolist()) == list(range(q_proj.in_features))
    assert models("tiny-llama-gptq-8bit-g64").model.layers[0].self_attn.q_proj.perm is None


@pytest.mark.parametrize("name", QUANTIZED[:-1])
def test_unquantized_modules_stay_plain(name, models):
    model = models(name)
    assert type(model.lm_head) is nn.Linear
    quant = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 7 * model.config.num_hidden_layers
    assert not any(type(m) is nn.Linear for n, m in model.named_modules() if n.startswith("model.layers"))


# -- goldens: tiny models -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_tiny_golden_fp32(name, models):
    model, g = models(name), golden(name)
    tol = TOL[torch.float32]
    assert any(isinstance(m, QuantLinear) for m in model.modules()) == ("fp16" not in name)
    for i, (prompt, want, top50, margins) in enumerate(
        zip(g["prompts"], g["greedy_new_tokens"], g["last_logits_top50"], g["greedy_step_top2_margin"])
    ):
        ids = prompt["input_ids"]
        assert top50_max_diff(model, ids, top50) < tol, f"prompt {i}"
        assert teacher_forced_gap(model, ids, want) < tol, f"prompt {i}"
        assert_tokens_match(greedy_generate(model, ids, ignore_eos=True), want, margins, tol, f"generate, prompt {i}")
    outs = paged_generate(model, [p["input_ids"] for p in g["prompts"]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for i, (out, want, margins) in enumerate(zip(outs, g["greedy_new_tokens"], g["greedy_step_top2_margin"])):
        assert_tokens_match(list(out.outputs[0].token_ids), want, margins, tol, f"paged_generate, prompt {i}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny-llama-gptq-4bit-g32-actorder-asym", "tiny-qwen2-awq-4bit-g128-gemm", "tiny-llama-gptq-8bit-g64"])
def test_tiny_golden_half_precision(name, dtype, models):
    """fp16-declared checkpoints run in fp16 and in bf16 (fp16 scales converted, no warning needed)."""
    model, g = models(name, dtype), golden(name)
    assert model.model.layers[0].mlp.up_proj.scales.dtype == torch.float16
    assert model.model.embed_tokens.weight.dtype == dtype
    for i, (prompt, want, top50) in enumerate(zip(g["prompts"], g["greedy_new_tokens"], g["last_logits_top50"])):
        assert top50_max_diff(model, prompt["input_ids"], top50) < TOL[dtype], f"prompt {i}"
        assert teacher_forced_gap(model, prompt["input_ids"], want) < TOL[dtype], f"prompt {i}"


@pytest.mark.parametrize("name", ["tiny-llama-gptq-4bit-g32-actorder-asym", "tiny-llama-gptq-8bit-g64", "tiny-qwen2-awq-4bit-g128-gemm"])
@pytest.mark.slow
def test_tiny_golden_on_the_kernel(name, monkeypatch, load_released):
    """Every ``QuantLinear`` on the Triton W4A16 kernel with its default configs, against the goldens: the prompt's
    rows (M > 1) and then each decode step alone (M = 1: the GEMV). With CUDA: fp16 on the GPU, where ``QuantLinear``
    takes the kernel itself (directly; through its custom op in compiled layers). Without: fp32 under the
    interpreter, with the reference that ``QuantLinear`` calls off CUDA swapped for the kernel (and its CPU weight
    cache off), counting the calls."""
    import paged_transformers.quantization.linear as quant_linear
    from paged_transformers.kernels.w4a16 import w4a16_matmul

    cuda = torch.cuda.is_available()
    dtype, device = (torch.float16, "cuda") if cuda else (torch.float32, "cpu")
    calls = {"M = 1": 0, "M > 1": 0}

    def kernel(x, qweight, scales, zeros, bits, group_size, bias=None):
        calls["M = 1" if x.shape[0] == 1 else "M > 1"] += 1
        return w4a16_matmul(x, qweight, scales, zeros, bits, group_size, bias)

    if not cuda:
        monkeypatch.setattr(quant_linear, "w4a16_matmul_ref", kernel)
    model = load_released(name, dtype, device)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.cache_dequantized_on_cpu = False
    g, tol, steps = golden(name), TOL[dtype], 4
    ids, want, margins = g["prompts"][0]["input_ids"], g["greedy_new_tokens"][0][:steps], g["greedy_step_top2_margin"][0][:steps]
    assert top50_max_diff(model, ids, g["last_logits_top50"][0]) < tol
    out = paged_generate(model, [ids], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    assert_tokens_match(list(out[0].outputs[0].token_ids), want, margins, tol, "paged_generate on the kernel")
    if not cuda:
        assert calls["M = 1"] > 0 and calls["M > 1"] > 0, calls


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs a Hopper (sm_90) GPU: W4A16Algo.WGMMA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny-llama-awq-4bit-g64-gemm", "tiny-qwen2-awq-4bit-g128-gemm",
                                  "tiny-qwen2-gptq-4bit-perchannel-sym"])
def test_tiny_goldens_on_wgmma(name, dtype, monkeypatch, load_released):
    """Every W4A16 matmul on ``W4A16Algo.WGMMA`` whatever its M (the prompts' rows, each decode step, the engine's
    fused projections and CUDA graphs), fp16 and bf16, against the goldens: the 4-bit fixtures whose groups hold
    whole K steps of 64 rows (act-order g32 cannot: a K step would span two groups; 8-bit is not WGMMA's)."""
    import paged_transformers.kernels.w4a16.matmul as matmul
    import paged_transformers.quantization.linear as quant_linear
    from paged_transformers.kernels.w4a16 import W4A16Algo, W4A16Config

    config = W4A16Config(64, 64, 64, 1, 4, 3, W4A16Algo.WGMMA)
    product, rows = matmul.w4a16_matmul, []

    def on_wgmma(x, qweight, scales, zeros, bits, group_size, bias=None, config=config):
        rows.append(x.shape[0])
        return product(x, qweight, scales, zeros, bits, group_size, bias, config)

    monkeypatch.setattr(matmul, "w4a16_matmul", on_wgmma)  # the custom op (compiled layers) calls this module global
    monkeypatch.setattr(quant_linear, "w4a16_matmul", on_wgmma)  # and QuantLinear its own import, eagerly
    model = load_released(name, dtype, "cuda")
    g, tol = golden(name), TOL[dtype]
    prompts = [p["input_ids"] for p in g["prompts"]]
    for i, (ids, top50, want) in enumerate(zip(prompts, g["last_logits_top50"], g["greedy_new_tokens"])):
        assert top50_max_diff(model, ids, top50) < tol, f"prompt {i}"
        assert teacher_forced_gap(model, ids, want) < tol, f"prompt {i}"
    assert min(rows) > 1 and len(rows) > 0  # the forwards went through it
    rows.clear()
    outs = paged_generate(model, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for i, (out, want, margins) in enumerate(zip(outs, g["greedy_new_tokens"], g["greedy_step_top2_margin"])):
        assert_tokens_match(list(out.outputs[0].token_ids), want[:8], margins[:8], tol, f"paged_generate, prompt {i}")
    assert 1 in rows, rows  # decode steps (graph captures) too


@pytest.mark.parametrize("name", ["tiny-llama-gptq-4bit-g32-actorder-asym", "tiny-qwen2-awq-4bit-g128-gemm",
                                  "tiny-qwen2-gptq-4bit-perchannel-sym"])
@pytest.mark.slow
def test_tiny_goldens_on_the_fused_eager_layers(name, models):
    """The fused eager layers (``compilation/fused_layers.py``) over fused ``QuantLinear`` q|k|v and gate|up (GPTQ
    act-order, AWQ, per-channel) against the goldens, every prompt: fp32 on the CPU (interpreter, asked for with
    ``fuse_projections=True``), fp16 on CUDA (the default for uncompiled layers)."""
    from paged_transformers import EngineConfig, LLMEngine

    cuda = torch.cuda.is_available()
    dtype = torch.float16 if cuda else torch.float32
    model = load_model(MODELS / name, dtype=dtype, device="cuda") if cuda else models(name)
    g, tol = golden(name), TOL[dtype]
    prompts = [p["input_ids"] for p in g["prompts"]]
    config = EngineConfig(compile_layers=False, fuse_projections=None if cuda else True, attention_backend="triton",
                          max_model_len=128, max_num_seqs=4)
    with LLMEngine(model, engine_config=config) as engine:
        assert engine.execution_plan.layers is LayerPath.FUSED
        assert engine.runner.compilation.fusion.num_fused == 2 * model.config.num_hidden_layers
        for i, (ids, want) in enumerate(zip(prompts, g["greedy_new_tokens"])):  # the goldens ignore EOS
            engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True))
        got = {}
        while engine.has_unfinished_requests():
            got.update((out.request_id, out.outputs[0].token_ids) for out in engine.step() if out.finished)
    for i, (want, margins) in enumerate(zip(g["greedy_new_tokens"], g["greedy_step_top2_margin"])):
        assert_tokens_match(list(got[str(i)]), want, margins, tol, f"fused eager layers, prompt {i}")


# -- goldens: SmolLM2 ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_gptq_golden_and_paris(models):
    model, g = models(SMOLLM2), golden(SMOLLM2)
    tol = TOL[torch.float32]
    prompts = [p["input_ids"] for p in g["prompts"]]
    for i, (ids, want, top50) in enumerate(zip(prompts, g["greedy_new_tokens"], g["last_logits_top50"])):
        assert top50_max_diff(model, ids, top50) < tol, f"prompt {i}"
    # plain generate on the first prompt ("The capital of France is"), the engine on all three
    assert_tokens_match(greedy_generate(model, prompts[0]), g["greedy_new_tokens"][0], g["greedy_step_top2_margin"][0], tol, "generate")
    outs = paged_generate(model, prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for i, (out, want, margins) in enumerate(zip(outs, g["greedy_new_tokens"], g["greedy_step_top2_margin"])):
        assert_tokens_match(list(out.outputs[0].token_ids), want, margins, tol, f"paged_generate, prompt {i}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODELS / SMOLLM2)
    assert g["prompts"][0]["text"] == "The capital of France is"
    assert tokenizer("The capital of France is")["input_ids"] == prompts[0]
    text = tokenizer.decode(outs[0].outputs[0].token_ids)
    assert text.lstrip().startswith("Paris"), text


# -- random quantized models (benchmarks) -------------------------------------------------------------


@pytest.mark.parametrize("method,bits,group_size,desc_act", [("gptq", 4, 32, True), ("gptq", 8, -1, False), ("awq", 4, 32, False)])
def test_build_random_quantized_model_equals_dequantized_plain_model(method, bits, group_size, desc_act):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    qmodel = build_random_quantized_model(cfg, method, bits, group_size, torch.float32, "cpu", seed=1, desc_act=desc_act)
    assert isinstance(qmodel.model.layers[1].self_attn.k_proj, QuantLinear) and type(qmodel.lm_head) is nn.Linear
    assert (qmodel.model.layers[0].self_attn.q_proj.perm is not None) == desc_act
    # the independent reference: a stock model holding the dequantized weights
    plain = Qwen2ForCausalLM(cfg).eval()
    state = {}
    for name, module in qmodel.named_modules():
        if isinstance(module, QuantLinear):
            state[f"{name}.weight"] = module.dequantize()
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias
    state.update({n: p for n, p in qmodel.named_parameters()})
    plain.load_state_dict(state, strict=True)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        a, b = qmodel(ids).logits, plain(ids).logits
    assert float((a - b).abs().max()) < 1e-4 * float(b.abs().max())
    outs = paged_generate(qmodel, [ids[0].tolist()], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4


@pytest.mark.slow
def test_compiled_layers_with_quant_linear_match_stock_generate():
    # EngineConfig(compile_layers=True) on CPU: QuantLinear's reference path is traced into the layer graphs
    # (its weight cache would break them); greedy tokens must equal stock generate() of the same model, eager
    from conftest import engine_greedy, stock_greedy
    from transformers import LlamaConfig

    from paged_transformers import EngineConfig, LLMEngine

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    model = build_random_quantized_model(cfg, "gptq", 4, 32, torch.float32, "cpu", seed=2, desc_act=True)
    prompts, max_tokens = [[3, 14, 15, 92, 65, 35], [7, 1, 8]], [6, 4]
    refs = [stock_greedy(model, p, n)[0] for p, n in zip(prompts, max_tokens)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    config = EngineConfig(compile_layers=True, attention_backend="torch", max_model_len=64, max_num_seqs=2)
    with LLMEngine(model, engine_config=config) as engine:
        assert engine.execution_plan.layers is LayerPath.COMPILED
        got = engine_greedy(engine, prompts, max_tokens)
    assert got == refs
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # the layers ran through Dynamo


def test_quant_linear_compiles_without_graph_breaks_on_cpu():
    # fullgraph=True raises on any graph break (the CPU weight cache, keyed on data_ptr(), would cause one)
    lin = QuantLinear(64, 32, 4, 32, bias=True, act_order=True, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        lin.qweight.copy_(torch.randint(-(2**31), 2**31, lin.qweight.shape, dtype=torch.int32, generator=g))
        lin.scales.copy_(torch.rand(lin.scales.shape, generator=g) * 0.01)
        lin.zeros.copy_(torch.randint(0, 17, lin.zeros.shape, generator=g))
        lin.perm.copy_(torch.randperm(64, generator=g))
        lin.bias.copy_(torch.randn(32, generator=g))
    x = torch.randn(3, 64, generator=g)
    ref = x @ lin.dequantize().t() + lin.bias  # independent: original input order, no permuted gather
    assert float((lin(x) - ref).abs().max()) < 1e-5
    torch._dynamo.reset()
    compiled = torch.compile(lin, fullgraph=True, backend="eager")
    assert float((compiled(x) - ref).abs().max()) < 1e-5


def test_dtype_auto_is_the_checkpoints(models):
    """``dtype="auto"`` (as ``from_pretrained`` takes it) used to raise ValueError: the config's fp16 here."""
    name = "tiny-llama-gptq-4bit-g32-actorder-asym"
    auto = load_model(MODELS / name, dtype="auto", device="cpu")
    fp16 = models(name, torch.float16)
    assert auto.model.embed_tokens.weight.dtype == torch.float16
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        assert torch.equal(auto(ids).logits, fp16(ids).logits)
