"""``kernels.compile_only``: launches inside it compile their kernel variant without running (CUDA), or run as
outside (the CPU's interpreter); the engine's compile warm-ups leave the first calls nothing to compile (CUDA)."""

import types

import pytest
import torch

from paged_transformers.kernels import _launch
from paged_transformers.kernels.api import compile_only
from paged_transformers.core.execution_plan import LayerPath
from paged_transformers.kernels.argmax import argmax_rows

CUDA = torch.cuda.is_available()


class _FakeKernel:
    """Records how it was called: ``[grid](...)`` (a launch) or ``warmup(..., grid=)`` (a compile)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("launch", grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("warmup", grid, args, kwargs))


def test_a_wrapped_module_turns_launches_into_warmups_and_passes_the_rest():
    kernel = _FakeKernel()
    mod = types.SimpleNamespace(_k=kernel, BLOCK=64)
    wrapped = _launch._CompileOnlyKernels(mod)
    wrapped._k[(3, 2)](1, "x", BLOCK_N=16, num_warps=4)
    assert kernel.calls == [("warmup", (3, 2), (1, "x"), {"BLOCK_N": 16, "num_warps": 4})]
    assert wrapped.BLOCK == 64


def test_not_reentrant():
    pytest.importorskip("triton.runtime._async_compile")
    with compile_only():
        with pytest.raises(RuntimeError, match="already active"):
            with compile_only():
                pass
    with compile_only():  # usable again once left
        pass


@pytest.mark.skipif(CUDA, reason="the CPU's behaviour: the interpreter compiles nothing, so launches run")
def test_cpu_launches_run_inside():
    x = torch.randn(3, 40)
    with compile_only():
        assert not isinstance(_launch.load_triton_kernels("argmax.triton_kernels", x.device),
                              _launch._CompileOnlyKernels)
        got = argmax_rows(x, block=16)
    assert torch.equal(got, x.argmax(dim=-1))


def _compiled_variants(module: str) -> int:
    """Compiled (or compiling) variants of the kernels of ``paged_transformers.kernels.<module>`` on this GPU."""
    mod = _launch.load_triton_kernels(module, torch.device("cuda"))
    device = torch.cuda.current_device()
    return sum(len(k.device_caches[device][0]) for k in _launch._kernels_of(mod) if device in k.device_caches)


@pytest.mark.skipif(not CUDA, reason="compiles for a GPU")
def test_cuda_a_launch_inside_compiles_without_running():
    x = torch.randn(5, 10000, device="cuda") * 7  # 10 chunks of 1024: variants no other test compiles
    before = _compiled_variants("argmax.triton_kernels")
    with compile_only():
        argmax_rows(x, block=1024)
    assert _compiled_variants("argmax.triton_kernels") == before + 2  # chunk and merge kernels
    assert torch.equal(argmax_rows(x, block=1024), x.argmax(dim=-1))  # compiled: launched now, nothing new
    assert _compiled_variants("argmax.triton_kernels") == before + 2


@pytest.mark.skipif(not CUDA, reason="the engine's CUDA path: decode graphs, Triton")
@pytest.mark.parametrize("compile_layers, hidden_size, vocab_size", [(True, 256, 1000), (False, 512, 1200)])
def test_cuda_first_calls_compile_no_kernel_of_ours(compile_layers, hidden_size, vocab_size):
    """The construction leaves the first prompt steps and decode buckets nothing of ours to compile, with compiled
    layers and with the fused eager ones; each case has a head size and vocabulary of its own, so that its kernel variants are
    new in this process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged_transformers import EngineConfig, LLMEngine, SamplingParams

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    modules = ("paged_attention.triton_kernels", "cache_ops.triton_kernels", "argmax.triton_kernels",
               "gemv.triton_kernels", "layer_ops.triton_kernels")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    config = EngineConfig(max_model_len=1024, max_num_seqs=16, compile_layers=compile_layers)
    with LLMEngine(model, engine_config=config) as engine:
        plan = engine.execution_plan
        assert plan.cuda_graphs
        assert plan.layers is (LayerPath.COMPILED if compile_layers else LayerPath.FUSED)  # uncompiled: fused layers
        after_construction = {m: _compiled_variants(m) for m in modules}
        for batch in (1, 2, 3, 16):  # prompt steps, then decode graphs of the buckets 1, 2, 4, 16
            for i in range(batch):
                engine.add_request(f"{batch}-{i}", list(range(1, 40 + i)), params)
            while engine.has_unfinished_requests():
                engine.step()
        assert {m: _compiled_variants(m) for m in modules} == after_construction


@pytest.mark.slow
def test_a_short_max_model_len_compiles():
    """The warm-ups' prompt step is no longer than ``max_model_len`` (GPT-2 with 16 learned positions, under
    ``WARMUP_PROMPT_TOKENS``; a longer dummy prompt indexes past its position table): the layers compile (no
    ``compile_error``) and give stock's greedy tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from conftest import engine_greedy, stock_greedy
    from paged_transformers import EngineConfig, LLMEngine

    torch.manual_seed(4)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=1, eos_token_id=2)).eval()
    model.generation_config.pad_token_id = 2
    prompt = [5, 9, 17]
    ref = stock_greedy(model, prompt, 5)[0]
    config = EngineConfig(compile_layers=True, attention_backend="torch", max_num_seqs=1, block_size=4)
    with LLMEngine(model, engine_config=config) as engine:
        assert engine.max_model_len == 16
        assert engine.execution_plan.layers is LayerPath.COMPILED and engine.execution_plan.compile_error is None
        assert engine_greedy(engine, [prompt], [5]) == [ref]


def test_a_failed_compile_is_logged_and_leaves_no_mode_behind(caplog):
    """A compile that fails in the pool (as a kernel variant Triton cannot build would) is logged when
    ``compile_only`` is left, not raised, and Triton's async mode is cleared, so the next ``compile_only`` works."""
    import inspect

    async_compile = pytest.importorskip("triton.runtime._async_compile")

    def broken():
        raise ValueError("no such variant")

    with caplog.at_level("WARNING", logger="paged_transformers"):
        with compile_only():
            mode = async_compile.active_mode.get()
            extra = [lambda future: None] if len(inspect.signature(mode.submit).parameters) > 3 else []
            mode.submit("broken-key", broken, lambda kernel: None, *extra)  # Triton 3.9 also takes a cleanup
    assert "no such variant" in caplog.text
    assert async_compile.active_mode.get() is None
    with compile_only():
        assert async_compile.active_mode.get() is not None


def test_inside_a_callers_own_async_mode_launches_run_as_outside():
    from concurrent.futures import ThreadPoolExecutor

    async_compile = pytest.importorskip("triton.runtime._async_compile")
    with ThreadPoolExecutor(1) as pool, async_compile.AsyncCompileMode(pool) as theirs:
        with compile_only():
            assert async_compile.active_mode.get() is theirs and not _launch._COMPILE_ONLY.get()
        assert async_compile.active_mode.get() is theirs
