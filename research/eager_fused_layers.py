"""Eager Llama decoder layers with hand-fused kernels: how close a start without torch.compile gets to the compiled
layers' decode speed (issue 18: the first construction <= 10 s on empty compile caches).

Prepared on the CPU machine (kernels checked under the interpreter by ``research/test_eager_fused_layers.py``); not yet
timed on a GPU. On the H200 (2026-12-04, BENCHMARKS.md) the compiled engine decodes at 4.55 / 6.06 ms per step
(batch 1 / 64) and builds in 20.6-20.8 s on empty caches; the eager engine (``EngineConfig(compile_layers=False)``)
builds in 5 s but decodes at 7.0 / 9.05 ms: Inductor's fused elementwise kernels and the fused q|k|v and gate|up
projections (which need compiled layers) are the difference. This swaps each decoder layer's ``forward`` (Llama
shape: ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, SiLU, RMSNorms, rotate-half RoPE) for one that runs
vLLM's kernel sequence eagerly, inside the decode CUDA graphs:

    rms_norm(h) -> qkv GEMM (the GEMV at one row) -> rope(q, k) -> write K/V, paged attention -> o GEMM
    -> add + rms_norm (the residual sum kept) -> gate|up GEMM -> silu(gate) * up -> down GEMM -> add

six elementwise launches per layer (RoPE once for q, once for k), each rounding to the model dtype where the
eager transformers code does.

    python research/eager_fused_layers.py --out $OUT      # GPU: decode ms per step, compiled vs eager vs eager fused
    TRITON_INTERPRET=1 python research/eager_fused_layers.py --model tiny-llama --device cpu --out /tmp   # CPU smoke

The timed calls are ``paged_generate`` calls as in ``startup_profile.py``; every engine is built on empty Inductor /
Triton caches of its own (``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` are set per run by the script's caller,
or shared here: the construction times are then only comparable within a run).
"""

import argparse
import json
import time
import types

import torch
import triton
import triton.language as tl

# -- kernels ------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, D, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row: ``s = res + x`` (rounded to x's dtype, stored) when ``HAS_RESIDUAL``, else ``s = x``; then
    ``w * (s_fp32 * rsqrt(mean(s_fp32^2) + eps)).to(dtype)``, transformers' ``LlamaRMSNorm``."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=m, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    y = (xf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=m)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, I, BLOCK: tl.constexpr):
    """``silu(gate).to(dtype) * up`` of ``gu = [gate | up]`` (each ``I`` wide), rounded as the eager ops."""
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < I
    g = tl.load(gu_ptr + row * stride_gu + col, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + I + col, mask=m, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * stride_o + col, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` for the heads of one token, each product and the sum rounded to x's
    dtype as transformers' ``apply_rotary_pos_emb`` does; the output is contiguous ``[T, H, D]``."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mh = (h < num_heads)[:, None]
    base = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mh, other=0.0)
    x2 = tl.load(base + HALF, mask=mh, other=0.0)
    dt = x1.dtype
    c1 = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_ct + d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + d).to(tl.float32)[None, :]
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((x1f * c1).to(dt).to(tl.float32) + (-x2f * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)).to(dt)
    obase = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(obase, o1, mask=mh)
    tl.store(obase + HALF, o2, mask=mh)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``x [T, D]`` (unit stride on D), ``weight [D]``: the RMSNorm of ``x`` (of ``residual + x`` with a residual,
    returned with that sum). Returns ``out`` or ``(out, sum)``, ``[T, D]`` in x's dtype."""
    T, D = x.shape
    out = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else out
    r = residual if residual is not None else x
    _rms_norm_kernel[(T,)](x, r, weight, out, s, x.stride(0), r.stride(0), out.stride(0), s.stride(0), D, eps,
                           HAS_RESIDUAL=residual is not None, BLOCK_D=triton.next_power_of_2(D),
                           num_warps=8 if D >= 2048 else 4)
    return (out, s) if residual is not None else out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [T, 2 I]`` -> ``silu(gate) * up`` ``[T, I]``."""
    T, I2 = gate_up.shape
    I = I2 // 2
    out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(I, BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0), I, BLOCK=BLOCK,
                                                 num_warps=4)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` (unit stride on D, D a power of two), ``cos``/``sin`` ``[T, D]`` unit stride on D: the rotated
    heads, contiguous ``[T, H, D]``."""
    T, H, D = x.shape
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    BLOCK_H = min(triton.next_power_of_2(H), 8)
    _rope_kernel[(T, triton.cdiv(H, BLOCK_H))](x, cos, sin, out, H, x.stride(0), x.stride(1), cos.stride(0),
                                               out.stride(0), out.stride(1), HALF=D // 2, BLOCK_H=BLOCK_H, num_warps=4)
    return out


# -- the layer ----------------------------------------------------------------------------------------


def _linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """The projection as the compiled layers route it: the Triton GEMV at one CUDA row, cuBLAS otherwise."""
    return torch.ops.paged_transformers.linear(x, weight, bias)


def fused_layer_forward(layer, hidden_states, *args, position_embeddings=None, paged_metadata=None, **kwargs):
    """A Llama decoder layer on the paged engine, eagerly with the kernels above (module docstring). Needs the
    engine's ``paged_metadata`` (it is only installed on a model the engine is attached to) and the fused q|k|v and
    gate|up modules of ``paged_transformers.compilation.fusion``. Returns ``[1, T, hidden]``."""
    from paged_transformers.core import attention

    attn, mlp = layer.self_attn, layer.mlp
    md = paged_metadata if paged_metadata is not None else attention._step.metadata  # as paged_attention_forward
    x = hidden_states[0]  # [T, hidden]
    T = x.shape[0]
    h = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
    qkv_mod = attn.q_proj.fused
    qkv = _linear(h, qkv_mod.weight, qkv_mod.bias)  # [T, Nq + 2 Nk]
    D = attn.head_dim
    nq, nk = attn.q_proj.out_features, attn.k_proj.out_features
    cos, sin = position_embeddings  # [1, T, D] each
    q = rope(qkv[:, :nq].view(T, -1, D), cos[0], sin[0])
    k = rope(qkv[:, nq:nq + nk].view(T, -1, D), cos[0], sin[0])
    v = qkv[:, nq + nk:].view(T, -1, D)
    layer_idx = attn.layer_idx
    key_cache, value_cache = md.cache.key_cache[layer_idx], md.cache.value_cache[layer_idx]
    md.write_kv(k, v, key_cache, value_cache, md.slot_mapping)
    extra = {} if md.attend_plan is None else {"plan": md.attend_plan}
    o = md.attend(q, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, attn.scaling,
                  max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, **extra)  # [T, H, D]
    a = _linear(o.view(T, -1), attn.o_proj.weight, attn.o_proj.bias)
    h2, s = rms_norm(a, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                     residual=x)
    gu_mod = mlp.gate_proj.fused
    gu = _linear(h2, gu_mod.weight, gu_mod.bias)
    m = _linear(silu_mul(gu), mlp.down_proj.weight, mlp.down_proj.bias)
    return (s + m).unsqueeze(0)


def install(model) -> None:
    """Fuse q|k|v and gate|up (``fusion.fuse_projections``) and set ``fused_layer_forward`` on every decoder layer
    of ``model`` (a Llama attached to an engine with eager layers). For this measurement only: nothing undoes it."""
    from paged_transformers.compilation import fusion
    from paged_transformers.compilation.layers import decoder_layers

    handle = fusion.fuse_projections(model)
    assert handle.num_fused == 2 * len(decoder_layers(model)), handle.skipped
    for layer in decoder_layers(model):
        act = layer.mlp.act_fn  # transformers' SiLUActivation, or nn.SiLU in older releases
        assert isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation", act
        layer.forward = types.MethodType(fused_layer_forward, layer)


# -- measurement (GPU) ---------------------------------------------------------------------------------


def decode_ms(model, batch: int, new: int) -> float:
    """ms per decode step of ``paged_generate`` on ``batch`` random 128-token prompts, after one untimed call."""
    from paged_transformers import SamplingParams, paged_generate

    prompts = [torch.randint(0, 500, (128,)).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    paged_generate(model, prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    paged_generate(model, prompts, params, use_tqdm=False)
    return (time.perf_counter() - t0) / new * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--out", default=".")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (TRITON_INTERPRET=1, --model tiny-llama)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dtype, shapes = (torch.bfloat16, ((1, 128), (64, 64))) if cuda else (torch.float32, ((1, 4), (2, 4)))
    from paged_transformers import EngineConfig, SamplingParams, paged_generate, release
    from paged_transformers.bench.workload import build_model
    from paged_transformers.integration.warm import attached_engine, engine_for

    model = build_model(args.model, dtype, args.device)
    prompts = [torch.randint(0, 500, (64,)).tolist() for _ in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    report = {}
    for variant in ("eager", "eager_fused", "compiled"):
        t0 = time.perf_counter()
        engine = engine_for(model, engine_config=EngineConfig(compile_layers=variant == "compiled"))
        report[f"{variant}_construction_s"] = time.perf_counter() - t0
        if variant == "eager_fused":
            with attached_engine(model):
                install(model)
        t0 = time.perf_counter()
        outs = paged_generate(model, prompts, greedy, use_tqdm=False)
        report[f"{variant}_first_call_s"] = time.perf_counter() - t0
        report[f"{variant}_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        for batch, new in shapes:
            report[f"{variant}_b{batch}_ms_per_step"] = decode_ms(model, batch, new)
        print(variant, {k: round(v, 2) for k, v in report.items() if k.startswith(variant) and isinstance(v, float)},
              flush=True)
        release(model)
        del engine
        if variant == "eager_fused":  # the model keeps the fused forwards: a fresh one for the compiled engine
            import gc

            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            model = build_model(args.model, dtype, args.device)
    ref = report["compiled_tokens"]
    for variant in ("eager", "eager_fused"):  # bf16 near-ties of random weights: informational
        report[f"{variant}_first_token_agreement_with_compiled"] = sum(
            a[:1] == b[:1] for a, b in zip(report[f"{variant}_tokens"], ref)) / len(ref)
    with open(f"{args.out}/eager_fused_layers.json", "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("_tokens")}, indent=1))


if __name__ == "__main__":
    main()
