"""The server's options, under vLLM's names (``vllm serve`` / ``python -m vllm.entrypoints.openai.api_server``)."""

import argparse

import torch

from ...config import EngineConfig, UsageContext

DEFAULT_MAX_BODY_BYTES = 8 << 20  # bytes; larger request bodies get a 413 (a 128k-token prompt is under 1 MiB)


def port(value: str) -> int:
    """``--port``: an integer in [0, 65535] (0: any free port), checked before the model loads."""
    number = int(value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {number}")
    return number


def add_server_arguments(parser: argparse.ArgumentParser, model_positional: bool) -> None:
    """The server's options on ``parser``: the model as a positional (``paged-transformers serve MODEL``) or as
    ``--model`` (the module entry point), the rest vLLM's flags."""
    default = EngineConfig()
    model_help = ("local folder, hub id in the local cache, or a GPTQ/AWQ folder; "
                  "default: the embedded SmolLM2-135M-Instruct")  # fmt: skip
    if model_positional:
        parser.add_argument("model", nargs="?", default=None, help=model_help)
    else:
        parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="names the API accepts as `model` (the first is reported); default: the model argument")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id; default: the model's")
    parser.add_argument("--trust-remote-code", action="store_true", help="let transformers run the checkpoint's code")
    parser.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
                        help="auto: the config's dtype on CUDA (float32 cast to bfloat16), float32 on CPU")
    parser.add_argument("--quantization", "-q", choices=["gptq", "awq"], default=None,
                        help="None: read from the checkpoint's quantization_config")
    parser.add_argument("--max-model-len", "--max-context-length", dest="max_model_len", type=int, default=None,
                        help="longest prompt + output, tokens; default: the model's max_position_embeddings")
    parser.add_argument("--gpu-memory-utilization", type=float, default=default.gpu_memory_utilization,
                        help="share of the GPU memory for weights, activations and the KV cache")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="exact number of KV blocks in the pool, instead of sizing it by --gpu-memory-utilization")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="most sequences in one step; None: by device, the server's defaults (EngineConfig)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="most tokens in one step; None: by device, the server's defaults (EngineConfig)")
    parser.add_argument("--block-size", type=int, default=default.block_size, help="tokens per KV block")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=default.enable_prefix_caching, help="reuse the KV blocks of shared prompt prefixes")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (and no compiled layers)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks to split the model over (GPUs; CPU processes on CPU): paged_transformers.distributed")
    parser.add_argument("--seed", type=int, default=0, help="seed of requests without their own seed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model runs: cuda when present, else cpu")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1 endpoints; default: no key")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template itself) replacing the tokenizer's")
    parser.add_argument("--max-num-queued-requests", type=int, default=None,
                        help="refuse new requests with 503 while this many are waiting; default: no limit")
    parser.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies are refused with 413")


def llm_arguments(args) -> dict:
    """The parsed options that ``LLM`` takes, as its keyword arguments, with the server's usage context (vLLM's
    ``OPENAI_API_SERVER``: its defaults for the step limits left None, ``EngineConfig``)."""
    return dict(
        tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code, dtype=args.dtype,
        quantization=args.quantization, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, num_gpu_blocks=args.num_gpu_blocks_override,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size, seed=args.seed, device=args.device,
        usage_context=UsageContext.OPENAI_API_SERVER,
    )  # fmt: skip


def make_arg_parser(prog: str | None = None, model_positional: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="An OpenAI-compatible server on the paged engine.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add_server_arguments(parser, model_positional)
    return parser
