"""Issue 23: the CUDA memory a random quantized Llama-3-8B (``paged-transformers bench``'s model) leaves after it is
built: allocated, reserved, reserved but unallocated after ``empty_cache`` (what the KV pool, sized from the device's
free memory in ``core.sizing``, does not get) and the caching allocator's inactive split blocks.

    python3 research/quant_memory.py gptq|awq [--whole] [--out FILE]

``--whole`` converts each AWQ layer unpacked whole, as ``awq_to_kernel_layout`` did before it went a chunk of rows at
a time (``formats._pack_rows_chunked``), to compare the two in separate processes on one machine.
"""

import argparse
import json

import torch

from paged_transformers.bench.workload import build_model
from paged_transformers.kernels.w4a16 import pack_rows
from paged_transformers.quantization import formats, random_model


def awq_whole(qweight, qzeros, scales, group_size):
    """The AWQ conversion unpacked whole (the layer's ``[K, N]`` int32 and int64 temporaries at once)."""
    q = formats.unpack_cols(qweight, 4, formats.AWQ_ORDER)
    z = formats.unpack_cols(qzeros, 4, formats.AWQ_ORDER)
    gs = q.shape[0] if group_size == -1 else group_size
    return formats.PackedWeight(pack_rows(q, 4), scales.contiguous(), z.to(torch.int16), None, 4, gs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("method", choices=["gptq", "awq"])
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.whole:
        random_model.awq_to_kernel_layout = awq_whole
    model = build_model("llama-3-8b", torch.bfloat16, "cuda", quantization=args.method)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    gib = 2**30
    row = dict(method=args.method, whole=args.whole, allocated_gib=torch.cuda.memory_allocated() / gib,
               peak_allocated_gib=torch.cuda.max_memory_allocated() / gib,
               reserved_gib=torch.cuda.memory_reserved() / gib,
               reserved_unallocated_gib=(torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / gib,
               inactive_split_gib=stats.get("inactive_split_bytes.all.current", 0) / gib,
               device_used_gib=(total - free) / gib, device_total_gib=total / gib,
               params_gib=sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())) / gib)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
