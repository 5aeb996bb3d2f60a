"""The workload of ``paged-transformers bench``: named model shapes with random weights, and the requests
(synthetic, or read from a JSONL file)."""

import json
import random
from dataclasses import dataclass

import torch

# Named shapes (random weights) from the models' published config.json files.
MODEL_SHAPES = {
    "llama-3-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-2-7b": ("llama", dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                                 rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen2.5-7b": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # for CPU smoke runs and tests only
    "tiny-llama": ("llama", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)),
}


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # tokens to generate (EOS ignored)


def build_model(name: str, dtype: torch.dtype, device: str, quantization: str | None = None, bits: int = 4,
                group_size: int = 128):
    """A named shape with random weights built directly on ``device``, or a checkpoint path / hub id.

    Raises:
        ValueError: ``quantization`` given for a checkpoint path (its own config decides), or unknown.
        OSError: ``name`` is no named shape and no loadable checkpoint (the message lists the shapes).
    """
    import transformers

    from ..compat import model_from_config

    if name not in MODEL_SHAPES:
        if quantization is not None:
            raise ValueError(f"--quantization applies to named shapes {sorted(MODEL_SHAPES)}, not to {name!r}")
        from ..quantization import load_model  # GPTQ / AWQ natively, anything else through transformers

        try:
            return load_model(name, dtype=dtype, device=device)
        except OSError as e:  # not a folder, and the hub did not have it (or could not be reached)
            raise OSError(f"--model {name!r} is neither a named shape ({', '.join(MODEL_SHAPES)}) nor a loadable "
                          f"checkpoint: {e}") from e
    arch, fields = MODEL_SHAPES[name]
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    config = config_cls(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    if quantization is not None:
        if quantization not in ("gptq", "awq"):
            raise ValueError(f"quantization must be 'gptq' or 'awq', got {quantization!r}")
        from ..quantization import build_random_quantized_model

        return build_random_quantized_model(config, quantization, bits, group_size, dtype, device).eval()
    with torch.device(device):
        model = model_from_config(model_cls, config, dtype)
    return model.eval()


def synthetic_workload(num_requests: int, input_len_range: tuple[int, int], output_len_range: tuple[int, int],
                       vocab_size: int, seed: int) -> list[BenchRequest]:
    """``num_requests`` requests, lengths uniform in the inclusive ranges, token ids uniform in ``[0, vocab)``.

    Raises:
        ValueError: ``num_requests`` not positive, or an empty or non-positive range.
    """
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests <= 0:
        raise ValueError(f"num_requests must be a positive integer, got {num_requests!r}")
    for name, (lo, hi) in (("input_len_range", input_len_range), ("output_len_range", output_len_range)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must satisfy 1 <= low <= high, got {lo, hi}")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(num_requests):
        p, o = rng.randint(*input_len_range), rng.randint(*output_len_range)
        requests.append(BenchRequest(torch.randint(0, vocab_size, (p,), generator=gen).tolist(), o))
    return requests


def load_jsonl(path: str, tokenizer=None) -> list[BenchRequest]:
    """Requests from a JSONL file of ``{"prompt": str | list[int], "output_len": int}`` lines.

    Raises:
        ValueError: a line without those keys, a text prompt without a tokenizer, a bad ``output_len``.
    """
    requests = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" not in row or "output_len" not in row:
                raise ValueError(f"{path}:{n}: each line needs 'prompt' and 'output_len', got keys {sorted(row)}")
            prompt = row["prompt"]
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise ValueError(f"{path}:{n}: text prompt needs a tokenizer (use a model path, or token ids)")
                prompt = list(tokenizer(prompt).input_ids)
            if not isinstance(row["output_len"], int) or row["output_len"] <= 0:
                raise ValueError(f"{path}:{n}: output_len must be a positive int, got {row['output_len']!r}")
            requests.append(BenchRequest(list(prompt), row["output_len"]))
    return requests
