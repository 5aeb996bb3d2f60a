"""``research/w4a16_wgmma.py`` compiled for sm_90 on a machine without a GPU: every quick candidate, bf16 and fp16 x,
with and without split-K, compiles (its static asserts include zero bank conflicts on the weight tile's stores and
the packed words' loads), spills nothing, and keeps one wgmma group in flight across K steps (ptxas did not
serialize them). Needs triton with Gluon (3.6, the device's, or later) and torch:
``python -m pytest research/test_w4a16_wgmma.py``."""

import importlib.util
import pathlib
import re

import pytest

pytest.importorskip("triton.experimental.gluon")
_PATH = pathlib.Path(__file__).resolve().parent / "w4a16_wgmma.py"
_spec = importlib.util.spec_from_file_location("w4a16_wgmma", _PATH)
w4a16_wgmma = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(w4a16_wgmma)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("cand", w4a16_wgmma.QUICK_CANDIDATES + [(256, 128, 64, 3, 8, True)], ids=str)
def test_compiles_pipelined(cand, dtype, split_k):
    _, ptxas_log, sass = w4a16_wgmma.compile_sm90(dtype, cand, split_k)
    assert "Performance Loss" not in ptxas_log, ptxas_log  # e.g. C7515: wgmma serialized
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", ptxas_log), ptxas_log
    waits = set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))
    assert "0x1" in waits, waits  # the K loop waits for the wgmma before last, not the last one
    assert sass.count("HGMMA") >= 2 * (cand[2] // 16)  # step 0 and the loop body each issue BLOCK_K / 16 of them
