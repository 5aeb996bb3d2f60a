"""Bad input: each case raises a ValueError that names the bad value, leaves the other requests running
with unchanged results, and leaks no KV block.

Policy for prompt + max_tokens over max_model_len (EngineConfig docstring): the request is accepted and
capped; it finishes with ``finish_reason="length"`` when it reaches ``max_model_len`` tokens.
"""

import pathlib
import re

import pytest
import torch
import transformers
from torch import nn

from conftest import VOCAB_SIZE, assert_pool_whole, check_block_invariants, make_tiny_model, random_prompts, stock_greedy
from paged_transformers import EngineConfig, LLMEngine, SamplingParams, load_model, paged_generate

PROMPTS = random_prompts(3, 10, 40, seed=3)
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
CONFIG = EngineConfig(block_size=8, max_model_len=64, max_num_batched_tokens=16)  # chunked, several steps


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


def assert_rejected_mid_run(model, bad_call, match: str) -> None:
    """Start three greedy requests, step twice, make ``bad_call(engine)`` (it must raise a ValueError
    matching ``match``), then finish: nothing was queued or allocated by the bad call, the three
    results equal stock generate, and the pool is whole."""
    with LLMEngine(model, engine_config=CONFIG) as engine:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, GREEDY)
        results = {}
        for _ in range(2):
            for out in engine.step():
                results[out.request_id] = out
        bm = engine.cache.block_manager
        before = (bm.num_free_blocks, {k: list(v) for k, v in bm.block_tables.items()}, list(engine.requests),
                  len(engine.scheduler.waiting), len(engine.scheduler.running))
        with pytest.raises(ValueError, match=match):
            bad_call(engine)
        after = (bm.num_free_blocks, {k: list(v) for k, v in bm.block_tables.items()}, list(engine.requests),
                 len(engine.scheduler.waiting), len(engine.scheduler.running))
        assert after == before, "the rejected request changed the engine's state"
        while engine.has_unfinished_requests():
            for out in engine.step():
                results[out.request_id] = out
            check_block_invariants(engine)
        assert_pool_whole(engine)
    assert sorted(results) == ["0", "1", "2"]
    for i, prompt in enumerate(PROMPTS):
        assert results[str(i)].outputs[0].token_ids == stock_greedy(model, prompt, MAX_TOKENS)[0]


# -- prompts -------------------------------------------------------------------------------------
def test_empty_prompt(llama):
    assert_rejected_mid_run(llama, lambda e: e.add_request("bad", [], GREEDY), "empty")
    with pytest.raises(ValueError, match=r"prompt 1: .*empty"):
        paged_generate(llama, [[5, 6], []], GREEDY, use_tqdm=False)


def test_prompt_longer_than_max_model_len(llama):
    too_long = list(range(3, 3 + 70))  # 70 tokens, max_model_len 64
    assert_rejected_mid_run(llama, lambda e: e.add_request("bad", too_long, GREEDY), r"70 tokens.*max_model_len=64")
    # paged_generate checks every prompt before queuing any: no block was ever allocated.
    allocated = []
    original = LLMEngine.add_request

    def spy(self, *args, **kwargs):
        allocated.append(self.cache.block_manager.num_used_blocks)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LLMEngine, "add_request", spy)
        with pytest.raises(ValueError, match=r"prompt 2: .*70 tokens"):
            paged_generate(llama, [PROMPTS[0], PROMPTS[1], too_long], GREEDY, engine_config=CONFIG, use_tqdm=False)
    assert allocated == [], "requests were queued before the bad prompt was found"
    assert llama.config._attn_implementation != "paged_transformers"


def test_prompt_plus_max_tokens_over_max_model_len_is_capped(llama, engine_spy):
    """Policy: cap. 60 prompt tokens + max_tokens 20 under max_model_len 64 -> 4 tokens, "length"."""
    prompt = random_prompts(1, 60, 60, seed=9)[0]
    outs = paged_generate(
        llama, [prompt, PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        engine_config=CONFIG, use_tqdm=False,
    )
    capped, other = outs[0].outputs[0], outs[1].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 64 - 60
    assert capped.token_ids == stock_greedy(llama, prompt, 4)[0]
    assert other.finish_reason == "length" and len(other.token_ids) == 20
    assert other.token_ids == stock_greedy(llama, PROMPTS[0], 20)[0]
    assert_pool_whole(engine_spy[0])
    # A prompt of exactly max_model_len tokens leaves no room for an output token: rejected.
    with pytest.raises(ValueError, match=r"64 tokens.*max_model_len=64"):
        paged_generate(llama, [list(range(3, 67))], GREEDY, engine_config=CONFIG, use_tqdm=False)


@pytest.mark.parametrize("bad_ids", [[5, -1, 6], [5, VOCAB_SIZE]], ids=["negative", "vocab"])
def test_token_ids_outside_the_vocabulary(llama, bad_ids):
    assert_rejected_mid_run(llama, lambda e: e.add_request("bad", bad_ids, GREEDY), rf"vocabulary.*\[{bad_ids[1]}\]")


@pytest.mark.parametrize(
    "prompt, match",
    [([5, 2.0], r"integers.*2\.0 \(float\)"), ([True, 5], r"integers.*True \(bool\)"),
     (["1", "2"], r"integers.*'1' \(str\)"), ([[5, 6]], r"integers.*\[5, 6\] \(list\)"),
     (torch.tensor([[5, 6]]), r"1-D.*shape \(1, 2\).*separate prompts"), (torch.tensor(5), r"1-D.*Tensor of shape \(\)")],
    ids=["float", "bool", "str", "nested", "2-D tensor", "0-d tensor"],
)
def test_token_ids_of_the_wrong_type_or_shape(llama, prompt, match):
    """The message names the type or shape, not the vocabulary range (it used to say "outside the vocabulary")."""
    def bad_call(engine):
        with pytest.raises(ValueError) as info:
            engine.add_request("bad", prompt, GREEDY)
        assert "vocabulary" not in str(info.value)
        raise info.value

    assert_rejected_mid_run(llama, bad_call, match)


def test_numpy_and_tensor_token_ids_are_accepted(llama):
    np = pytest.importorskip("numpy")
    ids = PROMPTS[0]
    outs = paged_generate(llama, [torch.tensor(ids), np.array(ids), [np.int64(t) for t in ids]], GREEDY, use_tqdm=False)
    want = stock_greedy(llama, ids, MAX_TOKENS)[0]
    assert [o.outputs[0].token_ids for o in outs] == [want] * 3


def test_string_prompt_without_tokenizer(llama):
    assert_rejected_mid_run(llama, lambda e: e.add_request("bad", "hello there", GREEDY), r"'hello there'.*tokenizer")
    with pytest.raises(ValueError, match=r"prompt 0: .*'hi'.*tokenizer"):
        paged_generate(llama, ["hi"], GREEDY, use_tqdm=False)


def test_prompt_of_another_type(llama):
    assert_rejected_mid_run(llama, lambda e: e.add_request("bad", 42, GREEDY), r"int")


def test_duplicate_request_id(llama):
    assert_rejected_mid_run(llama, lambda e: e.add_request("1", PROMPTS[0], GREEDY), r"'1'")


# -- sampling parameters --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", 0), ("max_tokens", -3), ("temperature", -0.5), ("temperature", float("nan")), ("top_p", 0.0),
     ("top_p", 1.5), ("top_p", -0.1), ("top_k", -2), ("min_p", 1.5), ("min_tokens", -1), ("n", 0),
     ("temperature", "0.5"), ("top_p", None), ("max_tokens", 2.0), ("temperature", float("inf")),
     ("repetition_penalty", float("inf")), ("top_k", True), ("ignore_eos", "no"), ("stop", None),
     ("stop_token_ids", None), ("logits_processors", print), ("seed", True), ("seed", 1.5)],
)
def test_sampling_params_out_of_range(field, value):
    with pytest.raises(ValueError, match=rf"{field}.*{re.escape(repr(value))}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [("n", 0), ("temperature", float("nan")), ("repetition_penalty", 0.0), ("max_tokens", 0), ("top_k", -7),
     ("top_p", 0.0), ("stop_token_ids", [-3]), ("logits_processors", [None]), ("seed", True)],
)
def test_sampling_params_changed_after_construction_are_checked_at_add_request(llama, field, value):
    """``n=0`` used to register a request that never finished (every drain loop hung); NaN temperature or
    ``repetition_penalty=0`` failed ``step()`` for the whole batch. Now add_request refuses them."""
    params = SamplingParams(temperature=0.5, max_tokens=4, seed=1)
    setattr(params, field, value)
    shown = re.escape(repr(value[0] if field == "logits_processors" else value))
    assert_rejected_mid_run(llama, lambda e: e.add_request("bad", PROMPTS[0], params), rf"{field}.*{shown}")


def test_sampling_params_changed_after_add_request_do_not_reach_it(llama):
    want = {request_id: stock_greedy(llama, prompt, MAX_TOKENS)[0] for request_id, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1]))}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[])
    with LLMEngine(llama, engine_config=CONFIG) as engine:
        engine.add_request("a", PROMPTS[0], params)
        engine.add_request("b", PROMPTS[1], GREEDY)
        engine.step()
        params.max_tokens, params.temperature = 1, float("nan")
        params.stop_token_ids.append(want["a"][0])
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    assert {request_id: out.token_ids for request_id, out in outs.items()} == want


def test_numpy_integers_in_sampling_params(llama):
    np = pytest.importorskip("numpy")
    params = SamplingParams(n=np.int32(2), temperature=1.0, seed=np.int64(7), max_tokens=np.int64(5), top_k=np.int64(20),
                            logprobs=np.int64(2), stop_token_ids=[np.int64(VOCAB_SIZE - 1)])
    for name in ("n", "seed", "max_tokens", "top_k", "logprobs"):
        assert type(getattr(params, name)) is int
    assert params.stop_token_ids == [VOCAB_SIZE - 1] and type(params.stop_token_ids[0]) is int
    plain = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5, top_k=20, logprobs=2, stop_token_ids=[VOCAB_SIZE - 1])
    outs = paged_generate(llama, [PROMPTS[0]] * 2, [params, plain], use_tqdm=False)
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in outs[1].outputs]
    with pytest.raises(ValueError, match=r"seed.*True"):
        SamplingParams(seed=np.True_)


def test_min_tokens_over_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens=5.*max_tokens=2"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_bad_sampling_params_object(llama):
    assert_rejected_mid_run(llama, lambda e: e.add_request("bad", PROMPTS[0], {"max_tokens": 3}), r"SamplingParams.*dict")
    with pytest.raises(ValueError, match=r"2 sampling_params for 3 prompts"):
        paged_generate(llama, PROMPTS, [GREEDY, GREEDY], use_tqdm=False)


# -- models and engine configuration ---------------------------------------------------------------
class ToyAttention(nn.Module):
    """Attention that calls torch directly, not through transformers' attention interface."""

    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class ToyConfig(transformers.PretrainedConfig):
    model_type = "paged_transformers_toy"

    def __init__(self, vocab_size=32, hidden_size=16, num_attention_heads=1, num_hidden_layers=1,
                 max_position_embeddings=64, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_attention_heads, self.num_hidden_layers = num_attention_heads, num_hidden_layers
        self.max_position_embeddings = max_position_embeddings


class ToyForCausalLM(transformers.PreTrainedModel):
    config_class = ToyConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.attn = ToyAttention(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids, **kwargs):
        return transformers.modeling_outputs.CausalLMOutput(logits=self.lm_head(self.attn(self.embed(input_ids))))


def _non_interface_models():
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=4)
    )
    return {"bloom": bloom, "custom": ToyForCausalLM(ToyConfig()), "mamba": mamba}


@pytest.mark.parametrize("name", ["bloom", "custom", "mamba"])
def test_model_without_attention_interface(name):
    model = _non_interface_models()[name].eval()
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=type(model).__name__):
        LLMEngine(model, engine_config=EngineConfig(max_model_len=64))
    with pytest.raises(ValueError, match=type(model).__name__):
        paged_generate(model, [[1, 2, 3]], GREEDY, engine_config=EngineConfig(max_model_len=64), use_tqdm=False)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("given", ["some/model", pathlib.Path("checkpoints/model"), None], ids=["str", "path", "none"])
def test_model_given_as_a_path(given):
    """A path or hub id used to fail with AttributeError: 'PosixPath' object has no attribute 'config'."""
    match = r"loaded transformers model.*got " + ("NoneType" if given is None else rf"{type(given).__name__}.*load_model\(")
    with pytest.raises(ValueError, match=match):
        LLMEngine(given)
    with pytest.raises(ValueError, match=match):
        paged_generate(given, [[1, 2, 3]], GREEDY, use_tqdm=False)


def test_load_model_missing_folder(tmp_path):
    """It used to raise huggingface_hub's HFValidationError (the path taken for a malformed hub id)."""
    for missing in (tmp_path / "nope", str(tmp_path / "nope"), "./no/such/folder", pathlib.Path("org/name")):
        with pytest.raises(ValueError, match=r"folder .*does not exist"):
            load_model(missing, device="cpu")


def test_load_model_dtype_auto(tmp_path):
    """``dtype="auto"`` used to raise ValueError; it reads the checkpoint's dtype, as ``from_pretrained`` does."""
    make_tiny_model("llama").to(torch.float16).save_pretrained(tmp_path)
    auto = load_model(tmp_path, dtype="auto", device="cpu")
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto")
    assert {p.dtype for p in auto.parameters()} == {p.dtype for p in stock.parameters()} == {torch.float16}
    assert all(torch.equal(a, b) for a, b in zip(auto.state_dict().values(), stock.state_dict().values()))


def test_pool_too_small_for_one_max_length_request(llama):
    with pytest.raises(ValueError, match=r"3 blocks of 16 tokens.*13 blocks one max_model_len=200"):
        LLMEngine(llama, engine_config=EngineConfig(block_size=16, num_gpu_blocks=3, max_model_len=200))
    # The same from a byte budget: 4 KiB holds no 16-token block of this model (2 layers x K,V x 2 heads x 16 x fp32 = 8 KiB).
    with pytest.raises(ValueError, match=r"0 blocks.*max_model_len=200"):
        paged_generate(llama, PROMPTS, GREEDY, use_tqdm=False,
                       engine_config=EngineConfig(kv_cache_memory_bytes=4096, max_model_len=200))
    assert llama.config._attn_implementation != "paged_transformers"


def test_max_model_len_over_the_model(llama):
    with pytest.raises(ValueError, match=r"max_model_len=1000.*max_position_embeddings=512"):
        LLMEngine(llama, engine_config=EngineConfig(max_model_len=1000))


@pytest.mark.parametrize(
    "field, value", [("block_size", 0), ("max_num_seqs", -1), ("max_num_batched_tokens", 0), ("num_gpu_blocks", 0),
                     ("max_model_len", -5), ("gpu_memory_utilization", 1.5), ("attention_backend", "cuda"),
                     ("gpu_memory_utilization", "0.9"), ("enforce_eager", "no"), ("enable_prefix_caching", 1),
                     ("max_model_len", 1)],
)
def test_engine_config_out_of_range(field, value):
    with pytest.raises(ValueError, match=rf"{field}.*{re.escape(repr(value))}"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("block_size", 0), ("max_num_seqs", -1), ("attention_backend", "cuda")])
def test_engine_config_changed_after_construction(llama, field, value):
    """``cfg.block_size = 0`` used to reach the sizing code (ZeroDivisionError); the engine checks again."""
    config = EngineConfig(max_model_len=64)
    setattr(config, field, value)
    before = llama.config._attn_implementation
    with pytest.raises(ValueError, match=rf"{field}.*{re.escape(repr(value))}"):
        LLMEngine(llama, engine_config=config)
    assert llama.config._attn_implementation == before
    # changing the config while an engine runs does not reach that engine (it keeps its own copy)
    config = EngineConfig(max_model_len=64, max_num_seqs=4)
    with LLMEngine(llama, engine_config=config) as engine:
        config.max_num_seqs = 1
        assert engine.config.max_num_seqs == 4 and engine.scheduler.config.max_num_seqs == 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("fill, count, message", [
    (float("-inf"), None, "no finite logit"), (float("inf"), None, "no finite logit"),
    (float("nan"), None, "NaN logits"), (float("nan"), 3, "3 NaN logits"),
], ids=["all--inf", "all-+inf", "all-nan", "three-nan"])
def test_logits_processor_leaving_no_finite_logit_fails_only_its_request(llama, fill, count, message, temperature,
                                                                          engine_spy):
    """The error says what the processor left: NaNs (how many), or no finite logit at all."""
    def broken(input_ids, scores):
        if count is None:
            return torch.full_like(scores, fill)
        scores = scores.clone()
        scores[0, :count] = fill
        return scores

    params = [SamplingParams(temperature=temperature, max_tokens=4, logits_processors=[broken])]
    params += [SamplingParams(temperature=1.0, seed=3, max_tokens=4), GREEDY]
    outs = paged_generate(llama, PROMPTS, params, use_tqdm=False)
    bad = outs[0].outputs[0]
    assert bad.finish_reason == "abort" and isinstance(bad.error, ValueError) and message in str(bad.error), bad.error
    assert outs[2].outputs[0].token_ids == stock_greedy(llama, PROMPTS[2], MAX_TOKENS)[0]
    assert len(outs[1].outputs[0].token_ids) == 4
    assert_pool_whole(engine_spy[0])


@pytest.mark.parametrize(
    "returned, match",
    [(lambda s: s[0], rf"shape \[1, {VOCAB_SIZE}\].*got shape \[{VOCAB_SIZE}\]"), (lambda s: None, "got NoneType"),
     (lambda s: s.numpy(), "got ndarray"), (lambda s: torch.cat([s, s]), rf"got shape \[2, {VOCAB_SIZE}\]")],
    ids=["1-D", "None", "numpy", "two rows"],
)
def test_logits_processor_returning_the_wrong_shape_fails_only_its_request(llama, returned, match, engine_spy):
    """A 1-D ``[vocab]`` return used to broadcast into the row silently (token 0 at every step)."""
    params = [SamplingParams(temperature=0.0, max_tokens=4, logits_processors=[lambda ids, s: returned(s)])]
    params += [SamplingParams(temperature=1.0, seed=3, max_tokens=4), GREEDY]
    outs = paged_generate(llama, PROMPTS, params, use_tqdm=False)
    bad = outs[0].outputs[0]
    assert bad.finish_reason == "abort" and bad.token_ids == []
    assert isinstance(bad.error, ValueError) and re.search(match, str(bad.error)), bad.error
    assert outs[2].outputs[0].token_ids == stock_greedy(llama, PROMPTS[2], MAX_TOKENS)[0]
    assert len(outs[1].outputs[0].token_ids) == 4
    assert_pool_whole(engine_spy[0])


def test_training_mode_with_attention_dropout_is_refused():
    model = make_tiny_model("llama", attention_dropout=0.1).train()
    with pytest.raises(RuntimeError, match=r"training mode with attention dropout 0.1.*model.eval\(\)"):
        paged_generate(model, [PROMPTS[0]], GREEDY, use_tqdm=False)
    assert model.config._attn_implementation != "paged_transformers"
    model.eval()
    assert paged_generate(model, [PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == stock_greedy(
        model, PROMPTS[0], MAX_TOKENS)[0]


def test_logprobs_over_the_vocabulary(llama):
    """It used to fail the whole batch at the first sampled token (torch.topk out of range)."""
    params = SamplingParams(max_tokens=3, logprobs=VOCAB_SIZE + 1)
    assert_rejected_mid_run(llama, lambda e: e.add_request("bad", PROMPTS[0], params), rf"logprobs={VOCAB_SIZE + 1}")
    full = paged_generate(llama, [PROMPTS[0]], SamplingParams(max_tokens=2, logprobs=VOCAB_SIZE), use_tqdm=False)
    assert all(len(step) == VOCAB_SIZE for step in full[0].outputs[0].logprobs)


# -- requests the engine cannot honour, and misuse of the engine --------------------------------------
def test_request_values_checked_against_the_engine(llama):
    assert_rejected_mid_run(llama, lambda e: e.add_request(7, PROMPTS[0], GREEDY), r"request_id.*7")
    assert_rejected_mid_run(
        llama, lambda e: e.add_request("bad", PROMPTS[0], SamplingParams(stop=["x"])), r"stop=\['x'\].*tokenizer"
    )
    assert_rejected_mid_run(
        llama, lambda e: e.add_request("bad", PROMPTS[0], SamplingParams(stop_token_ids=[VOCAB_SIZE])),
        rf"stop_token_ids.*\[{VOCAB_SIZE}\]",
    )


@pytest.mark.parametrize("prompts", ["abc", None, 5], ids=["str", "none", "int"])
def test_prompts_must_be_a_list(llama, prompts):
    with pytest.raises(ValueError, match="prompts must be a list"):
        paged_generate(llama, prompts, GREEDY, use_tqdm=False)


def test_engine_config_of_another_type(llama):
    with pytest.raises(ValueError, match="engine_config must be an EngineConfig, got dict"):
        paged_generate(llama, PROMPTS, GREEDY, engine_config={"block_size": 8}, use_tqdm=False)
    assert llama.config._attn_implementation != "paged_transformers"


def test_closed_engine_refuses_work(llama):
    engine = LLMEngine(llama, engine_config=CONFIG)
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.close()
    assert_pool_whole(engine)
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request("b", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


def test_second_engine_on_one_model_is_refused(llama):
    """One engine per model at a time: a second one is refused before it changes anything (two open
    engines used to leave compiled layers behind when closed in opening order)."""
    before = llama.config._attn_implementation
    first = LLMEngine(llama, engine_config=CONFIG)
    first.add_request("a", PROMPTS[0], GREEDY)
    hooks = (dict(llama._forward_hooks), dict(llama._forward_pre_hooks))
    with pytest.raises(ValueError, match="another LLMEngine"):
        LLMEngine(llama, engine_config=CONFIG)
    assert (dict(llama._forward_hooks), dict(llama._forward_pre_hooks)) == hooks  # nothing added
    outs = []
    while first.has_unfinished_requests():
        outs += first.step()  # the first engine is untouched
    assert outs[-1].finished
    first.close()
    assert llama.config._attn_implementation == before
    LLMEngine(llama, engine_config=CONFIG).close()  # free again once closed


def test_engine_whose_model_attention_was_switched_refuses_to_step(llama):
    """A model switched back to another attention while its engine is open would ignore the cache
    (silently wrong tokens): the engine refuses to step instead."""
    engine = LLMEngine(llama, engine_config=CONFIG)
    engine.add_request("a", PROMPTS[0], GREEDY)
    previous = engine._previous_attn
    llama.set_attn_implementation(previous)
    with pytest.raises(RuntimeError, match="attn_implementation.*switched"):
        engine.step()
    engine.close()
    assert llama.config._attn_implementation == previous
