"""vLLM's offline throughput measurement: 32 prompts generated in one ``llm.generate`` call, timed, and the
rate printed in tokens/s (vLLM's benchmark_throughput wording). The vLLM code with only the import changed.

Run (CPU or GPU, offline; default model: the embedded SmolLM2-135M-Instruct):
    python examples/quickstart_throughput.py [--model PATH_OR_CACHED_HUB_ID] [--max-tokens N]
(``$PAGED_TRANSFORMERS_MODEL`` also sets the model.)
"""

import argparse
import os
import time

from paged_transformers import LLM, SamplingParams  # was: from vllm import LLM, SamplingParams
from paged_transformers.default_model import default_model_path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default=os.environ.get("PAGED_TRANSFORMERS_MODEL"))
parser.add_argument("--max-tokens", type=int, default=128)
args = parser.parse_args()
model = args.model or str(default_model_path())

# --- vLLM's code from here ---
topics = ["the ocean", "a city at night", "mountains", "a robot", "coffee", "the moon", "a library", "winter"]
styles = ["Write a short story about", "Describe", "Write a poem about", "List three facts about"]
prompts = [f"{style} {topic}." for style in styles for topic in topics]  # 32 prompts
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, ignore_eos=True)

llm = LLM(model=model)
start = time.perf_counter()
outputs = llm.generate(prompts, sampling_params)
elapsed = time.perf_counter() - start

num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print(f"{len(prompts)} prompts, {num_prompt_tokens} prompt tokens, {num_output_tokens} output tokens in {elapsed:.2f} s")
print(f"Throughput: {len(prompts) / elapsed:.2f} requests/s, {(num_prompt_tokens + num_output_tokens) / elapsed:.2f} "
      f"total tokens/s, {num_output_tokens / elapsed:.2f} output tokens/s")
