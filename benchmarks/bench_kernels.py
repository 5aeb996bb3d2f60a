"""GPU check and timing of the Triton paged-attention kernels (issue 3). CUDA only.

    python benchmarks/bench_kernels.py [--out DIR] [--skip-grid] [--skip-defaults] [--skip-prefill-sweep]
                                       [--decode-sweep] [--block-size-sweep] [--prefill-sweep]

1. Ceilings measured in the same run: device-to-device copy bandwidth (bytes read + written) and a
   bf16 8192^3 matmul rate.
2. Correctness at real sizes with the default configs (bf16 unless noted, head_dim 128, 32 q / 8 kv
   heads, contexts up to 32k): ``paged_attention`` against ``paged_attention_ref`` run on fp32 copies of
   the inputs; output poisoned with NaN first; relative error ||out - ref|| / ||ref||; plus other head
   dims, block sizes, fp16/fp32, window + softcap, a decode step captured in a CUDA graph and replayed
   on new contents, and ``reshape_and_cache`` (bit-exact).
3. Timings of the defaults, ``triton.testing.do_bench`` medians (L2 flushed before each call by do_bench,
   and inputs rotated over sets totalling > 4x L2), also as CUDA-graph replays for decode (no launch
   gaps): decode batch 64 x 4096 and batch 1 x 32k (bytes of K/V read / time vs copy bandwidth), prefill
   8 x 2048 causal (TFLOP/s), each beside torch SDPA (``enable_gqa=True``) on the same data laid out
   contiguously; a mixed prefill+decode batch (``paged_attention``'s two launches vs one launch vs two
   calls); ``reshape_and_cache``.
4. Prefill sweep (on by default): the candidate configs of ``PREFILL_CANDIDATES`` on 8 x 2048
   causal, block_size 16, each checked against the fp32 reference (NaN-poisoned output) before it is
   timed. ``--block-size-sweep``: prefill (default and the sweep's best) and decode (default) at
   block_size 32 / 64 / 128. ``--decode-sweep``: the split-count and tile sweeps for decode.

``--prefill-sweep`` alone = ``--skip-grid --skip-defaults``: the candidates, the default and SDPA on
8 x 2048 causal, block_size 16 (under a minute). Prints a table last and writes everything to ``DIR/kernels_h200.json`` (DIR: --out,
else $OUT, else benchmarks/results).
"""

import argparse
import importlib
import json
import os
import platform
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from paged_transformers.kernels.api import paged_attention, paged_attention_ref, reshape_and_cache, reshape_and_cache_ref

pa = importlib.import_module("paged_transformers.kernels.paged_attention")  # the module (name shared with the function)

DEV = torch.device("cuda")
H, HKV, D = 32, 8, 128
L2_BYTES = 60 << 20  # H200: 60 MB (read from the device below when available)


def gib(n):
    return n / 2**30


# ---------------------------------------------------------------- inputs
def paged_batch(q_lens, seq_lens, *, h=H, hkv=HKV, d=D, block_size=16, dtype=torch.bfloat16, seed=0):
    """Random paged batch with each sequence's blocks scattered over the pool (random permutation)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    blocks = [triton.cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    kc = torch.randn(num_blocks, block_size, hkv, d, device=DEV, dtype=dtype, generator=g)
    vc = torch.randn(num_blocks, block_size, hkv, d, device=DEV, dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device=DEV, generator=g).to(torch.int32)
    bt = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=DEV)
    used = 0
    for i, n in enumerate(blocks):
        bt[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn(sum(q_lens), h, d, device=DEV, dtype=dtype, generator=g)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return dict(query=q, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl, query_start_loc=qsl,
                max_query_len=max(q_lens), max_seq_len=max(seq_lens))


def call(b, out=None, **kw):
    return paged_attention(b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens"],
                           b["query_start_loc"], b["query"].shape[-1] ** -0.5, max_query_len=b["max_query_len"], max_seq_len=b["max_seq_len"], out=out, **kw)


def kv_bytes(b):
    kc = b["key_cache"]
    return 2 * int(b["seq_lens"].sum()) * kc.shape[2] * kc.shape[3] * kc.element_size()


def contiguous_kv(b):
    """The same K/V as [num_seqs, num_kv_heads, seq_len, head_dim] (all seq_lens equal), for SDPA."""
    L = int(b["seq_lens"][0])
    k = b["key_cache"][b["block_tables"].long()].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()
    v = b["value_cache"][b["block_tables"].long()].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()
    return k, v


def rotating(make, set_bytes):
    """Enough input sets that their total exceeds 4x L2 (at least 2)."""
    n = max(2, triton.cdiv(4 * L2_BYTES, set_bytes))
    return [make(i) for i in range(n)]


def bench(fns, graph=False):
    """Median ms of calling fns[0], fns[1], ... in turn (one per timed call)."""
    i = [0]

    def step():
        fns[i[0] % len(fns)]()
        i[0] += 1

    step()
    torch.cuda.synchronize()
    if graph:
        return do_bench_cudagraph(step, rep=100, return_mode="median")
    return do_bench(step, warmup=25, rep=200, return_mode="median")


# ---------------------------------------------------------------- ceilings
def ceilings():
    n = 1 << 30  # 1 GiB copy
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    a.random_()
    ms = do_bench(lambda: b.copy_(a), warmup=10, rep=100, return_mode="median")
    copy_bw = 2 * n / (ms * 1e-3)
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms_mm = do_bench(lambda: x @ y, warmup=10, rep=100, return_mode="median")
    del a, b, x, y
    return dict(copy_bw_Bps=copy_bw, matmul_bf16_flops=2 * 8192**3 / (ms_mm * 1e-3))


# ---------------------------------------------------------------- correctness
def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check(name, b, results, window=None, softcap=None, splits=None):
    out = torch.full_like(b["query"], float("nan"))
    scale = b["query"].shape[-1] ** -0.5
    paged_attention(b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens"],
                    b["query_start_loc"], scale, sliding_window=window, softcap=softcap,
                    max_query_len=b["max_query_len"], max_seq_len=b["max_seq_len"], out=out, num_kv_splits=splits)
    ref = paged_attention_ref(b["query"].float(), b["key_cache"].float(), b["value_cache"].float(), b["block_tables"],
                              b["seq_lens"], b["query_start_loc"], scale, sliding_window=window, softcap=softcap)
    nan = bool(out.isnan().any())
    err = rel_err(out, ref)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}[b["query"].dtype]
    results.append(dict(name=name, rel_err=err, nan=nan, ok=(not nan) and err < tol, tol=tol))
    del ref, out


def correctness(results):
    bf = torch.bfloat16
    grid = [
        ("decode ragged 1..32k", dict(q_lens=[1] * 8, seq_lens=[1, 16, 17, 1000, 4096, 8191, 16384, 32768]), {}),
        ("decode 32k no split", dict(q_lens=[1, 1], seq_lens=[32768, 5000]), dict(splits=1)),
        ("decode 32k window 4096 softcap 50", dict(q_lens=[1, 1], seq_lens=[32768, 3000]), dict(window=4096, softcap=50.0)),
        ("mixed: 2048 prefill + chunk 512@8192 + decodes", dict(q_lens=[2048, 512, 1, 1, 1], seq_lens=[2048, 8704, 4096, 1, 32768]), {}),
        ("prefill 1 + 17 + 128 + 1000", dict(q_lens=[1, 17, 128, 1000], seq_lens=[1, 17, 128, 1000]), {}),
        ("chunk 256@31k window 1024 softcap 30", dict(q_lens=[256, 1], seq_lens=[31000, 700]), dict(window=1024, softcap=30.0)),
    ]
    for name, shape, opts in grid:
        check(name, paged_batch(**shape, dtype=bf, seed=len(results)), results, **opts)
    for d in (64, 80, 96, 256):
        for bs in ((16, 128) if d == 80 else (32,) if d != 256 else (64,)):
            b = paged_batch([300, 1, 1], [1300, 2000, 64], d=d, block_size=bs, dtype=bf, seed=d)
            check(f"d{d} bs{bs} mixed", b, results)
            b = paged_batch([1, 1], [6000, 100], d=d, block_size=bs, dtype=bf, seed=d + 1)
            check(f"d{d} bs{bs} decode split", b, results)
    check("fp16 GQA8 mixed", paged_batch([200, 1], [900, 3000], h=32, hkv=4, dtype=torch.float16), results)
    check("fp32 MHA mixed bs64", paged_batch([100, 1], [400, 3000], h=8, hkv=8, block_size=64, dtype=torch.float32), results)
    check("bf16 MQA decode", paged_batch([1, 1], [9000, 33], h=16, hkv=1), results)
    graph_capture_check(results)
    cache_check(results)


def graph_capture_check(results):
    """Capture one decode step (fixed-capacity buffers), then replay it on new block tables / lengths."""
    max_seqs, max_len, bs = 16, 8192, 16
    b = paged_batch([1] * max_seqs, [max_len] * max_seqs, block_size=bs, seed=7)
    out = torch.full_like(b["query"], float("nan"))
    static = {k: b[k] for k in ("query", "block_tables", "seq_lens", "query_start_loc")}

    def step():
        paged_attention(static["query"], b["key_cache"], b["value_cache"], static["block_tables"], static["seq_lens"],
                        static["query_start_loc"], D ** -0.5, max_query_len=1, max_seq_len=max_len, out=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            step()
    except Exception as e:  # a host sync inside the wrapper would fail here
        results.append(dict(name="decode step in a CUDA graph", ok=False, error=repr(e)))
        return
    errs = []
    for trial in range(3):
        gen = torch.Generator(device=DEV).manual_seed(100 + trial)
        static["seq_lens"].copy_(torch.randint(1, max_len + 1, (max_seqs,), device=DEV, generator=gen, dtype=torch.int32))
        static["block_tables"].copy_(static["block_tables"][torch.randperm(max_seqs, device=DEV, generator=gen)])
        static["query"].normal_(generator=gen)
        out.fill_(float("nan"))
        g.replay()
        ref = paged_attention_ref(static["query"].float(), b["key_cache"].float(), b["value_cache"].float(),
                                  static["block_tables"], static["seq_lens"], static["query_start_loc"], D ** -0.5)
        errs.append(rel_err(out, ref) if not out.isnan().any() else float("nan"))
    ok = all(e < 1e-2 for e in errs)
    results.append(dict(name="decode step in a CUDA graph, replayed x3", rel_err=max(errs), nan=False, ok=ok, tol=1e-2))


def cache_check(results):
    T, bs = 4096, 16
    g = torch.Generator(device=DEV).manual_seed(3)
    kc = torch.randn(T // bs + 8, bs, HKV, D, device=DEV, dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    qkv = torch.randn(T, H + 2 * HKV, D, device=DEV, dtype=torch.bfloat16, generator=g)  # fused QKV rows
    k, v = qkv[:, H : H + HKV], qkv[:, H + HKV :]
    slots = torch.randperm(kc.shape[0] * bs, device=DEV, generator=g)[:T]
    slots[::7] = -1
    kc2, vc2 = kc.clone(), vc.clone()
    reshape_and_cache(k, v, kc, vc, slots)
    reshape_and_cache_ref(k, v, kc2, vc2, slots)
    ok = torch.equal(kc, kc2) and torch.equal(vc, vc2)
    results.append(dict(name="reshape_and_cache 4096 tok, strided QKV rows", rel_err=0.0 if ok else 1.0, nan=False, ok=ok, tol=0))


# ---------------------------------------------------------------- timings
def time_decode(batch, ctx, ceil, rows, sweeps, block_size=16, sdpa=True):
    sets = rotating(lambda i: paged_batch([1] * batch, [ctx] * batch, block_size=block_size, seed=10 + i),
                    batch * ctx * HKV * D * 4)
    nbytes = kv_bytes(sets[0])
    outs = [torch.empty_like(s["query"]) for s in sets]
    roof_ms = nbytes / ceil["copy_bw_Bps"] * 1e3
    name = f"decode B={batch} ctx={ctx} bs{block_size}"

    def row(variant, ms, extra=None):
        r = dict(name=name, variant=variant, ms=ms, kv_GBps=nbytes / (ms * 1e-3) / 1e9, block_size=block_size,
                 frac_copy_bw=nbytes / (ms * 1e-3) / ceil["copy_bw_Bps"], roofline_ms=roof_ms)
        r.update(extra or {})
        rows.append(r)
        return r

    auto = pa.pick_num_kv_splits(batch, HKV, ctx, DEV)
    fns = [lambda s=s, o=o: call(s, out=o) for s, o in zip(sets, outs)]
    row(f"triton (splits={auto})", bench(fns))
    row(f"triton (splits={auto}) cuda-graph", bench(fns, graph=True))
    if sweeps:
        for splits in sorted({1, 2, 4, 8, 16, 32, 64, 128} - {auto}):
            if batch * HKV * splits > 8192 or (batch > 1 and splits > 8):
                continue
            fns = [lambda s=s, o=o, n=splits: call(s, out=o, num_kv_splits=n) for s, o in zip(sets, outs)]
            row(f"triton splits={splits} cuda-graph", bench(fns, graph=True))
        for cfg in (pa.KernelConfig(16, 64, 4, 2), pa.KernelConfig(16, 64, 4, 2, prefetch_block_ids=True),
                    pa.KernelConfig(16, 64, 4, 3, prefetch_block_ids=True),
                    pa.KernelConfig(16, 64, 4, 4, prefetch_block_ids=True)):
            fns = [lambda s=s, o=o, c=cfg: launch(s, o, c, auto) for s, o in zip(sets, outs)]
            row(f"triton {cfg_name(cfg)} cuda-graph", bench(fns, graph=True))
    if not sdpa:
        del sets
        return
    # SDPA on the same K/V, contiguous [B, Hkv, ctx, D]
    sdpa_sets = [(s["query"].view(batch, H, 1, D), *contiguous_kv(s)) for s in sets]
    fns = [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for q, k, v in sdpa_sets]
    row("torch SDPA contiguous", bench(fns))
    try:
        row("torch SDPA contiguous cuda-graph", bench(fns, graph=True))
    except Exception as e:  # not every SDPA backend can be captured
        rows.append(dict(name=name, variant="torch SDPA cuda-graph", error=repr(e)[:200]))
    del sets, sdpa_sets


def time_decode_batch1(ceil, rows, ctx=512, max_seq_len=1536):
    """Batch-1 decode of issue 4's latency target (Llama-3-8B heads, context ``ctx``), with the host bound
    ``max_seq_len`` the engine's decode graphs are captured with (``max_model_len``: 1536 for the bench
    workload), against split counts and key-tile sizes; attention + merge in one CUDA graph per variant."""
    sets = [paged_batch([1], [ctx], seed=40 + i) for i in range(2)]
    for s in sets:
        s["max_seq_len"] = max_seq_len
    nbytes = kv_bytes(sets[0])
    outs = [torch.empty_like(s["query"]) for s in sets]
    name = f"decode B=1 ctx={ctx} bound={max_seq_len}"

    def row(variant, ms):
        rows.append(dict(name=name, variant=variant, ms=ms, kv_GBps=nbytes / (ms * 1e-3) / 1e9,
                         frac_copy_bw=nbytes / (ms * 1e-3) / ceil["copy_bw_Bps"],
                         roofline_ms=nbytes / ceil["copy_bw_Bps"] * 1e3))

    auto = pa.pick_num_kv_splits(1, HKV, max_seq_len, DEV)
    row(f"triton (splits={auto}) cuda-graph", bench([lambda s=s, o=o: call(s, out=o) for s, o in zip(sets, outs)], graph=True))
    for splits in (1, 2, 4, 8, 16, 32):
        for tile_n in (16, 32, 64):
            cfg = pa.KernelConfig(16, tile_n, 4, 2)
            fns = [lambda s=s, o=o, c=cfg, n=splits: launch(s, o, c, n) for s, o in zip(sets, outs)]
            row(f"triton splits={splits} {cfg_name(cfg)} cuda-graph", bench(fns, graph=True))


def launch(b, out, cfg, splits):
    """All sequences in one launch with tiles ``cfg`` (the config sweeps)."""
    pa.launch_attention(b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens"],
                        b["query_start_loc"], out, D ** -0.5, None, None, splits, [pa.QueryBand(cfg, 1, pa.INT32_MAX)])


# Prefill candidates of round 2 (8 x 2048 causal, block_size 16), timed beside the default of 2026-11-29
# (128 x 32 tiles, 4 warps, 4 stages; the "triton (default)" row). Read from sm_90 TTGIR/SASS compiled on CPU
# (triton 3.9, ptxas 12.8): the default's K/V addresses depend on a block-table load of the same iteration,
# so the pipeliner keeps 2 K/V buffers and waits for every copy at each tile (async_wait num=0) whatever
# num_stages says; with the block ids prefetched one tile ahead it keeps num_stages buffers (wait num =
# num_stages - 1). Registers: 128x32/4w 251-254 (no spills at 2-4 stages); 128x64/8w 190 (2 stages) - 210
# (3); 128x128/8w 2 stages 250; 128x64/4w spills (not swept). fma_scores: 32 of the loop's FMUL+FADD pairs
# become FFMA.
PF = dict(prefetch_block_ids=True)
PREFILL_CANDIDATES = [
    pa.KernelConfig(128, 32, 4, 2, **PF),
    pa.KernelConfig(128, 32, 4, 3, **PF),
    pa.KernelConfig(128, 32, 4, 4, **PF),
    pa.KernelConfig(128, 32, 4, 3, **PF, fma_scores=True),
    pa.KernelConfig(128, 32, 4, 4, **PF, fma_scores=True),
    pa.KernelConfig(128, 64, 8, 2, **PF, fma_scores=True),
    pa.KernelConfig(128, 64, 8, 3, **PF, fma_scores=True),
    pa.KernelConfig(128, 128, 8, 2, **PF, fma_scores=True),
]


def cfg_name(c):
    return (f"block_m={c.block_m} tile_n={c.tile_n} w={c.num_warps} s={c.num_stages}"
            + (" prefetch" if c.prefetch_block_ids else "") + (" fma" if c.fma_scores else ""))


def prefill_sets(n, L, block_size):
    return rotating(lambda i: paged_batch([L] * n, [L] * n, block_size=block_size, seed=20 + i),
                    n * L * (H + 2 * HKV) * D * 2)


def time_prefill(ceil, rows, checks, *, defaults=True, candidates=(), block_size=16, sdpa=True, n=8, L=2048):
    """Prefill n x L causal: the default path, SDPA, and each candidate (checked first, then timed)."""
    sets = prefill_sets(n, L, block_size)
    outs = [torch.empty_like(s["query"]) for s in sets]
    flops = 4 * n * (L * (L + 1) // 2) * H * D  # causal: query i sees i+1 keys; QK^T and PV, 2 flop per MAC
    roof_ms = flops / ceil["matmul_bf16_flops"] * 1e3
    name = f"prefill {n}x{L} causal bs{block_size}"
    best = None

    def row(variant, ms, cfg=None):
        r = dict(name=name, variant=variant, ms=ms, tflops=flops / (ms * 1e-3) / 1e12, roofline_ms=roof_ms,
                 block_size=block_size)
        if cfg is not None:
            r["config"] = dict(block_m=cfg.block_m, tile_n=cfg.tile_n, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages, prefetch_block_ids=cfg.prefetch_block_ids,
                               fma_scores=cfg.fma_scores)
        rows.append(r)

    b0 = sets[0]
    ref = paged_attention_ref(b0["query"].float(), b0["key_cache"].float(), b0["value_cache"].float(),
                              b0["block_tables"], b0["seq_lens"], b0["query_start_loc"], D ** -0.5)

    def checked(label, fn):
        out = torch.full_like(b0["query"], float("nan"))
        fn(b0, out)
        nan = bool(out.isnan().any())
        err = rel_err(out, ref) if not nan else float("nan")
        ok = (not nan) and err < 1e-2
        checks.append(dict(name=f"{name} {label}", rel_err=err, nan=nan, ok=ok, tol=1e-2))
        return ok

    if defaults:
        if checked("default", lambda b, o: call(b, out=o)):
            row("triton (default)", bench([lambda s=s, o=o: call(s, out=o) for s, o in zip(sets, outs)]))
    for c in candidates:
        cfg = c
        try:
            if not checked(cfg_name(cfg), lambda b, o, c=cfg: launch(b, o, c, 1)):
                continue
            ms = bench([lambda s=s, o=o, c=cfg: launch(s, o, c, 1) for s, o in zip(sets, outs)])
        except Exception as e:  # e.g. out of shared memory for a config on this triton
            rows.append(dict(name=name, variant=cfg_name(cfg), error=repr(e)[:200]))
            continue
        row(f"triton {cfg_name(cfg)}", ms, cfg)
        if best is None or ms < best[1]:
            best = (cfg, ms)
    if sdpa:
        sdpa_sets = [(s["query"].view(n, L, H, D).transpose(1, 2).contiguous(), *contiguous_kv(s)) for s in sets]
        fns = [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
               for q, k, v in sdpa_sets]
        row("torch SDPA contiguous", bench(fns))
        del sdpa_sets
    del sets, ref
    return best


def time_mixed(rows):
    """1 prefill (2048) + 63 decodes (ctx 4096): paged_attention, one launch of prefill tiles, two separate batches."""
    mixed = paged_batch([2048] + [1] * 63, [2048] + [4096] * 63, seed=30)
    pre = paged_batch([2048], [2048], seed=31)
    dec = paged_batch([1] * 63, [4096] * 63, seed=32)
    o_m, o_p, o_d = (torch.empty_like(b["query"]) for b in (mixed, pre, dec))
    rows.append(dict(name="mixed 2048 prefill + 63 decodes @4096", variant="paged_attention (decode + prefill launch)",
                     ms=bench([lambda: call(mixed, out=o_m)])))
    prefill_tiles = pa.pick_config(2048, H // HKV, D, torch.bfloat16)
    rows.append(dict(name="mixed 2048 prefill + 63 decodes @4096", variant="one launch, prefill tiles for all",
                     ms=bench([lambda: launch(mixed, o_m, prefill_tiles, 1)])))
    rows.append(dict(name="mixed 2048 prefill + 63 decodes @4096", variant="prefill launch + decode launch",
                     ms=bench([lambda: (call(pre, out=o_p), call(dec, out=o_d))])))


def time_cache(ceil, rows):
    T = 16384
    kc = torch.empty(T // 16 + 1, 16, HKV, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    k = torch.randn(T, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(T, device=DEV)
    ms = bench([lambda: reshape_and_cache(k, v, kc, vc, slots)])
    nbytes = 2 * 2 * k.numel() * k.element_size()
    rows.append(dict(name=f"reshape_and_cache {T} tok", variant="triton", ms=ms,
                     frac_copy_bw=nbytes / (ms * 1e-3) / ceil["copy_bw_Bps"]))


def main():
    global L2_BYTES
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--skip-grid", action="store_true", help="no correctness grid of the defaults")
    ap.add_argument("--skip-defaults", action="store_true", help="no timings of the defaults")
    ap.add_argument("--skip-prefill-sweep", action="store_true")
    ap.add_argument("--decode-sweep", action="store_true", help="split-count and decode tile sweeps")
    ap.add_argument("--batch1-sweep", action="store_true",
                    help="batch-1 decode at context 512 (bound 1536): split counts x key tiles")
    ap.add_argument("--block-size-sweep", action="store_true", help="prefill and decode at block_size 32/64/128")
    ap.add_argument("--prefill-sweep", action="store_true",
                    help="only the prefill candidates beside the default and SDPA: --skip-grid --skip-defaults")
    ap.add_argument("--skip-sweeps", action="store_true", help="defaults only (no prefill or decode sweep)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip the remaining sections past this wall time")
    args = ap.parse_args()
    if args.prefill_sweep:
        args.skip_grid = args.skip_defaults = True
    if args.skip_sweeps:
        args.skip_prefill_sweep, args.decode_sweep = True, False
    t0 = time.time()
    props = torch.cuda.get_device_properties(DEV)
    L2_BYTES = getattr(props, "L2_cache_size", L2_BYTES) or L2_BYTES
    env = dict(device=props.name, sms=props.multi_processor_count, l2_bytes=L2_BYTES, torch=torch.__version__,
               triton=triton.__version__, python=platform.python_version(), date=time.strftime("%Y-%m-%d"),
               args=vars(args))
    print(env, flush=True)
    ceil = ceilings()
    print({k: f"{v:.4g}" for k, v in ceil.items()}, flush=True)
    checks, timings, best = [], [], {}
    if not args.skip_grid:
        correctness(checks)
        print(f"correctness done in {time.time() - t0:.0f}s", flush=True)
    sections = []
    if not args.skip_defaults:
        sections += [("decode 64x4096", lambda: time_decode(64, 4096, ceil, timings, args.decode_sweep)),
                     ("decode 1x32k", lambda: time_decode(1, 32768, ceil, timings, args.decode_sweep)),
                     ("prefill default", lambda: time_prefill(ceil, timings, checks)),
                     ("mixed", lambda: time_mixed(timings)), ("cache", lambda: time_cache(ceil, timings))]
    if not args.skip_prefill_sweep:
        def sweep():
            best["cfg"] = time_prefill(ceil, timings, checks, defaults=args.skip_defaults,
                                       candidates=PREFILL_CANDIDATES, sdpa=args.skip_defaults)
        sections.append(("prefill sweep", sweep))
    if args.batch1_sweep:
        sections.append(("decode 1x512 sweep", lambda: time_decode_batch1(ceil, timings)))
    if args.block_size_sweep:
        for bs in (32, 64, 128):
            sections += [
                (f"prefill bs{bs}", lambda bs=bs: time_prefill(ceil, timings, checks, block_size=bs, sdpa=False,
                                                                candidates=[best["cfg"][0]] if best.get("cfg") else [])),
                (f"decode 64x4096 bs{bs}", lambda bs=bs: time_decode(64, 4096, ceil, timings, False, bs, sdpa=False)),
                (f"decode 1x32k bs{bs}", lambda bs=bs: time_decode(1, 32768, ceil, timings, False, bs, sdpa=False)),
            ]
    for label, sec in sections:
        if time.time() - t0 > args.budget_s:
            timings.append(dict(name="skipped", variant=f"{label} (past --budget-s {args.budget_s:g})"))
            continue
        try:
            sec()
        except Exception as e:  # keep the rest of the run
            timings.append(dict(name="error", variant=f"{label}: {e!r}"[:300]))
        print(f"{label}: t={time.time() - t0:.0f}s", flush=True)
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernels_h200.json")
    with open(path, "w") as f:
        json.dump(dict(env=env, ceilings=ceil, correctness=checks, timings=timings, wall_s=time.time() - t0), f, indent=1)
    print("\n== correctness (rel. error vs fp32 reference) ==")
    for c in checks:
        print(f"{'ok ' if c['ok'] else 'BAD'} {c['name']:<80} {c.get('rel_err', float('nan')):.2e} {c.get('error', '')}")
    print(f"\n== timings (median ms) copy {ceil['copy_bw_Bps'] / 1e12:.2f} TB/s, matmul {ceil['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s ==")
    for r in timings:
        extra = ""
        if "frac_copy_bw" in r:
            extra = f"{r['frac_copy_bw'] * 100:5.1f}% copy bw"
        if "tflops" in r:
            extra = f"{r['tflops']:6.0f} TFLOP/s"
        if "roofline_ms" in r:
            extra += f"  roofline {r['roofline_ms']:.4f}"
        print(f"{r['name']:<36} {r.get('variant', ''):<56} {r.get('ms', float('nan')):8.4f} {extra}")
    sdpa = [r["ms"] for r in timings if r.get("variant") == "torch SDPA contiguous" and r["name"].startswith("prefill")]
    if sdpa:
        print(f"\n== prefill 8x2048 vs SDPA {sdpa[0]:.4f} ms (target <= 1.5x, goal 1.2x) ==")
        for r in sorted((r for r in timings if r["name"].startswith("prefill") and "ms" in r and "triton" in r["variant"]),
                        key=lambda r: r["ms"]):
            print(f"{r['ms'] / sdpa[0]:5.2f}x  {r['name']:<30} {r['variant']}")
    print(f"wrote {path}; wall {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
