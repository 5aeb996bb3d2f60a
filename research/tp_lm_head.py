"""Vocab-parallel vs replicated LM head at tensor parallelism 2 (gloo on CPU, one thread per rank): time of the
LM head forward per step, with its logits all-gather, for SmolLM2-135M's shape (hidden 576, vocab 49152).

    python research/tp_lm_head.py
"""

import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from paged_transformers.distributed.sharding import _split_vocab

HIDDEN, VOCAB, STEPS = 576, 49152, 30


def run(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    whole = nn.Linear(HIDDEN, VOCAB, bias=False)
    split = nn.Linear(HIDDEN, VOCAB, bias=False)
    split.weight = nn.Parameter(whole.weight.detach().clone())
    _split_vocab(split, rank, 2, dist.group.WORLD)
    for batch in (1, 32, 256):
        x = torch.randn(1, batch, HIDDEN)
        with torch.inference_mode():
            assert torch.allclose(whole(x), split(x) + 0, atol=1e-4)
            times = {}
            for name, head in (("replicated", whole), ("vocab_parallel", split)):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    head(x).sum().item()
                times[name] = (time.perf_counter() - t0) / STEPS * 1e3
        if rank == 0:
            print(f"batch {batch:4d}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(run, args=(29811,), nprocs=2, start_method="spawn")
