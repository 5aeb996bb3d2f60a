"""``W4A16Algo.WGMMA``: its Gluon kernel compiled for sm_90 on any machine (Gluon has no interpreter, so this is what
the CPU suite can check), its dispatch, and on a Hopper GPU its results against ``w4a16_matmul_ref``.

The compile checks: every WGMMA config of the shipped tuning tables (``tables.py``), bf16 and fp16 x, with and without split-K and bias,
compiles (the kernel's static asserts include zero bank conflicts on the packed words' loads, and its conversion to
wgmma's register layout must be free), spills nothing, and
keeps one wgmma group in flight across K steps (ptxas did not serialize them: no C7515 note, and the loop waits with
``DEPBAR.LE gsb0, 0x1``). They fail on a word layout that is not wgmma's or an accumulator ptxas serializes.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from paged_transformers.kernels import w4a16 as k  # noqa: E402
from paged_transformers.kernels.w4a16 import dispatch, tables  # noqa: E402

A = k.W4A16Algo
HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
H100_TABLE = tables.table_named("NVIDIA H100 80GB HBM3")
# every WGMMA config a shipped table can pick, with the table's split-K count
WGMMA_CONFIGS = sorted({k.W4A16Config(c.block_m, c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages, A.WGMMA)
                        for p in (Path(dispatch.__file__).parent / "configs").glob("*.json")
                        for b in tables.table_named(p.stem.replace("_", " ")).buckets for c in b.candidates
                        if c.algo == "wgmma"}, key=str)


def compile_sm90(cfg: k.W4A16Config, dtype: str, scales_dtype: str = "fp16", bias: bool = False):
    """The kernel compiled for sm_90 (K = N = 4096, group 128) without a GPU: ``(ptxas -v's stderr, the SASS)``."""
    if not dispatch.has_gluon():
        pytest.skip("needs triton >= 3.6 (Gluon), which WGMMA is written against")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from paged_transformers.kernels.w4a16 import wgmma_kernels as wk

    torch_dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    K = N = 4096
    x = torch.zeros(256, K, dtype=torch_dt[dtype])
    q = torch.zeros(K // 8, N, dtype=torch.int32)
    s = torch.zeros(K // 128, N, dtype=torch_dt[scales_dtype])
    z = torch.zeros(K // 128, N, dtype=torch.int16)
    descs = wk.descriptors(x, q, s, z, cfg.block_m, cfg.block_n, cfg.block_k)
    sig = {name: mangle_type(d) for name, d in zip(("x_desc", "p_desc", "s_desc", "z_desc"), descs)}
    sig.update({"bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32",
                "N": "i32", "K": "i32", "stride_om": "i32"})
    consumers = dispatch.wgmma_consumers(cfg)
    consts = dict(HAS_BIAS=bias, GROUP_SIZE=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  STAGES=cfg.num_stages, SPLIT_K=cfg.split_k, CONSUMERS=consumers, num_warps=cfg.num_warps // consumers)
    sig.update({name: "constexpr" for name in consts})
    names = list(sig)
    src = GluonASTSource(wk._w4a16_wgmma_kernel, sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]]
                                for n in ("bias_ptr", "out_ptr", "ws_ptr", "lock_ptr", "N", "K", "stride_om")})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps // consumers, "maxnreg": dispatch.wgmma_maxnreg(cfg)})
    ptxas = get_ptxas(90).path  # the ptxas triton itself uses
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True, check=True).stderr
        with open(os.path.join(d, "k.cubin"), "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-c", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, check=True).stdout
    return log, sass


CASES = [(cfg, "bf16", "fp16", False) for cfg in WGMMA_CONFIGS] + [
    (WGMMA_CONFIGS[0], "fp16", "fp16", True),  # fp16 x, one mul.f16x2 per pair
    (WGMMA_CONFIGS[0], "fp16", "bf16", False),  # fp16 x, a scale not exact in fp16: products in fp32
    (dataclasses.replace(WGMMA_CONFIGS[0], split_k=1), "bf16", "fp16", True),
    (dataclasses.replace(WGMMA_CONFIGS[-1], split_k=2), "bf16", "fp32", True),
    # two consumers with split-K, fp16 x and bias
    (dataclasses.replace(next(c for c in WGMMA_CONFIGS if dispatch.wgmma_consumers(c) == 2), split_k=2), "fp16",
     "fp16", True),
]


def _run_fresh(script: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python without the interpreter and with its own compile cache under ``cwd`` (a kernel's
    cache key does not see a patched layout function)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cwd / "cache")}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every case of ``CASES`` compiled in one fresh process, ``{index: (ptxas log, SASS) or the error}``: the
    interpreter (``TRITON_INTERPRET=1`` on CPU) patches ``triton.language`` for the kernels it runs and leaves it
    patched, which breaks a Gluon compile later in the same process."""
    if not dispatch.has_gluon():
        pytest.skip("needs triton >= 3.6 (Gluon), which WGMMA is written against")
    d = tmp_path_factory.mktemp("sm90")
    script = d / "compile_all.py"
    script.write_text(f"""import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_w4a16_wgmma as t
res = {{}}
for i, case in enumerate(t.CASES):
    try:
        res[i] = list(t.compile_sm90(*case))
    except Exception as e:
        res[i] = f"{{type(e).__name__}}: {{e}}"
json.dump(res, open(sys.argv[1], "w"))
""")
    r = _run_fresh(script, d, str(d / "out.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    return {int(i): v for i, v in json.loads((d / "out.json").read_text()).items()}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c} {d} s={s} bias={b}" for c, d, s, b in CASES])
@pytest.mark.slow
def test_compiles_pipelined_for_sm90(case, compiled):
    cfg = CASES[case][0]
    assert isinstance(compiled[case], list), compiled[case]
    log, sass = compiled[case]
    assert "Performance Loss" not in log, log  # e.g. C7515: wgmma serialized
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", log), log
    waits = set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))
    assert "0x1" in waits, waits  # the K loop waits for the wgmma before last, not the last one
    # in each consumer, steps 0 and 1, the loop's two steps and the odd tail each issue BLOCK_K / 16 per 16-row slice
    # of a warp
    consumers = dispatch.wgmma_consumers(cfg)
    slices = cfg.block_n // (16 * cfg.num_warps // consumers)
    assert sass.count("HGMMA") == consumers * 5 * (cfg.block_k // 16) * slices, sass.count("HGMMA")
    assert ("ATOMG" in sass or "RED" in sass) == (cfg.split_k > 1)  # the split-K epilogue only with split-K
    # the epilogue's global stores and split-K adds move 16 bytes each (8 columns of out, 4 of the fp32 workspace)
    writes = re.findall(r"\b(?:STG|REDG)\.E\S*", sass)
    assert writes and all(w.startswith("STG.E.128") or "F32x4" in w for w in writes), sorted(set(writes))


def _round_bf16(v: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest bf16 value (ties to even), exactly, as float64 (no double rounding through fp32)."""
    m, e = torch.frexp(v)
    return torch.ldexp(torch.round(m * 256.0), (e - 8).to(torch.float64))


def test_split_scale_product_rounds_once():
    # the "split" dequantization (bf16 x, fp16 scales) in exact arithmetic: s = s_hi + s_lo with both in bf16, then
    # fma((q - z), s_hi, round((q - z) * s_lo)) rounded once must be the exact product rounded once, for every finite
    # fp16 scale and every q - z of 4-bit fields and zero points (z <= 16)
    s16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    s = s16[torch.isfinite(s16)].to(torch.float64)
    s_hi = _round_bf16(s)
    s_lo = s - s_hi
    assert torch.equal(_round_bf16(s_lo), s_lo)  # s_lo is a bf16 value
    assert torch.equal(s_hi, s16[torch.isfinite(s16)].to(torch.bfloat16).to(torch.float64))  # as the kernel's cast
    for d in range(-16, 16):
        ref = _round_bf16(d * s)
        assert torch.equal(_round_bf16(d * s_hi + _round_bf16(d * s_lo)), ref), d
    assert not torch.equal(_round_bf16(7 * s_hi), _round_bf16(7 * s))  # without s_lo it differs


def test_compile_catches_a_layout_that_is_not_wgmmas(tmp_path):
    if not dispatch.has_gluon():
        pytest.skip("needs triton >= 3.6 (Gluon), which WGMMA is written against")
    # the check can fail: with two lane bits of the weight rows swapped (still free of bank conflicts), the dequantized
    # values do not come out in wgmma's A layout, and the assert_trivial conversion must refuse to compile (in a fresh
    # process and compile cache: the kernel's cache key does not see a patched layout function)
    script = tmp_path / "wrong_layout.py"
    script.write_text(f"""import math, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_w4a16_wgmma as t
from paged_transformers.kernels.w4a16 import wgmma_kernels as wk
from triton.experimental.gluon import language as gl


def wrong(BLOCK_N, TK, num_warps):  # _word_layout's, with its lanes' row bits 0 and 1 swapped
    reg = [[8, 0, 0]] + [[0, 1 << b, 0] for b in range(int(math.log2(TK)))]
    reg += [[16 * num_warps << r, 0, 0] for r in range(int(math.log2(BLOCK_N // (16 * num_warps))))]
    lane = [[0, 0, 1], [0, 0, 2], [2, 0, 0], [1, 0, 0], [4, 0, 0]]
    warp = [[16 << w, 0, 0] for w in range(int(math.log2(num_warps)))]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [BLOCK_N, TK, 4])


wk._word_layout = wk.gluon.constexpr_function(wrong)
t.compile_sm90(t.WGMMA_CONFIGS[0], "bf16")
""")
    r = _run_fresh(script, tmp_path)
    assert r.returncode != 0 and "is not trivial" in r.stderr, r.stderr[-3000:]


def _hopper(monkeypatch, capability=(9, 0)):
    # default_config for a CUDA device on any machine: a Hopper with the tuned SM count
    monkeypatch.setattr(dispatch, "cuda_capability", lambda device, stand_in: capability)
    monkeypatch.setattr(dispatch, "num_sms", lambda device, stand_in: 132)
    monkeypatch.setattr(dispatch, "has_gluon", lambda: True)


CUDA = torch.device("cuda")


@pytest.mark.parametrize("why,args", [
    ("not Hopper", dict(capability=(8, 0))), ("Blackwell", dict(capability=(10, 0))), ("8 bits", dict(bits=8)),
    ("groups of 32", dict(group=32)), ("N % 8", dict(N=4100)), ("unaligned weights", dict(tma_aligned=False)),
    ("M = 16", dict(M=16)), ("prefill-sized M", dict(M=257)), ("CPU", dict(device=torch.device("cpu"))),
])
def test_default_config_leaves_wgmma_out_where_it_cannot_run(why, args, monkeypatch):
    # the H100 table's WGMMA candidates on a described device: none is picked where the kernel cannot run
    _hopper(monkeypatch)
    assert k.default_config(128, 4096, 14336, 128, CUDA, 4, torch.bfloat16, table=H100_TABLE).algo is A.WGMMA
    _hopper(monkeypatch, args.pop("capability", (9, 0)))
    kw = dict(M=128, N=4096, K=14336, group=128, device=CUDA, bits=4, tma_aligned=True) | args
    cfg = k.default_config(kw["M"], kw["N"], kw["K"], kw["group"], kw["device"], kw["bits"], torch.bfloat16,
                           kw["tma_aligned"], table=H100_TABLE)
    assert cfg.algo is not A.WGMMA, (why, cfg)


@pytest.mark.parametrize("cfg,K,reason", [
    (k.W4A16Config(128, 64, 64, 1, 4, 4, A.WGMMA), 4096, None),
    (k.W4A16Config(256, 128, 64, 1, 8, 4, A.WGMMA), 4096, None),
    (k.W4A16Config(512, 64, 64, 1, 4, 4, A.WGMMA), 4096, "needs block_m 16-256"),  # wgmma's N is at most 256
    (k.W4A16Config(64, 512, 64, 1, 4, 4, A.WGMMA), 4096, "needs block_n a multiple"),
    (k.W4A16Config(64, 32, 64, 1, 8, 4, A.WGMMA), 4096, "needs block_n a multiple"),  # 8 warps: 128 rows, or 64
    (k.W4A16Config(128, 64, 64, 1, 8, 8, A.WGMMA), 4096, None),  # two consumers
    (k.W4A16Config(64, 64, 64, 1, 8, 4, A.WGMMA), 192, "at least 4 K steps"),  # two consumers: 2 steps each
    (k.W4A16Config(64, 64, 64, 1, 8, 3, A.WGMMA), 4096, "num_stages >= 4"),  # two consumers: the last copy would hang
    (k.W4A16Config(256, 64, 64, 1, 8, 4, A.WGMMA), 4096, "needs block_m <= 128"),  # two consumers: registers
    (k.W4A16Config(128, 64, 128, 1, 8, 6, A.WGMMA), 4096, "bytes of shared memory"),  # the ring and the second's tile
    (k.W4A16Config(64, 64, 64, 1, 4, 2, A.WGMMA), 4096, "num_stages >= 3"),
    (k.W4A16Config(256, 64, 128, 1, 4, 4, A.WGMMA), 4096, "bytes of shared memory"),  # 280,096 bytes
    (k.W4A16Config(64, 64, 64, 2, 4, 4, A.WGMMA), 128, "at least 2 K steps"),  # 1 step per slice
])
def test_wgmma_fits_names_the_tile_it_cannot_run(cfg, K, reason, monkeypatch):
    _hopper(monkeypatch)
    why = dispatch.wgmma_fits(cfg, 4096, K, 128 if K > 128 else K, CUDA, 4, torch.bfloat16)
    assert (why is None) if reason is None else (reason in why), why


def _ring_hangs(n_steps: int, stages: int, consumers: int) -> bool:
    """A step-by-step model of the kernel's ring: the producer copies step ``i`` into slot ``i % stages`` once step
    ``i - stages`` is freed; consumer ``c`` takes steps ``c, c + consumers, ...``, and from its third step on frees
    step ``i - 2 * consumers`` before it waits for step ``i``'s copy. True if some consumer waits forever."""
    copied, freed, produced = set(), set(), 0
    own = [list(range(c, n_steps, consumers)) for c in range(consumers)]
    done = [0] * consumers
    moved = True
    while moved:
        moved = False
        if produced < n_steps and (produced < stages or produced - stages in freed):
            copied.add(produced)
            produced, moved = produced + 1, True
        for c in range(consumers):
            if done[c] < len(own[c]):
                i = own[c][done[c]]
                if done[c] >= 2 and i - 2 * consumers not in freed:
                    freed.add(i - 2 * consumers)
                    moved = True
                if i in copied:
                    done[c], moved = done[c] + 1, True
    return any(done[c] < len(own[c]) for c in range(consumers))


@pytest.mark.parametrize("consumers", [1, 2])
def test_fewest_stages_allowed_cannot_hang(consumers, monkeypatch):
    """``wgmma_fits``' least ``num_stages`` for one and two consumers: the ring's model completes every K slice from
    the fewest steps allowed up; with two consumers it hangs with one stage fewer (3 stages hung a CUDA test)."""
    _hopper(monkeypatch)
    fewest = next(s for s in range(1, 9) if dispatch.wgmma_fits(
        k.W4A16Config(64, 64, 64, 1, 4 * consumers, s, A.WGMMA), 4096, 4096, 128, CUDA, 4, torch.bfloat16) is None)
    assert not any(_ring_hangs(n, fewest, consumers) for n in range(2 * consumers, 64))
    if consumers == 2:
        assert any(_ring_hangs(n, fewest - 1, consumers) for n in range(2 * consumers, 64))


def test_default_config_without_gluon_falls_back(monkeypatch):
    _hopper(monkeypatch)
    monkeypatch.setattr(dispatch, "has_gluon", lambda: False)
    assert k.default_config(40, 28672, 4096, 128, CUDA, 4, torch.bfloat16, table=H100_TABLE).algo is not A.WGMMA


def test_wgmma_config_refused_with_the_reason():
    # an explicit WGMMA config off Hopper (here the CPU) is refused at the boundary, naming why
    x = torch.randn(64, 256)
    qweight, scales, zeros = torch.zeros(32, 64, dtype=torch.int32), torch.ones(2, 64).half(), torch.zeros(2, 64, dtype=torch.int16)
    cfg = k.W4A16Config(64, 64, 64, algo=A.WGMMA)
    with pytest.raises(ValueError, match="Hopper"):
        k.w4a16_matmul(x, qweight, scales, zeros, 4, 128, config=cfg)


# ---------------------------------------------------------------------------------------------------------------------
# on a Hopper GPU: against the reference

def _layer(K, N, group, scales_dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    G = K // group
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int32)
    scales = ((0.5 + torch.rand(G, N, generator=g)) * 0.01).to(scales_dtype)
    zeros = torch.randint(0, 17, (G, N), generator=g).to(torch.int16)
    return k.pack_rows(q, 4).to(CUDA), scales.to(CUDA), zeros.to(CUDA)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


needs_hopper = pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper (sm_90) GPU")


@needs_hopper
@pytest.mark.parametrize("cfg", WGMMA_CONFIGS, ids=str)
@pytest.mark.parametrize("M", [1, 70, 256])
def test_every_table_config_matches_reference(cfg, M):
    qweight, scales, zeros = _layer(4096, 1024, 128)
    x = torch.randn(M, 4096, device=CUDA, dtype=torch.bfloat16)
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, 128, config=cfg)
    ref = k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 128)
    assert _rel(out, ref) < 4e-3  # bf16 rounding of the weight and the output
    assert _rel(k.w4a16_matmul_ref(x.float(), qweight, scales, zeros + 1, 4, 128), ref) > 1e-2  # it can fail


# (M, N, K, group, x dtype, scales dtype, bias, config): N past the tile (masked columns), per-channel groups, fp16 x
# with fp16 / bf16 scales, bias with and without split-K, two M tiles, 8 warps
EDGE = [
    (70, 200, 256, 128, torch.bfloat16, torch.float16, True, k.W4A16Config(64, 128, 64, 2, 4, 3, A.WGMMA)),
    (70, 200, 256, 256, torch.bfloat16, torch.float16, False, k.W4A16Config(128, 64, 128, 1, 4, 3, A.WGMMA)),
    (33, 512, 512, 128, torch.float16, torch.float16, True, k.W4A16Config(64, 128, 64, 1, 8, 3, A.WGMMA)),
    (33, 512, 512, 64, torch.float16, torch.bfloat16, False, k.W4A16Config(64, 64, 64, 4, 4, 4, A.WGMMA)),
    (150, 256, 1024, 128, torch.bfloat16, torch.bfloat16, True, k.W4A16Config(128, 128, 64, 8, 4, 3, A.WGMMA)),
    # odd numbers of K steps (the pipeline's tail step): 5 steps; 3 per split-K slice; per-channel, 3 steps, 8 warps
    (40, 256, 320, 64, torch.bfloat16, torch.float16, False, k.W4A16Config(64, 64, 64, 1, 4, 4, A.WGMMA)),
    (40, 256, 768, 64, torch.bfloat16, torch.float16, True, k.W4A16Config(64, 64, 64, 4, 4, 3, A.WGMMA)),
    (100, 384, 384, 384, torch.float16, torch.float16, False, k.W4A16Config(128, 128, 128, 1, 8, 3, A.WGMMA)),
    # 8 warps with split-K and fp32 scales; 16 rows, 4 warps with 4 slices of rows each
    (130, 512, 1024, 128, torch.bfloat16, torch.float32, True, k.W4A16Config(256, 128, 64, 2, 8, 4, A.WGMMA)),
    (9, 520, 512, 128, torch.bfloat16, torch.float16, False, k.W4A16Config(16, 256, 64, 1, 4, 3, A.WGMMA)),
    # x copied in 64-row boxes: a 256-row tile with three whole boxes and one skipped, with one whole box and three
    # skipped (split-K), and 128-row tiles whose second tile has one box partly past M (block_k 128)
    (192, 256, 512, 128, torch.bfloat16, torch.float16, False, k.W4A16Config(256, 64, 64, 1, 4, 4, A.WGMMA)),
    (64, 256, 512, 128, torch.float16, torch.float16, True, k.W4A16Config(256, 64, 64, 2, 4, 4, A.WGMMA)),
    (176, 256, 512, 128, torch.bfloat16, torch.float16, False, k.W4A16Config(128, 64, 128, 1, 4, 4, A.WGMMA)),
    # two consumers (8 warps on 64 columns) taking alternate K steps: with split-K and bias; 5 steps each and the
    # fewest stages; 4 and 3 steps (the second's odd tail), groups of 64
    (70, 256, 512, 128, torch.bfloat16, torch.float16, True, k.W4A16Config(128, 64, 64, 2, 8, 8, A.WGMMA)),
    (150, 200, 640, 128, torch.float16, torch.float16, False, k.W4A16Config(64, 64, 64, 1, 8, 4, A.WGMMA)),
    (40, 256, 448, 64, torch.bfloat16, torch.bfloat16, False, k.W4A16Config(128, 64, 64, 1, 8, 4, A.WGMMA)),
]


@needs_hopper
@pytest.mark.parametrize("M,N,K,group,dtype,scales_dtype,bias,cfg", EDGE)
def test_edges_match_reference(M, N, K, group, dtype, scales_dtype, bias, cfg):
    qweight, scales, zeros = _layer(K, N, group, scales_dtype, seed=M)
    x = torch.randn(M, K, device=CUDA, dtype=dtype)
    b = torch.randn(N, device=CUDA, dtype=dtype) if bias else None
    ref = k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, group, bias=b.float() if bias else None)
    for _ in range(2):  # twice: split-K must leave its workspace and counters zeroed
        out = k.w4a16_matmul(x, qweight, scales, zeros, 4, group, bias=b, config=cfg)
        assert out.dtype == dtype
        assert _rel(out, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3)


@needs_hopper
@pytest.mark.parametrize("dtype,scales_dtype", [(torch.bfloat16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                                (torch.float16, torch.bfloat16)])
def test_dequantized_weight_is_exact(dtype, scales_dtype):
    """x = I makes out the kernel's dequantized weight (one product per output, accumulated in fp32): it must equal
    the reference's exact ``(q - z) * s`` rounded once to x's dtype (``torch.equal``: +0 and -0 compare equal) over
    scales of both signs from 2^-14 to 2^10 and every 4-bit zero point (GPTQ's stored ``z - 1`` unpacks to at most
    16)."""
    g = torch.Generator().manual_seed(1)
    K, N, group = 256, 512, 64
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int32)
    mag = torch.exp2(torch.rand(K // group, N, generator=g) * 24 - 14)  # 2^-14 .. 2^10: (q - z) * s stays finite
    sign = torch.where(torch.rand(K // group, N, generator=g) < 0.5, -1.0, 1.0)
    scales = (mag * sign).to(scales_dtype).to(CUDA)
    zeros = torch.randint(0, 17, (K // group, N), generator=g).to(torch.int16).to(CUDA)
    qweight = k.pack_rows(q, 4).to(CUDA)
    x = torch.eye(K, device=CUDA, dtype=dtype)
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, group, config=k.W4A16Config(128, 64, 64, 1, 4, 3, A.WGMMA))
    ref = k.dequantize_packed(qweight, scales, zeros, 4, group).to(dtype)
    assert torch.equal(out, ref), int((out != ref).sum())


@needs_hopper
def test_unaligned_x_view_is_copied():
    qweight, scales, zeros = _layer(256, 128, 128)
    base = torch.randn(64 * 256 + 1, device=CUDA, dtype=torch.bfloat16)
    x = base[1:].view(64, 256)  # a 2-byte offset: not 16-byte aligned
    cfg = k.W4A16Config(64, 128, 64, 1, 4, 3, A.WGMMA)
    out = k.w4a16_matmul(x, qweight, scales, zeros, 4, 128, config=cfg)
    assert _rel(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 128)) < 4e-3


@needs_hopper
def test_unaligned_weights_refused_or_avoided():
    qweight, scales, zeros = _layer(256, 136, 128)
    s = torch.empty(scales.numel() + 1, device=CUDA, dtype=scales.dtype)[1:].view_as(scales)  # 2 bytes off
    s.copy_(scales)
    x = torch.randn(64, 256, device=CUDA, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte"):
        k.w4a16_matmul(x, qweight, s, zeros, 4, 128, config=k.W4A16Config(64, 64, 64, 1, 4, 3, A.WGMMA))
    out = k.w4a16_matmul(x, qweight, s, zeros, 4, 128)  # the default picks another kernel
    assert _rel(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 128)) < 4e-3


@needs_hopper
def test_cuda_graph_replay_matches():
    qweight, scales, zeros = _layer(4096, 1024, 128)
    x = torch.randn(100, 4096, device=CUDA, dtype=torch.bfloat16)
    cfg = k.W4A16Config(128, 64, 64, 4, 4, 4, A.WGMMA)  # with split-K: the workspace and counters in the graph
    k.w4a16_matmul(x, qweight, scales, zeros, 4, 128, config=cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = k.w4a16_matmul(x, qweight, scales, zeros, 4, 128, config=cfg)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert _rel(out, k.w4a16_matmul_ref(x.float(), qweight, scales, zeros, 4, 128)) < 4e-3
