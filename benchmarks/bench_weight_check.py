"""The per-call cost of the weight-change check (``core/weights.py``: a checksum of every weight at each attach) on a
CUDA model, against a patched ``generate()`` call.

A Llama-3-8B-shaped bf16 model with random weights (``paged_transformers.bench.workload.build_model``; no download).
Measured, each the median of ``--reps`` runs after a warm-up:

- ``check_ms``: ``WeightsFingerprint.again`` (the checksums of every storage, one Triton launch, read back), as
  ``attach()`` runs it once per call; ``read_gb_s``: the weights' bytes over that time;
- ``kernel_ms``: the checksum kernel alone (``kernels.checksum.checksums``, chunk table made), timed with CUDA events;
- ``call_ms``: a patched ``model.generate()`` of ``--prompt-len`` prompt tokens and ``--new-tokens`` new tokens (EOS
  ignored) at each batch size, check included; ``check_pct``: ``check_ms`` as a percentage of it.

Before timing it checks the kernel against the PyTorch reference on a few weights and that a one-element write
through ``.data`` changes the fingerprint.

    python benchmarks/bench_weight_check.py --out weight_check.json
"""

import argparse
import json
import statistics
import time

import torch

import paged_transformers
from paged_transformers.bench.workload import build_model
from paged_transformers.core.weights import WeightsFingerprint, _storage_bytes, _tensors, _words
from paged_transformers.kernels.checksum import checksums, checksums_ref, chunk_table


def median_ms(fn, reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs (after one warm-up), milliseconds; the device synchronized."""
    fn()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def kernel_ms(words: list[torch.Tensor], reps: int) -> float:
    """Median CUDA-event time of ``checksums(words, table)``, milliseconds."""
    table = chunk_table(words)
    checksums(words, table)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        checksums(words, table)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sanity(model) -> None:
    """The kernel equals the reference on the first weights; a one-element ``.data`` write changes the fingerprint."""
    words = [_words(r) for r in (_storage_bytes(t) for _, t in list(_tensors(model))[:6]) if r is not None]
    assert checksums(words).tolist() == checksums_ref(words).tolist(), "kernel != reference"
    before = WeightsFingerprint.take(model)
    n = len(model.model.layers) // 2
    weight = model.model.layers[n].mlp.down_proj.weight
    old = weight.data[3, 5].item()
    weight.data[3, 5] = -old if old != 0 else 1.0
    detail = before.compare(before.again())
    weight.data[3, 5] = old
    assert detail.startswith(f"model.layers.{n}.mlp.down_proj.weight"), detail
    assert before.compare(before.again()) == ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b", help="a named shape of paged_transformers.bench.workload")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    model = build_model(args.model, torch.bfloat16, "cuda")
    nbytes = sum(t.numel() * t.element_size() for _, t in _tensors(model))
    sanity(model)
    fingerprint = WeightsFingerprint.take(model)
    check = median_ms(fingerprint.again, args.reps * 4)
    words = [_words(r) for r in (_storage_bytes(t) for _, t in _tensors(model)) if r is not None]
    result = {"model": args.model, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "weights_gb": nbytes / 1e9, "num_storages": len(words), "check_ms": check,
              "read_gb_s": nbytes / 1e9 / (check / 1e3), "kernel_ms": kernel_ms(words, args.reps * 4), "calls": []}
    del words
    print(f"{args.model} bf16 on {result['gpu']}: {nbytes / 1e9:.1f} GB in {result['num_storages']} storages; "
          f"check {check:.2f} ms ({result['read_gb_s']:.0f} GB/s), kernel {result['kernel_ms']:.2f} ms")
    print(f"{'batch':>5} {'prompt':>6} {'new':>4} {'call ms':>9} {'check ms':>9} {'check %':>8}")
    g = torch.Generator().manual_seed(0)
    with paged_transformers.patch():
        for batch in args.batches:
            ids = torch.randint(3, model.config.vocab_size, (batch, args.prompt_len), generator=g).cuda()

            def call():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                               min_new_tokens=args.new_tokens, do_sample=False)

            call_ms = median_ms(call, args.reps)
            row = {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "call_ms": call_ms,
                   "check_ms": check, "check_pct": 100 * check / call_ms}
            result["calls"].append(row)
            print(f"{batch:>5} {args.prompt_len:>6} {args.new_tokens:>4} {call_ms:>9.1f} {check:>9.2f} "
                  f"{row['check_pct']:>7.2f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
