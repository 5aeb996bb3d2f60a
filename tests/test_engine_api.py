"""The public API around the engine: ``LLMEngine`` (add_request / step / abort_request /
has_unfinished_requests / close) and ``paged_generate`` (input order, per-prompt SamplingParams,
generation_config defaults, progress bar). Greedy results are checked against stock generate.
"""

import pytest
import torch
from transformers import GenerationConfig

from conftest import assert_pool_whole, make_tiny_model, check_block_invariants, random_prompts, stock_greedy
from paged_transformers import EngineConfig, LLMEngine, RequestOutput, SamplingParams, paged_generate

PROMPTS = random_prompts(5, 3, 50, seed=4)


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def test_step_outputs_and_metrics(llama):
    want = stock_greedy(llama, PROMPTS[0], 3)[0]
    assert len(want) == 3, "the reference must not stop at EOS for this test"
    with LLMEngine(llama, engine_config=EngineConfig(block_size=8)) as engine:
        assert not engine.has_unfinished_requests() and engine.step() == []
        engine.add_request("x", PROMPTS[0], greedy(3))
        engine.add_request("y", PROMPTS[1], greedy(1))
        assert engine.has_unfinished_requests()
        first = engine.step()
        # Both prefilled in one step: each gets its first token; y is done (max_tokens 1).
        assert [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in first] == [("x", 1, False), ("y", 1, True)]
        y = first[1]
        assert isinstance(y, RequestOutput) and y.prompt is None and y.prompt_token_ids == PROMPTS[1]
        assert y.outputs[0].finish_reason == "length" and y.outputs[0].index == 0
        m = y.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time and m.ttft >= 0
        rest = []
        while engine.has_unfinished_requests():
            rest += engine.step()
        # Unfinished outputs show the tokens so far; the finished one is returned once.
        assert [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in rest] == [("x", 2, False), ("x", 3, True)]
        assert rest[-1].outputs[0].token_ids == want
        assert engine.step() == []
        assert_pool_whole(engine)


def test_abort_running_and_waiting(llama):
    want = stock_greedy(llama, PROMPTS[1], 6)[0]
    config = EngineConfig(block_size=4, max_num_seqs=2)
    with LLMEngine(llama, engine_config=config) as engine:
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(str(i), prompt, greedy(6) if i == 1 else SamplingParams(max_tokens=6, ignore_eos=True))
        engine.step()
        engine.step()
        bm = engine.cache.block_manager
        (seq0,) = [seq for seq in engine.scheduler.running if seq.request_id == "0"]
        held_by_0 = len(bm.block_tables[seq0.seq_id])
        assert held_by_0 > 0 and [seq.request_id for seq in engine.scheduler.waiting] == ["2"]
        used = bm.num_used_blocks
        engine.abort_request("0")  # running: its blocks come back at once
        assert bm.num_used_blocks == used - held_by_0
        engine.abort_request("2")  # still waiting (max_num_seqs=2)
        engine.abort_request("no-such-request")  # ignored
        results = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                results[out.request_id] = out
            check_block_invariants(engine)
        assert list(results) == ["1"]
        assert results["1"].outputs[0].token_ids == want
        assert_pool_whole(engine)


def test_close_aborts_and_restores_attention(llama):
    before = llama.config._attn_implementation
    engine = LLMEngine(llama)
    assert llama.config._attn_implementation == "paged_transformers"
    engine.add_request("a", PROMPTS[0], greedy(5))
    engine.step()
    engine.close()
    assert llama.config._attn_implementation == before
    assert not engine.has_unfinished_requests()
    assert_pool_whole(engine)
    # the K/V tensors are dropped (on CUDA their memory goes back to the device); the counters stay readable
    assert engine.cache.key_cache == [] and engine.cache.value_cache == [] and engine.runner.cache is None
    assert engine.stats().num_used_blocks == 0
    # The model still works as a plain transformers model afterwards.
    assert stock_greedy(llama, PROMPTS[0], 3)[0] == paged_generate(llama, [PROMPTS[0]], greedy(3), use_tqdm=False)[0].outputs[0].token_ids


def test_paged_generate_keeps_input_order_and_per_prompt_params(llama, engine_spy):
    # The first prompts get the most tokens, so they finish last.
    params = [greedy(12 - 2 * i) for i in range(len(PROMPTS))]
    outs = paged_generate(llama, PROMPTS, params, use_tqdm=False)
    assert [o.request_id for o in outs] == [str(i) for i in range(len(PROMPTS))]
    for prompt, p, out in zip(PROMPTS, params, outs):
        assert out.finished and out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == stock_greedy(llama, prompt, p.max_tokens)[0]
    (engine,) = engine_spy
    assert engine.peak_num_used_blocks <= engine.cache.num_blocks
    assert_pool_whole(engine)


def test_default_params_follow_the_generation_config(llama):
    gc = GenerationConfig(do_sample=False, max_new_tokens=7, eos_token_id=llama.generation_config.eos_token_id)
    outs = paged_generate(llama, PROMPTS[:3], generation_config=gc, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:3], outs):
        assert out.outputs[0].token_ids == stock_greedy(llama, prompt, 7)[0]


def test_chunked_prefill_off_still_matches(llama, engine_spy):
    config = EngineConfig(max_num_batched_tokens=64, enable_chunked_prefill=False)
    outs = paged_generate(llama, PROMPTS, greedy(5), engine_config=config, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [stock_greedy(llama, p, 5)[0] for p in PROMPTS]
    assert not engine_spy[0].chunked
    with pytest.raises(ValueError, match=r"65 tokens.*max_num_batched_tokens=64.*chunked prefill is off"):
        paged_generate(llama, [list(range(3, 68))], greedy(5), engine_config=config, use_tqdm=False)


def test_max_num_seqs_bounds_each_step(llama):
    config = EngineConfig(max_num_seqs=2, block_size=4)
    with LLMEngine(llama, engine_config=config) as engine:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, greedy(4))
        widths = []
        while engine.has_unfinished_requests():
            engine.step()
            widths.append(len(engine.scheduler.running))
        assert max(widths) == 2


def test_progress_bar(llama, capsys):
    paged_generate(llama, PROMPTS, greedy(2), use_tqdm=True)
    assert "paged_generate" in capsys.readouterr().err
    paged_generate(llama, PROMPTS, greedy(2), use_tqdm=False)
    assert "paged_generate" not in capsys.readouterr().err


def test_bf16_model_runs():
    """A bf16 model: the cache takes the model's dtype; greedy equals stock bf16 generate up to near ties."""
    model = make_tiny_model("qwen2").to(torch.bfloat16)
    with LLMEngine(model) as engine:
        assert engine.cache.key_cache[0].dtype == torch.bfloat16
    outs = paged_generate(model, PROMPTS, greedy(4), use_tqdm=False)
    firsts = [o.outputs[0].token_ids[0] for o in outs]
    want = [stock_greedy(model, p, 1) for p in PROMPTS]
    # bf16 rounding differs between paged and SDPA attention: compare where the margin is clear.
    clear = [(f, w[0][0]) for f, w in zip(firsts, want) if w[1][0] > 0.1]
    assert len(clear) >= 3 and all(f == w for f, w in clear)


def test_plain_forward_inside_the_engine_is_refused(llama):
    """Between steps the model's attention is the paged one; a plain forward gets a clear error, not
    the last step's metadata."""
    with LLMEngine(llama) as engine:
        engine.add_request("a", PROMPTS[0], greedy(3))
        engine.step()
        with pytest.raises(RuntimeError, match=r"only works inside the paged engine"):
            llama(torch.tensor([PROMPTS[0]]))
        while engine.has_unfinished_requests():
            engine.step()


def test_failed_engine_start_leaves_the_model_as_it_was(llama, monkeypatch):
    """An engine that cannot start (here: Triton on CPU without the interpreter) must not leave the
    model switched to the paged attention."""
    before = llama.config._attn_implementation
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("the Triton backend starts on CUDA")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        LLMEngine(llama, engine_config=EngineConfig(attention_backend="triton"))
    assert llama.config._attn_implementation == before
    assert stock_greedy(llama, PROMPTS[0], 2)[0]  # plain generate still works


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stopping_criteria_stop_the_request_like_a_stop_token(llama, async_scheduling):
    """A transformers ``StoppingCriteria`` that fires at the 3rd output token ends the request there with
    finish_reason "stop" (the token kept, as generate() keeps it), as a finished request: its finish time is
    recorded and the pool is whole; the other request runs on unchanged (stock greedy)."""
    from paged_transformers.core.engine import run_engine

    prompts = random_prompts(2, 5, 9, seed=41)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    calls = []

    def third_token(input_ids, scores):
        calls.append(input_ids.shape[1] - len(prompts[0]))
        return input_ids.shape[1] - len(prompts[0]) >= 3

    config = EngineConfig(max_model_len=256, async_scheduling=async_scheduling)
    with LLMEngine(llama, engine_config=config) as engine:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params, stopping_criteria=[third_token] if i == 0 else None)
        done = {out.request_id: out for outs in run_engine(engine) for out in outs if out.finished}
        assert_pool_whole(engine)
    stopped, other = done["0"].outputs[0], done["1"].outputs[0]
    assert calls == [1, 2, 3]
    assert stopped.token_ids == stock_greedy(llama, prompts[0], 3)[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    assert done["0"].metrics.finished_time is not None
    assert other.token_ids == stock_greedy(llama, prompts[1], 8)[0] and other.finish_reason == "length"


def test_stopping_criteria_need_n_1(llama):
    """Refused at ``add_request``, before anything is queued."""
    with LLMEngine(llama, engine_config=EngineConfig(max_model_len=256)) as engine:
        with pytest.raises(ValueError, match="n == 1, got n=2"):
            engine.add_request("a", [1, 2, 3], SamplingParams(n=2, max_tokens=2), stopping_criteria=[lambda ids, s: False])
        assert not engine.requests and not engine.scheduler.has_unfinished()
