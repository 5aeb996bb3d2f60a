"""In-place weight changes between calls reach the next call, whatever wrote them (``core/weights.py``).

Each engine case: the patched ``generate()`` with prefix caching on (the default) runs a prompt whose first two
blocks the prefix cache keeps, the weights change, and the same prompt again gives stock ``generate()``'s tokens
and scores on the new weights. The changes: writes through ``.data`` (``add_``, ``copy_``, ``torch.nn.init``), a
merged peft LoRA adapter, and a real training step of AdamW (fused, foreach, default), Adam (fused) and SGD, with
the CPU weight packs on and off (``EngineConfig.cpu_prepack_weights``). Writes through ``.data`` and the fused
optimizers leave the version counters alone, so only the checksums (``kernels.checksum``) see them. The CUDA
variants skip without a GPU.

Also the checksum against an independent reference (Python integers over the raw bits): a permutation, one changed
element and a sign flip change it; the Triton kernel (interpreted on the CPU) equals the PyTorch reference.
"""

import copy

import numpy as np
import pytest
import torch

import paged_transformers
from conftest import make_tiny_model, random_prompts
from paged_transformers import EngineConfig
from paged_transformers.core.weights import WeightsChange, WeightsFingerprint, WeightsSnapshot
from paged_transformers.integration.warm import current_engine
from paged_transformers.kernels.checksum import K, checksums, checksums_ref, chunk_table

PROMPT = random_prompts(1, 40, 40, seed=11)[0]  # 40 tokens: two full blocks of 16 kept by the prefix cache
BATCH = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# -- the checksum ----------------------------------------------------------------------------------------------
def python_checksum(words: torch.Tensor) -> int:
    """``sum(w_i * (i * K + 1)) mod 2**64`` as a signed int64, with Python integers."""
    total = 0
    for i, w in enumerate(np.asarray(words.cpu()).astype(np.int64).tolist()):
        total += w * (i * K + 1)
    total %= 1 << 64
    return total - (1 << 64) if total >= 1 << 63 else total


def test_checksum_against_python_integers_and_the_kernel():
    g = torch.Generator().manual_seed(0)
    words = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g) for n in (1, 15, 16, 17, 0, 99)]
    expected = [python_checksum(w) for w in words]
    assert checksums_ref(words, chunk=16).tolist() == expected
    assert checksums_ref(words).tolist() == expected
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (conftest)
    on_device = [w.to(device) for w in words]
    for chunk in (16, 32):
        assert checksums(on_device, chunk_table(on_device, chunk)).tolist() == expected


def test_checksum_sees_a_permutation_one_element_and_a_sign_flip():
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    base = python_checksum(x.view(torch.int32))
    swapped = x.clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    negated = x.clone()
    negated[[5, 6]] = -negated[[6, 5]]  # equal magnitudes, moved and sign-flipped: a plain sum of |x| is unchanged
    one = x.clone()
    one[17] = torch.nextafter(one[17], torch.tensor(float("inf")))  # the last bit of one element
    flipped = x.clone()
    flipped[9] = -flipped[9]
    variants = [swapped, negated, one, flipped, x.flip(0)]
    got = checksums_ref([v.view(torch.int32) for v in [x] + variants]).tolist()
    assert got[0] == base and got[1:] == [python_checksum(v.view(torch.int32)) for v in variants]
    assert len(set(got)) == len(got)


def test_fingerprint_sees_writes_the_version_counters_miss():
    model = make_tiny_model("llama", seed=31)
    snapshot, before = WeightsSnapshot.take(model), WeightsFingerprint.take(model)
    assert before.compare(WeightsFingerprint.take(model, before)) == ""
    weight = model.model.layers[1].mlp.down_proj.weight
    weight.data.copy_(weight.data.flip(0))  # a row permutation through .data: no version bump
    assert snapshot.compare(model) == (WeightsChange.NONE, "")
    assert before.compare(WeightsFingerprint.take(model)) == "model.layers.1.mlp.down_proj.weight: values changed in place (checksum)"
    assert before.compare(before.again()) == "model.layers.1.mlp.down_proj.weight: values changed in place (checksum)"
    assert before.again().compare(before.again()) == ""  # what attach() runs: the same storages, read again
    odd = torch.nn.Module()
    odd.register_buffer("mask", torch.ones(7, dtype=torch.bool))  # 7 bytes: a padded word
    first = WeightsFingerprint.take(odd)
    odd.mask.data[6] = False
    assert first.compare(WeightsFingerprint.take(odd)) == "mask: values changed in place (checksum)"
    assert first.compare(first.again()) == "mask: values changed in place (checksum)"  # padded words made again


# -- the engine between calls -----------------------------------------------------------------------------------
def _perturb(model, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.data.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * scale)


def _copy_other(model) -> None:
    other = make_tiny_model("llama", seed=40).to(next(model.parameters()).device)
    for p, q in zip(model.parameters(), other.parameters()):
        p.data.copy_(q.data)


def _init_normal(model) -> None:
    torch.manual_seed(41)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight.data, std=0.15)


def _merge_lora(model) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)  # B random, not zero: the merged delta is not zero
    torch.manual_seed(42)
    merged = peft.get_peft_model(model, config).merge_and_unload()
    assert merged is model


def _train_step(optimizer_cls, **kwargs):
    def step(model) -> None:
        optimizer = optimizer_cls(model.parameters(), **kwargs)
        model.train()
        for _ in range(2):
            optimizer.zero_grad()
            model(BATCH.to(model.device), labels=BATCH.to(model.device)).loss.backward()
            optimizer.step()
        model.eval()
        model.zero_grad(set_to_none=True)

    return step


CHANGES = {
    "data_add": lambda m: _perturb(m, 0.05, seed=43),
    "data_copy": _copy_other,
    "init_normal_data": _init_normal,
    "peft_merge_and_unload": _merge_lora,
    "adamw_fused": _train_step(torch.optim.AdamW, lr=0.02, fused=True),
    "adamw_foreach": _train_step(torch.optim.AdamW, lr=0.02, foreach=True),
    "adamw_default": _train_step(torch.optim.AdamW, lr=0.02),
    "adam_fused": _train_step(torch.optim.Adam, lr=0.02, fused=True),
    "sgd": _train_step(torch.optim.SGD, lr=2.0),
}


def _generate(model):
    ids = torch.tensor([PROMPT], device=model.device)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          return_dict_in_generate=True, output_scores=True)


def _check_second_call(model, change, config: EngineConfig) -> None:
    """Patched call, ``change(model)``, the same patched call: stock's tokens and scores on the new weights."""
    before = copy.deepcopy(model)  # the old weights, for checking that the change changes the greedy output
    with paged_transformers.patch(engine_config=config):
        _generate(model)
        engine = current_engine(model)
        hits = engine.stats().num_cached_tokens
        change(model)
        got = _generate(model)
        assert current_engine(model) is engine  # written in place: the same engine
        assert engine.stats().num_cached_tokens == hits  # the prefix cache was dropped: no hit on stale K/V
    expected = _generate(model)  # stock generate() on the new weights
    assert not torch.equal(_generate(before).sequences, expected.sequences), "the change must move the greedy output"
    assert torch.equal(got.sequences, expected.sequences)
    for x, y in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prepack", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_between_calls_reaches_the_next_call(change, prepack):
    model = make_tiny_model("llama", seed=30)
    if change == "adamw_fused":  # the case the version counters miss
        probe = copy.deepcopy(model)
        version = probe.lm_head.weight._version
        CHANGES[change](probe)
        assert probe.lm_head.weight._version == version
    _check_second_call(model, CHANGES[change], EngineConfig(cpu_prepack_weights=prepack))


def test_packs_are_used_and_rebuilt_after_a_data_write():
    """With packing on, the first call reads packed weights; a write through ``.data`` drops them, and they are
    made again from the new weights (never read stale)."""
    model = make_tiny_model("llama", seed=32)
    with paged_transformers.patch(engine_config=EngineConfig(cpu_prepack_weights=True)):
        _generate(model)
        linears = current_engine(model).runner.cpu_linears
        if linears is None:
            pytest.skip("no oneDNN route on this CPU")
        packs, products = linears.num_packs, linears.num_packed_products
        assert products > 0
        _perturb(model, 0.05, seed=44)
        got = _generate(model)
        assert linears.num_packs == packs + 1 and linears.num_packed_products > products
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(_generate(model).scores), atol=1e-4, rtol=1e-4)


CUDA_CHANGES = {
    "adamw_fused": _train_step(torch.optim.AdamW, lr=0.02, fused=True),
    "adamw_foreach": _train_step(torch.optim.AdamW, lr=0.02, foreach=True),
    "sgd": _train_step(torch.optim.SGD, lr=2.0),
    "data_add": lambda m: _perturb(m, 0.05, seed=43),
}
if hasattr(torch.optim, "Adafactor"):
    CUDA_CHANGES["adafactor"] = _train_step(torch.optim.Adafactor, lr=0.05)


@CUDA
@pytest.mark.parametrize("change", list(CUDA_CHANGES))
def test_a_change_between_calls_reaches_the_next_call_on_cuda(change):
    model = make_tiny_model("llama", seed=30).cuda()
    _check_second_call(model, CUDA_CHANGES[change], EngineConfig(gpu_memory_utilization=0.2))


def test_quantized_weights_written_in_place_reach_the_next_call():
    """``QuantLinear`` keeps a dequantized copy of its weight on the CPU, keyed by its buffers' addresses: a
    ``load_state_dict`` (or a ``.data`` write) into them must drop it, so the next call computes with the new
    weights (reference: stock greedy on a model built with those weights)."""
    from transformers import Qwen2Config

    from conftest import stock_greedy
    from paged_transformers import SamplingParams, paged_generate
    from paged_transformers.quantization import build_random_quantized_model

    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    model, other = (build_random_quantized_model(cfg, "gptq", 4, 32, torch.float32, "cpu", seed=s) for s in (1, 3))
    prompt = [3, 14, 15, 92, 65, 35, 8, 9, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = paged_generate(model, [prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith(("qweight", "scales", "zeros")):
                buf.data.copy_(other.get_buffer(name))  # through .data, at the same addresses
        for p, q in zip(model.parameters(), other.parameters()):
            p.data.copy_(q.data)
    expected = stock_greedy(other, prompt, 6)[0]
    assert expected != first, "the other weights must move the greedy output"
    got = paged_generate(model, [prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    paged_transformers.release(model)
    assert got == expected
