"""One warm engine per model (``paged_transformers.integration.warm``), kept between calls while the model is its user's.

Reference: stock transformers (``model.generate()`` and plain forwards, fp32 CPU) on a model with the same weights
that never saw an engine. Covered: a train-and-generate loop with prefix caching on; in-place and replaced weights;
plain forwards between calls; sleep / wake_up / release; repeated patched calls and the max_model_len policy;
copies of the model; a compiled, fused engine between calls; bad input; threads; unpatch; process exit.
"""

import copy
import logging
import pickle
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaForCausalLM

import paged_transformers
import paged_transformers.integration.warm as warm_module
from conftest import assert_pool_whole, make_tiny_model, random_prompts, stock_greedy
from paged_transformers import EngineConfig, LLMEngine, SamplingParams, paged_generate, release
from paged_transformers.core.attention import ATTENTION_NAME
from paged_transformers.core.execution_plan import LayerPath
from paged_transformers.integration.warm import attached_engine, current_engine
from paged_transformers.core.weights import WeightsChange, WeightsSnapshot
from test_patch import left_pad

PROMPTS = random_prompts(4, 18, 40, seed=11)  # 1-2 full blocks each: the prefix cache holds them after a call


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def generate(model, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
    """``model.generate()`` greedy on a left-padded batch (patched or not, as the caller is)."""
    ids, mask = left_pad(prompts)
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)


def train_step(model, batch: torch.Tensor, optimizer) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One language-modelling step; returns the loss and the gradients (before the optimizer step)."""
    model.train()
    optimizer.zero_grad()
    loss = model(batch, labels=batch).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    model.eval()
    return loss.detach(), grads


def model_is_stock(model) -> bool:
    """Detached: the model's own attention implementation, no hooks, no instance forwards, its own projections."""
    from paged_transformers.compilation.fusion import FusedLinearSlice

    return (model.config._attn_implementation != ATTENTION_NAME and not model._forward_hooks
            and not model._forward_pre_hooks and not any("forward" in vars(m) for m in model.modules())
            and not any(isinstance(m, FusedLinearSlice) for m in model.modules()))


@pytest.fixture
def built(monkeypatch):
    """The engines the warm entry points construct during the test."""
    engines = []

    class Counting(LLMEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(warm_module, "LLMEngine", Counting)
    return engines


def test_training_loop_generates_with_the_updated_weights():
    """Patched generate, an optimizer step, patched generate again with the same prompt (prefix caching on): the
    second call's greedy tokens are stock's on the updated model, and the training step's loss and gradients are
    an unpatched run's."""
    model, reference = make_tiny_model("llama", seed=21), make_tiny_model("llama", seed=21)
    prompt = PROMPTS[3]  # 40 tokens: two full blocks cached by the first call
    batch = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))

    stock_before = generate(reference, [prompt], 8)
    ref_loss, ref_grads = train_step(reference, batch, torch.optim.AdamW(reference.parameters(), lr=0.05))
    stock_after = generate(reference, [prompt], 8)
    assert not torch.equal(stock_after, stock_before), "the step must change the greedy tokens for this test"

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    with paged_transformers.patch():
        first = generate(model, [prompt], 8)
        engine = current_engine(model)
        assert torch.equal(generate(model, [prompt], 8), first)
        hits = engine.stats().num_cached_tokens
        assert hits == 32  # the repeated call read the prompt's two blocks from the prefix cache
        loss, grads = train_step(model, batch, optimizer)
        after = generate(model, [prompt], 8)
        assert current_engine(model) is engine
        assert engine.stats().num_cached_tokens == hits  # the weights changed: the cache was dropped, no stale hit
    assert torch.equal(first, stock_before)
    assert torch.equal(loss, ref_loss) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    assert torch.equal(after, stock_after)


def test_load_state_dict_and_a_replaced_parameter(caplog):
    """``load_state_dict`` writes in place: the same engine, no stale prefix-cache hit. A replaced parameter: the
    engine is rebuilt (logged at info), and computes with the new one."""
    model, other = make_tiny_model("llama", seed=22), make_tiny_model("llama", seed=23)
    paged_generate(model, PROMPTS, greedy(6), use_tqdm=False)
    engine = current_engine(model)
    model.load_state_dict(other.state_dict())
    assert tokens(paged_generate(model, PROMPTS, greedy(6), use_tqdm=False)) == [stock_greedy(other, p, 6)[0] for p in PROMPTS]
    assert current_engine(model) is engine

    head = make_tiny_model("llama", seed=24).lm_head.weight.detach().clone()
    model.lm_head.weight = torch.nn.Parameter(head.clone())
    other.lm_head.weight = torch.nn.Parameter(head.clone())
    with caplog.at_level(logging.INFO, logger="paged_transformers"):
        got = tokens(paged_generate(model, PROMPTS, greedy(6), use_tqdm=False))
    assert got == [stock_greedy(other, p, 6)[0] for p in PROMPTS]
    assert engine.closed and current_engine(model) not in (None, engine)
    assert any("rebuilding" in r.message and "lm_head.weight" in r.message for r in caplog.records)


def test_weights_snapshot_tells_updates_from_replacements():
    model = make_tiny_model("llama", seed=25)
    norm = model.model.norm
    snapshot = WeightsSnapshot.take(model)
    assert snapshot.compare(model) == (WeightsChange.NONE, "")
    with torch.no_grad():
        norm.weight.add_(1.0)
    assert snapshot.compare(model) == (WeightsChange.UPDATED, "model.norm.weight: written in place")
    snapshot = WeightsSnapshot.take(model)
    norm.weight.data = norm.weight.data.clone()
    change, detail = snapshot.compare(model)
    assert change is WeightsChange.REPLACED and detail.startswith("model.norm.weight: storage address")
    snapshot = WeightsSnapshot.take(model)
    norm.weight.data.mul_(2.0)  # through .data: no version bump, unseen here (the checksums see it: WeightsFingerprint)
    assert snapshot.compare(model)[0] is WeightsChange.NONE
    model.to(torch.float64)
    assert snapshot.compare(model)[0] is WeightsChange.REPLACED


def test_plain_forward_between_calls_equals_stock_and_is_causal():
    model, reference = make_tiny_model("qwen2", seed=26), make_tiny_model("qwen2", seed=26)
    paged_generate(model, PROMPTS, greedy(4), use_tqdm=False)
    assert current_engine(model) is not None and model_is_stock(model)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    logits = model(ids).logits
    assert torch.equal(logits, reference(ids).logits)
    changed = ids.clone()
    changed[:, -1] = 3 + (changed[:, -1] - 2) % 125  # another token at the last position only
    changed_logits = model(changed).logits
    assert torch.equal(changed_logits[:, :-1], logits[:, :-1]) and not torch.equal(changed_logits[:, -1], logits[:, -1])
    # during a call the model runs the paged attention: a forward without the engine's metadata raises instead
    # of attending without the cache's causal structure
    with attached_engine(model):
        with pytest.raises(RuntimeError, match="only works inside the paged engine"):
            model(ids)
    assert torch.equal(model(ids).logits, logits)


def test_sleep_wake_up_and_release():
    model = make_tiny_model("llama", seed=27)
    want = [stock_greedy(model, p, 6)[0] for p in PROMPTS]
    assert tokens(paged_generate(model, PROMPTS, greedy(6), use_tqdm=False)) == want
    engine = current_engine(model)
    num_blocks = engine.stats().num_blocks
    engine.sleep()
    stats = engine.stats()
    assert stats.num_blocks == 0 and stats.num_cached_blocks == 0 and engine.cache.key_cache == []
    engine.attach()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.add_request("a", PROMPTS[0], greedy(2))
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    engine.detach()
    engine.wake_up()
    assert engine.stats().num_blocks == num_blocks
    assert tokens(paged_generate(model, PROMPTS, greedy(6), use_tqdm=False)) == want
    engine.sleep()  # a call wakes a sleeping warm engine up
    assert tokens(paged_generate(model, PROMPTS, greedy(6), use_tqdm=False)) == want
    assert current_engine(model) is engine
    with pytest.raises(ValueError, match="sleep level must be 1"):
        engine.sleep(level=2)
    with attached_engine(model) as attached:
        attached.add_request("a", PROMPTS[0], greedy(3))
        with pytest.raises(RuntimeError, match="1 unfinished requests"):
            attached.sleep()

    release(model)
    assert current_engine(model) is None and engine.closed and model_is_stock(model)
    assert engine.stats().num_blocks == 0 and engine.cache.key_cache == [] and engine.runner.graphs is None
    with pytest.raises(RuntimeError, match="closed"):
        engine.wake_up()
    release(model)  # no engine: a no-op


def test_repeated_patched_calls_reuse_one_engine_and_refuse_a_longer_call(built):
    """``patch(engine_config=EngineConfig(max_model_len=64))``: calls of 3, 5 and 2 rows equal stock on one engine,
    built once; a call needing 100 tokens is refused (ValueError naming max_model_len) with nothing left held."""
    model = make_tiny_model("llama", seed=28)
    batches = [random_prompts(n, 3, 30, seed=n) for n in (3, 5, 2)]
    longer = random_prompts(2, 50, 60, seed=9)
    stock = [generate(model, b, 10) for b in batches]
    with paged_transformers.patch(engine_config=EngineConfig(max_model_len=64)):
        got = []
        for batch in batches:
            got.append(generate(model, batch, 10))
            assert current_engine(model) is built[0]
        with pytest.raises(ValueError, match=r"needs sequences of 100 tokens, over the engine config's max_model_len=64"):
            generate(model, longer, 40)
        engine = current_engine(model)
        assert_pool_whole(engine)
        assert model_is_stock(model) and not engine.requests
        assert torch.equal(generate(model, batches[0], 10), stock[0])
    assert all(torch.equal(g, s) for g, s in zip(got, stock))
    assert len(built) == 1 and engine.closed  # built by the patch: unpatch() released it


def test_a_call_longer_than_the_warm_engine_rebuilds_it(built):
    """The patch without a config runs on the model's warm engine as it is (here one ``paged_generate`` built with
    max_model_len=64); a call needing 100 tokens rebuilds it with the model's maximum (512)."""
    model = make_tiny_model("llama", seed=28)
    batches = [random_prompts(n, 3, 30, seed=n) for n in (3, 5, 2)]
    longer = random_prompts(2, 50, 60, seed=9)
    stock = [generate(model, b, 10) for b in batches] + [generate(model, longer, 40)]
    paged_generate(model, [[5, 6, 7]], greedy(2), engine_config=EngineConfig(max_model_len=64), use_tqdm=False)
    (short,) = built
    with paged_transformers.patch():
        got = []
        for batch in batches:
            got.append(generate(model, batch, 10))
            assert current_engine(model) is short
        got.append(generate(model, longer, 40))
        grown = current_engine(model)
    assert all(torch.equal(g, s) for g, s in zip(got, stock))
    assert built == [short, grown] and short.closed and grown.max_model_len == 512


def test_copies_of_a_model_carry_no_engine():
    model = make_tiny_model("llama", seed=29)
    want = tokens(paged_generate(model, PROMPTS, greedy(5), use_tqdm=False))
    engine = current_engine(model)
    twin = copy.deepcopy(model)  # e.g. an RL reference model
    assert current_engine(twin) is None and model_is_stock(twin)
    assert tokens(paged_generate(twin, PROMPTS, greedy(5), use_tqdm=False)) == want
    assert current_engine(twin) not in (None, engine) and current_engine(model) is engine
    restored = pickle.loads(pickle.dumps(model))
    assert current_engine(restored) is None
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(restored(ids).logits, model(ids).logits)
    release(twin)


@pytest.mark.slow
def test_compiled_fused_engine_between_calls(tmp_path):
    """``compile_layers`` and ``fuse_projections`` on CPU (one compile). Between calls the model has its own modules,
    whose q/k/v and gate/up weights stay views of the fused weights: a training step computes stock's loss and
    gradients, ``save_pretrained`` and ``torch.save`` reload equal, and the next call computes with the updated
    weights through the same compiled code (no new Dynamo graph), also after sleep / wake_up."""
    model, reference = make_tiny_model("llama", seed=30), make_tiny_model("llama", seed=30)
    prompts = random_prompts(3, 3, 40, seed=10)
    config = EngineConfig(compile_layers=True, fuse_projections=True, attention_backend="torch", max_model_len=128,
                          max_num_seqs=4)
    torch._dynamo.reset()
    before = tokens(paged_generate(model, prompts, greedy(6), engine_config=config, use_tqdm=False))
    assert before == [stock_greedy(reference, p, 6)[0] for p in prompts]
    engine = current_engine(model)
    assert engine.execution_plan.layers is LayerPath.COMPILED and engine.runner.compilation.fusion.num_fused == 2 * model.config.num_hidden_layers
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2 and model_is_stock(model)
    attn, fused = model.model.layers[0].self_attn, engine.runner.compilation.fusion.groups[0][2]
    assert all(p.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
               for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))

    batch = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    loss, grads = train_step(model, batch, torch.optim.AdamW(model.parameters(), lr=0.05))
    ref_loss, ref_grads = train_step(reference, batch, torch.optim.AdamW(reference.parameters(), lr=0.05))
    assert torch.equal(loss, ref_loss) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))

    model.save_pretrained(tmp_path / "hf")
    torch.save(model.state_dict(), tmp_path / "state.pt")
    expected = reference.state_dict()
    for state in (LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict(), torch.load(tmp_path / "state.pt")):
        assert state.keys() == expected.keys() and all(torch.equal(state[k], v) for k, v in expected.items())

    want = [stock_greedy(reference, p, 6)[0] for p in prompts]
    assert want != before, "the step must change the greedy tokens for this test"
    assert tokens(paged_generate(model, prompts, greedy(6), engine_config=config, use_tqdm=False)) == want
    engine.sleep()
    engine.wake_up()
    assert tokens(paged_generate(model, prompts, greedy(6), use_tqdm=False)) == want
    assert current_engine(model) is engine and counters["stats"]["unique_graphs"] == graphs
    release(model)
    assert model_is_stock(model) and attn.q_proj.weight.is_contiguous()
    assert attn.q_proj.weight.untyped_storage().data_ptr() != fused.weight.untyped_storage().data_ptr()


def test_bad_input_leaves_nothing_allocated():
    model = make_tiny_model("llama", seed=31)
    paged_generate(model, PROMPTS, greedy(3), use_tqdm=False)
    engine = current_engine(model)
    with pytest.raises(ValueError, match="prompt 1"):
        paged_generate(model, [[5, 6], [500]], greedy(3), use_tqdm=False)
    bad = EngineConfig()
    bad.block_size = 0
    with pytest.raises(ValueError, match="block_size"):
        paged_generate(model, PROMPTS, greedy(3), engine_config=bad, use_tqdm=False)
    with pytest.raises(KeyboardInterrupt):
        with attached_engine(model) as attached:
            attached.add_request("a", PROMPTS[0], greedy(5))
            attached.step()
            raise KeyboardInterrupt
    # a bad config is refused before the warm engine is touched; the interrupted call's request is aborted
    assert current_engine(model) is engine and not engine.requests and not engine.attached
    assert_pool_whole(engine)
    assert model_is_stock(model)


def test_two_threads_calling_generate_take_turns(monkeypatch):
    """Two threads call the patched ``generate()`` on one model: the calls run one after the other on the one
    engine (attach, detach, attach, ...), each equal to stock."""
    model = make_tiny_model("llama", seed=32)
    batches = [random_prompts(n, 3, 30, seed=20 + n) for n in (1, 2, 3, 4)]
    stock = [generate(model, b, 6) for b in batches]
    paged_generate(model, [[5, 6, 7]], greedy(1), use_tqdm=False)  # the warm engine, before the threads
    events = []
    for name in ("attach", "detach"):
        original = getattr(LLMEngine, name)
        monkeypatch.setattr(LLMEngine, name, lambda self, _o=original, _n=name: (events.append(_n), _o(self))[1])
    results = {}

    def worker(indices):
        for i in indices:
            results[i] = generate(model, batches[i], 6)

    with paged_transformers.patch():
        threads = [threading.Thread(target=worker, args=(indices,)) for indices in ((0, 2), (1, 3))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert all(torch.equal(results[i], stock[i]) for i in range(len(batches)))
    assert events == ["attach", "detach"] * len(batches)


def test_a_call_from_inside_a_call_raises():
    model = make_tiny_model("llama", seed=33)

    def nested(input_ids, scores):
        paged_generate(model, [[5, 6, 7]], greedy(1), use_tqdm=False)
        return scores

    (out,) = paged_generate(model, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2, logits_processors=[nested]),
                            use_tqdm=False)
    error = out.outputs[0].error
    assert isinstance(error, RuntimeError) and "from inside a call" in str(error)
    assert model_is_stock(model)


def test_unpatch_releases_the_drop_in_engines():
    ours, theirs = make_tiny_model("llama", seed=34), make_tiny_model("qwen2", seed=34)
    paged_generate(theirs, PROMPTS, greedy(2), use_tqdm=False)
    kept = current_engine(theirs)
    with paged_transformers.patch():
        generate(ours, PROMPTS, 2)
        generate(theirs, PROMPTS, 2)
        dropped = current_engine(ours)
        assert current_engine(theirs) is kept
    assert dropped.closed and current_engine(ours) is None
    assert not kept.closed  # built by paged_generate, not by the patch


def test_patch_config_bounds_the_pool():
    """The KV pool of the drop-in engine stays within the budget ``patch(engine_config=...)`` gives it."""
    model = make_tiny_model("llama", seed=35)
    budget = 40 * 8192  # 40 blocks of 16 tokens (2 layers x K,V x 2 heads x 16 dims x fp32 = 8 KiB a block)
    stock = generate(model, PROMPTS, 8)
    with paged_transformers.patch(engine_config=EngineConfig(kv_cache_memory_bytes=budget, max_model_len=128)):
        assert torch.equal(generate(model, PROMPTS, 8), stock)
        cache = current_engine(model).cache
        assert sum(t.numel() * t.element_size() for t in cache.key_cache + cache.value_cache) <= budget


def test_process_exits_with_a_live_engine(tmp_path):
    """A process that patches, generates and exits without unpatch or release exits at once (no hang at exit)."""
    code = textwrap.dedent("""
        import torch, transformers, paged_transformers
        from paged_transformers.integration.warm import current_engine
        paged_transformers.patch()
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1)
        model = transformers.LlamaForCausalLM(config).eval()
        ids = torch.tensor([[1, 2, 3]])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
        assert current_engine(model) is not None
        print("generated", flush=True)
    """)
    # the timeout is for a hang: importing torch and transformers takes most of the time on a loaded machine;
    # cwd outside the checkout, so that the installed package is imported (as a user's script would)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "generated\n", done.stderr
