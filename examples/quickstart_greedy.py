"""vLLM's quick start, one greedy prompt: the vLLM code with only the import changed and a local model.

Run (CPU or GPU, offline; default model: the embedded SmolLM2-135M-Instruct):
    python examples/quickstart_greedy.py [--model PATH_OR_CACHED_HUB_ID] [--max-tokens N]
(``$PAGED_TRANSFORMERS_MODEL`` also sets the model.)
"""

import argparse
import os

from paged_transformers import LLM, SamplingParams  # was: from vllm import LLM, SamplingParams
from paged_transformers.default_model import default_model_path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default=os.environ.get("PAGED_TRANSFORMERS_MODEL"))
parser.add_argument("--max-tokens", type=int, default=256)
args = parser.parse_args()
model = args.model or str(default_model_path())

# --- vLLM's code from here ---
llm = LLM(model=model)
sampling_params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
outputs = llm.generate("The capital of France is", sampling_params)
print(outputs[0].outputs[0].text)
