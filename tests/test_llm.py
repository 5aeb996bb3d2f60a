"""``LLM``, vLLM's offline API, and its ``ModelEngine`` alias: on the embedded SmolLM2-135M-Instruct (fp32, CPU),
greedy ``generate`` and ``chat`` give stock ``model.generate()``'s tokens; every prompt form comes back in order;
the quick-start examples run; bad arguments are refused, naming the value, before any weight is loaded."""

import runpy
import sys
from pathlib import Path

import pytest
import torch

import paged_transformers.integration.checkpoint as checkpoint_module
from conftest import assert_pool_whole, make_tiny_model, stock_greedy
from paged_transformers import LLM, EngineConfig, LLMEngine, ModelEngine, SamplingParams, paged_generate
from paged_transformers.integration import warm
from paged_transformers.default_model import default_model_path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures" / "models"
TIE_TOL = 1e-3  # logits, as in test_smollm2: below it a greedy step is a near tie that attention order may flip
SMALL = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20)  # 91 blocks of 16 tokens for SmolLM2 in fp32
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(smollm2):
    """One ``LLM`` on the embedded model's folder for the module (its own copy of the weights, so the session's
    ``smollm2`` model stays free for stock references)."""
    with LLM(str(default_model_path()), **SMALL) as llm:
        yield llm


def assert_stock_tokens(got: list[int], want: list[int], margins: list[float], what: str) -> None:
    """``got`` equals stock's ``want`` up to the first near tie (equal in full when there is none)."""
    tie = next((k for k, m in enumerate(margins) if m < TIE_TOL), len(want))
    assert got[:tie] == want[:tie], f"{what}: LLM {got} != stock {want}"
    if tie == len(want):
        assert got == want, f"{what}: LLM {got} != stock {want}"


def test_greedy_generate_equals_paged_generate_and_stock(llm, smollm2):
    model, tokenizer = smollm2
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    paged = paged_generate(model, prompts, GREEDY, tokenizer=tokenizer, engine_config=EngineConfig(**SMALL), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, paged)):
        ids = tokenizer(prompts[i]).input_ids
        assert out.prompt == prompts[i] and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].text == ref.outputs[0].text and out.outputs[0].finish_reason == ref.outputs[0].finish_reason
        assert_stock_tokens(out.outputs[0].token_ids, *stock_greedy(model, ids, GREEDY.max_tokens), f"prompt {i}")
    assert "Paris" in outs[0].outputs[0].text


def first_word_token(tokenizer, new: list[int]) -> int:
    """Index of the first output token after the first that is an ordinary word (letters) seen for the first time."""
    return next(k for k in range(1, len(new)) if tokenizer.decode([new[k]]).strip().isalpha() and new[k] not in new[:k])


def test_stop_token_id_text_left_out(llm, smollm2):
    """A request ended by an ordinary word token of ``stop_token_ids`` used to keep that token's text; as in vLLM,
    ``token_ids`` end with it and ``text`` leaves it out (kept with ``include_stop_str_in_output``), in ``LLM`` and
    ``paged_generate``. Reference: stock ``generate()``'s greedy tokens, decoded."""
    model, tokenizer = smollm2
    prompt = "The capital of France is"
    new, _ = stock_greedy(model, tokenizer(prompt).input_ids, 8)
    k = first_word_token(tokenizer, new)
    stop_id, word = new[k], tokenizer.decode([new[k]]).strip()
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id], include_stop_str_in_output=include)
        outs = [llm.generate([prompt], params, use_tqdm=False)[0],
                paged_generate(model, [prompt], params, tokenizer=tokenizer, engine_config=EngineConfig(**SMALL),
                               use_tqdm=False)[0]]  # fmt: skip
        for what, out in zip(("LLM", "paged_generate"), outs):
            comp = out.outputs[0]
            assert comp.token_ids == new[: k + 1] and (comp.finish_reason, comp.stop_reason) == ("stop", stop_id), what
            assert comp.text == tokenizer.decode(new[: k + 1 if include else k], skip_special_tokens=True), what
            assert (word in comp.text) == include, (what, word, comp.text)


@pytest.mark.slow
def test_chat_equals_stock_on_the_templated_prompt(llm, smollm2):
    model, tokenizer = smollm2
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What color is the sky?"}],
    ]
    outs = llm.chat(conversations, GREEDY, use_tqdm=False)
    (single,) = llm.chat(conversations[0], GREEDY, use_tqdm=False)  # one conversation, not a list of them
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids
    for i, (conversation, out) in enumerate(zip(conversations, outs)):
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
        assert out.prompt_token_ids == ids
        assert out.prompt == tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert_stock_tokens(out.outputs[0].token_ids, *stock_greedy(model, ids, GREEDY.max_tokens), f"conversation {i}")


def test_a_lone_surrogate_is_a_value_error_naming_the_prompt(llm):
    """A lone UTF-16 surrogate (``"\\ud800"`` in JSON) has no UTF-8 encoding: the tokenizer used to raise a
    TypeError; ``generate`` and ``chat`` raise a ValueError naming the prompt or conversation, nothing queued."""
    with pytest.raises(ValueError, match=r"^prompt 1: .*surrogate U\+D800 at character 3"):
        llm.generate(["fine", "hi \ud800 there"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^conversation 1 has a lone UTF-16 surrogate U\+DC00"):
        llm.chat([[{"role": "user", "content": "fine"}], [{"role": "user", "content": "x \udc00"}]], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.requests
    assert llm.generate(["fine"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("messages", [
    [{"role": "user"}],  # no content: used to surface as jinja2's UndefinedError
    [[{"role": "user", "content": "hi"}], [{"content": "no role"}]],
    [],
], ids=["no-content", "no-role-in-second", "empty"])
def test_malformed_conversation_is_a_value_error(llm, messages):
    with pytest.raises(ValueError, match=r"messages must be|conversation \d"):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats().num_used_blocks == 0


def test_every_prompt_form_in_input_order(llm, smollm2):
    model, tokenizer = smollm2
    texts = ["Hello", "The quick brown fox", "1, 2, 3, 4, 5,", "Water boils at"]
    ids = [tokenizer(t).input_ids for t in texts]
    params = SamplingParams(temperature=0, max_tokens=4)
    mixed = [texts[0], ids[1], {"prompt": texts[2]}, {"prompt_token_ids": ids[3]}]
    outs = llm.generate(mixed, params, use_tqdm=False)
    assert [o.prompt for o in outs] == [texts[0], None, texts[2], None]
    assert [o.prompt_token_ids for o in outs] == ids
    for i, out in enumerate(outs):
        assert_stock_tokens(out.outputs[0].token_ids, *stock_greedy(model, ids[i], 4), f"prompt {i}")
    # one prompt alone, in each form, gives a one-element list with the same tokens
    alone = [texts[0], ids[0], {"prompt": texts[0]}, {"prompt_token_ids": ids[0], "prompt": texts[0]}]
    for prompt in alone:
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        assert out.prompt_token_ids == ids[0] and out.outputs[0].token_ids == outs[0].outputs[0].token_ids, prompt
        assert out.prompt == (None if prompt is ids[0] else texts[0])
    # one SamplingParams per prompt
    per_prompt = llm.generate(texts[:2], [SamplingParams(temperature=0, max_tokens=n) for n in (2, 3)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [2, 3]


def test_the_engine_is_warm_across_calls(llm):
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine) and llm.get_tokenizer() is engine.tokenizer
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert llm.llm_engine is engine and not engine.closed


def test_sleep_and_wake_up_keep_outputs(llm):
    if not hasattr(LLMEngine, "sleep"):
        pytest.skip("this LLMEngine has no sleep()/wake_up()")
    before = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.sleep()
    llm.wake_up()
    assert llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


def test_default_sampling_params_are_the_models_generation_config(llm):
    assert llm.get_default_sampling_params() == SamplingParams()  # SmolLM2 sets no sampling field
    model = make_tiny_model("llama")
    gc = model.generation_config
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k, gc.max_new_tokens = False, 0.6, 0.9, 20, 7
    with LLM(model, kv_cache_memory_bytes=1 << 20, seed=None) as tiny:
        params = tiny.get_default_sampling_params()
    # vLLM's rule: these fields as the generation config sets them, do_sample not read
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 7)


def test_a_loaded_model_generates_as_stock():
    model = make_tiny_model("qwen2")
    prompts = [[5, 6, 7, 8], [9, 10]]
    refs = [stock_greedy(model, p, 6) for p in prompts]
    attention = model.config._attn_implementation
    with LLM(model, kv_cache_memory_bytes=1 << 20) as llm:
        assert llm.get_tokenizer() is None
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_stock_tokens(out.outputs[0].token_ids, *ref, f"prompt {i}")
    assert model.config._attn_implementation == attention  # closed: the model has its attention back


@pytest.mark.parametrize(
    "script, max_tokens, expected",
    [
        ("quickstart_greedy.py", 3, ["Paris"]),
        ("quickstart_basic.py", 3, ["Prompt:    'Hello, my name is'", "Prompt:    'The future of AI is'"]),
        ("quickstart_throughput.py", 2, ["32 prompts", "output tokens/s"]),
    ],
)
def test_quickstart_examples_run(smollm2, monkeypatch, capsys, script, max_tokens, expected):
    """Each example runs as ``__main__`` with the embedded model (through ``$PAGED_TRANSFORMERS_MODEL``), in this
    process: a subprocess each would spend most of its time importing torch and transformers again."""
    path = str(REPO / "examples" / script)
    monkeypatch.setenv("PAGED_TRANSFORMERS_MODEL", str(default_model_path()))
    monkeypatch.setattr(sys, "argv", [path, "--max-tokens", str(max_tokens)])
    namespace = runpy.run_path(path, run_name="__main__")
    namespace["llm"].close()
    printed = capsys.readouterr().out
    for text in expected:
        assert text in printed, printed
    if script == "quickstart_basic.py":
        assert printed.count("Output:") == 5


# -- bad input: refused before any weight is loaded or any engine built -----------------------------------


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Make loading weights or building an engine fail the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("weights were loaded or an engine built for a bad argument")

    monkeypatch.setattr(checkpoint_module, "load_model", forbidden)
    monkeypatch.setattr(warm, "engine_for", forbidden)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(model="/nonexistent/model-folder"), ValueError, "'/nonexistent/model-folder': no such model folder"),
        (dict(quantization="int3"), ValueError, "one of ['gptq', 'awq'], got 'int3'"),
        (dict(quantization="gptq"), ValueError, "quantization='gptq', but the checkpoint"),
        (dict(tensor_parallel_size=2), ValueError, "tensor_parallel_size=2 does not divide LlamaForCausalLM's num_attention_heads=9"),
        (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size must be a positive integer, got 0"),
        (dict(dtype="int8"), ValueError, "got 'int8'"),
        (dict(seed="0"), ValueError, "seed must be an integer or None, got '0'"),
        (dict(block_size=0), ValueError, "block_size must be a positive integer, got 0"),
        (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization must be in (0, 1], got 1.5"),
        (dict(max_model_len=100_000), ValueError, "max_model_len=100000 exceeds the model's max_position_embeddings=8192"),
        (dict(device="nodevice"), ValueError, "device 'nodevice'"),
        (dict(swap_space=4), TypeError, "unexpected keyword arguments ['swap_space']"),
    ],
    ids=["missing-folder", "unknown-quantization", "quantization-of-a-plain-checkpoint", "tensor-parallel", "tp-zero",
         "dtype", "seed", "block-size", "gpu-memory-utilization", "max-model-len", "device", "unknown-kwarg"],
)
def test_bad_arguments_are_refused_before_loading(smollm2, nothing_loaded, kwargs, error, message):
    kwargs = dict(model=str(default_model_path()), **SMALL) | kwargs
    with pytest.raises(error) as e:
        LLM(**kwargs)
    assert message in str(e.value)


def test_uncached_hub_id_offline_fails_without_network(nothing_loaded, monkeypatch):
    """With HF_HUB_OFFLINE set, only the local cache is looked at: no download is tried (so no retries)."""
    import huggingface_hub
    from huggingface_hub import constants

    calls = []
    real = huggingface_hub.snapshot_download

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="'no-such-org/no-such-model-xyz' is not available offline.*HF_HUB_OFFLINE"):
        LLM("no-such-org/no-such-model-xyz")
    assert calls and all(c.get("local_files_only") for c in calls), calls


@pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"fixtures folder {FIXTURES} is missing")
def test_quantization_contradicting_the_checkpoint(nothing_loaded):
    with pytest.raises(ValueError, match="quantization='awq', but the checkpoint .* is quantized with 'gptq'"):
        LLM(str(FIXTURES / "smollm2-135m-instruct-gptq-4bit-g64"), quantization="awq")


def test_a_pool_too_small_leaves_the_model_as_it_was():
    model = make_tiny_model("llama")
    attention = model.config._attn_implementation
    with pytest.raises(ValueError, match="the KV pool holds"):
        LLM(model, kv_cache_memory_bytes=1024)
    assert model.config._attn_implementation == attention
    model(torch.tensor([[1, 2, 3]]))  # stock forward works: no engine left on it


def test_model_engine_aliases():
    model = make_tiny_model("llama")
    with ModelEngine(model=model, max_context_length=256, max_concurrent_requests=4, max_tokens_per_batch=64,
                     max_num_seqs=4, kv_cache_memory_bytes=1 << 20) as engine:  # fmt: skip
        config = engine.llm_engine.config
        assert (config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens) == (256, 4, 64)
        (out,) = engine.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("alias, name", list(ModelEngine.ALIASES.items()))
def test_model_engine_alias_and_vllm_name_disagreeing(nothing_loaded, alias, name):
    with pytest.raises(ValueError, match=f"{alias}=128 and {name}=256"):
        ModelEngine(model="unused", **{alias: 128, name: 256})


def test_a_refused_sampling_params_leaves_no_request_on_the_warm_engine(llm):
    prompts = ["Hello", "The quick brown fox"]
    with pytest.raises(ValueError, match="n=100000 exceeds max_num_seqs=256"):
        llm.generate(prompts, [SamplingParams(max_tokens=2), SamplingParams(n=100_000)], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_pool_whole(llm.llm_engine)
    (out,) = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_cli_generate_goes_through_llm(smollm2, monkeypatch, capsys):
    import paged_transformers.cli as cli
    import paged_transformers.entrypoints.llm as llm_module

    built = []

    class RecordingLLM(LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(llm_module, "LLM", RecordingLLM)  # the generate command imports it when it runs
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    assert cli.main(["generate", "--chat", "--max-tokens", "4", "--max-model-len", "512", conversation[0]["content"]]) == 0
    (llm,) = built
    assert llm.engine_config.max_model_len == 512
    rendered = smollm2[1].apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert f"--- [0] {rendered!r}" in capsys.readouterr().out


def test_server_options_reach_the_engine(smollm2):
    """The server's vLLM options, parsed as ``serve`` parses them, give the ``LLM`` they name: the KV pool of
    ``--num-gpu-blocks-override``, the ``--max-context-length`` alias of ``--max-model-len``."""
    pytest.importorskip("fastapi")
    from paged_transformers.entrypoints.openai.cli_args import llm_arguments, make_arg_parser

    args = make_arg_parser().parse_args(["--model", str(default_model_path()), "--num-gpu-blocks-override", "40",
                                         "--max-context-length", "256", "--max-num-seqs", "4", "--device", "cpu"])
    with LLM(str(default_model_path()), **llm_arguments(args)) as llm:
        engine = llm.llm_engine
        assert engine.stats().num_blocks == 40
        assert engine.config.max_model_len == 256 and engine.config.max_num_seqs == 4
