"""vLLM's quick start, offline batched inference: the vLLM code with only the import changed and a local model
(five prompts, sampled at temperature 0.7).

Run (CPU or GPU, offline; default model: the embedded SmolLM2-135M-Instruct):
    python examples/quickstart_basic.py [--model PATH_OR_CACHED_HUB_ID] [--max-tokens N]
(``$PAGED_TRANSFORMERS_MODEL`` also sets the model.)
"""

import argparse
import os

from paged_transformers import LLM, SamplingParams  # was: from vllm import LLM, SamplingParams
from paged_transformers.default_model import default_model_path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default=os.environ.get("PAGED_TRANSFORMERS_MODEL"))
parser.add_argument("--max-tokens", type=int, default=16)  # SamplingParams' default, as in vLLM's example
args = parser.parse_args()
model = args.model or str(default_model_path())

# --- vLLM's code from here ---
# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
    "The best way to learn a language is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=args.max_tokens)

# Create an LLM.
llm = LLM(model=model)
# Generate texts from the prompts. The output is a list of RequestOutput objects
# that contain the prompt, generated text, and other information.
outputs = llm.generate(prompts, sampling_params)
# Print the outputs.
print("\nGenerated Outputs:\n" + "-" * 60)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt:    {prompt!r}")
    print(f"Output:    {generated_text!r}")
    print("-" * 60)
