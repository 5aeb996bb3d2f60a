"""Patched ``AutoModelForCausalLM.from_pretrained`` loads GPTQ / AWQ fixtures natively (no gptqmodel) and
gives what ``paged_transformers.load_model`` gives; plain checkpoints and unpatched calls stay stock."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import paged_transformers
from paged_transformers.quantization.linear import QuantLinear

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "models"
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"fixtures folder {FIXTURES} is missing")


def test_patched_from_pretrained_loads_gptq_and_awq_natively():
    ids = torch.tensor([[5, 17, 300, 42, 9]])
    for name in ("tiny-llama-gptq-4bit-g32-actorder-asym", "tiny-qwen2-awq-4bit-g128-gemm"):
        folder = FIXTURES / name
        reference = paged_transformers.load_model(folder, dtype=torch.float32, device="cpu")
        with paged_transformers.patch():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cpu")
        assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear), name
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference(ids).logits), name


def test_plain_checkpoint_and_unpatch_stay_stock():
    folder = FIXTURES / "tiny-llama-fp16"
    before = AutoModelForCausalLM.__dict__["from_pretrained"]
    with paged_transformers.patch():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert AutoModelForCausalLM.__dict__["from_pretrained"] is before  # the class's own classmethod is back
    stock = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(stock) is type(model)
