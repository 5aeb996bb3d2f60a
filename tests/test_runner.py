"""ModelRunner: the packed step metadata against a naive per-token construction, decode padding, lazy
decode-graph capture (on CPU with a stand-in for the CUDA graph), and (CUDA only) CUDA-graph decode against
eager decode."""

import pytest
import torch

from paged_transformers import LLM, EngineConfig, LLMEngine, SamplingParams
from paged_transformers.compilation import Compilation, DecodeGraphs, graph_batch_sizes
from paged_transformers.core.attention import ATTENTION_NAME
from paged_transformers.compat import attn_implementation
from paged_transformers.core.runner import ModelRunner

from conftest import engine_greedy, make_tiny_model, random_prompts, stock_greedy


def naive_metadata(engine, plan):
    """The step's tensors built token by token from the plan's positions and the block manager's tables
    (independent of the runner's persistent batch)."""
    bm = engine.cache.block_manager
    input_ids, positions, slots, seq_lens, starts, logits_indices = [], [], [], [], [0], []
    for entry in plan.seqs:
        seq = engine.scheduler.seqs[entry.seq_id]
        for p in range(entry.num_computed_tokens, entry.num_computed_tokens + entry.num_scheduled_tokens):
            input_ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(bm.slot(seq.seq_id, p))
        seq_lens.append(entry.num_computed_tokens + entry.num_scheduled_tokens)
        starts.append(starts[-1] + entry.num_scheduled_tokens)
        if seq_lens[-1] == seq.num_tokens:
            logits_indices.append(starts[-1] - 1)
    return input_ids, positions, slots, seq_lens, starts, logits_indices


def check_prepare(engine, plan):
    runner = engine.runner
    T, num_sampled, max_q, max_s = runner.prepare(plan)
    ids, pos, slots, lens, starts, li = naive_metadata(engine, plan)
    S = len(plan.seqs)
    assert T == len(ids) and num_sampled == len(li)
    assert runner.input_ids[:T].tolist() == ids
    assert runner.positions[:T].tolist() == pos
    assert runner.slot_mapping[:T].tolist() == slots
    assert runner.seq_lens[:S].tolist() == lens
    assert runner.query_start_loc[: S + 1].tolist() == starts
    assert runner.logits_indices[:num_sampled].tolist() == li
    assert max_q == max(plan.num_scheduled_tokens) and max_s == max(lens)
    tables = engine.cache.block_manager.block_tables
    for i, entry in enumerate(plan.seqs):
        table = tables[entry.seq_id]
        assert runner.block_tables[i, : len(table)].tolist() == table


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and graph_batch_sizes(256)[-1] == 256
    assert len(graph_batch_sizes(256)) == 20 and len(graph_batch_sizes(512)) == 36
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        graph_batch_sizes(0)


def test_prepare_matches_naive_metadata_mixed_chunked_steps():
    """Chunked prefill + decode steps with a small token budget: every step's buffers equal the naive ones."""
    model = make_tiny_model("llama")
    config = EngineConfig(block_size=4, max_num_batched_tokens=24, max_num_seqs=4, num_gpu_blocks=64,
                          max_model_len=128, attention_backend="torch", async_scheduling=False)
    with LLMEngine(model, engine_config=config) as engine:
        for i, prompt in enumerate(random_prompts(5, 3, 30, seed=1)):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True))
        kinds = set()
        while engine.has_unfinished_requests():
            plan = engine.scheduler.schedule()
            if plan.seqs:
                check_prepare(engine, plan)
                kinds.add("decode" if all(n == 1 for n in plan.num_scheduled_tokens) else "mixed")
                # hand the plan back: run it through the engine's own path
                engine._in_flight = engine._launch(plan)
                engine.step()
        assert kinds == {"decode", "mixed"}


def test_prepare_pads_decode_step():
    model = make_tiny_model("llama")
    config = EngineConfig(block_size=4, max_num_seqs=8, num_gpu_blocks=64, max_model_len=128, attention_backend="torch",
                          async_scheduling=False)
    with LLMEngine(model, engine_config=config) as engine:
        for i, prompt in enumerate(random_prompts(3, 5, 9, seed=2)):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        engine.step()  # prefill
        plan = engine.scheduler.schedule()
        assert all(n == 1 for n in plan.num_scheduled_tokens) and len(plan.seqs) == 3
        rows, num_sampled, max_q, _ = engine.runner.prepare(plan, pad_to=8)
        r = engine.runner
        assert (rows, num_sampled, max_q) == (8, 8, 1)
        assert r.slot_mapping[3:8].tolist() == [-1] * 5
        assert r.seq_lens[3:8].tolist() == [1] * 5
        assert r.query_start_loc[:9].tolist() == list(range(9))
        assert r.logits_indices[:8].tolist() == list(range(8))
        _, _, slots, lens, _, _ = naive_metadata(engine, plan)
        assert r.slot_mapping[:3].tolist() == slots and r.seq_lens[:3].tolist() == lens


def test_engine_greedy_matches_stock_generate():
    """The rewritten runner end to end (torch backend): greedy tokens equal stock generate, prompt alone."""
    model = make_tiny_model("qwen2")
    prompts = random_prompts(4, 2, 40, seed=3)
    config = EngineConfig(block_size=8, max_num_batched_tokens=32, num_gpu_blocks=64, attention_backend="torch")
    with LLMEngine(model, engine_config=config) as engine:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=6))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    for i, prompt in enumerate(prompts):
        ref, _ = stock_greedy(model, prompt, 6)
        assert done[str(i)] == ref, i


class _StandInGraph:
    """A CUDA graph's stand-in on CPU: "captured" from a forward, its ``replay`` runs that forward again on the
    runner's current buffers into the same static output, as a real graph replay does."""

    def __init__(self, forward):
        self.forward = forward
        self.logits = forward()

    def replay(self):
        self.logits.copy_(self.forward())


def _graphed_run(monkeypatch, fail_at: int | None = None, capture_first: bool = False, detached_capture: bool = False,
                 max_cudagraph_capture_size: int | None = None):
    """Six prompts of decreasing lengths (decode batches 6 down to 1) on an engine whose runner replays decode steps
    from stand-in graphs (a ``Compilation`` with decode graphs up to the engine's ``max_cudagraph_capture_size``
    given to the runner on CPU). ``fail_at``: the capture that raises (1-based); ``capture_first``:
    ``engine.capture_cudagraphs()`` before the requests (its count is appended to ``captures``), on the engine
    detached first with ``detached_capture`` (and attached again after it).

    Returns:
        ``(tokens, runner, captures)``: the new tokens per prompt, the runner (after close) and the bucket of
        every capture attempt, in order.
    """
    captures = []

    def record(self, forward):
        if len(captures) == fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph = _StandInGraph(forward)
        return graph, graph.logits

    dummy_decode = ModelRunner._dummy_decode
    monkeypatch.setattr(ModelRunner, "_dummy_decode", lambda self, size: captures.append(size) or dummy_decode(self, size))
    monkeypatch.setattr(DecodeGraphs, "record", record)
    model = make_tiny_model("llama", seed=8)
    prompts = random_prompts(6, 3, 30, seed=8)
    lengths = [4 + 3 * i for i in range(len(prompts))]
    config = EngineConfig(max_num_seqs=8, attention_backend="torch", max_model_len=128,
                          max_cudagraph_capture_size=max_cudagraph_capture_size)
    with LLMEngine(model, engine_config=config) as engine:
        runner = engine.runner
        assert not engine.execution_plan.cuda_graphs and runner.graphs is None  # CPU: off
        runner.compilation = Compilation(model, runner.device, engine.config.max_cudagraph_capture_size, cuda_graphs=True)
        runner.record_steps = True
        if detached_capture:
            engine.detach()
        if capture_first:
            captures.append(engine.capture_cudagraphs())
        if detached_capture:
            assert not engine.attached and attn_implementation(model.config) != ATTENTION_NAME  # detached again
            engine.attach()
        got = engine_greedy(engine, prompts, lengths)
        runner.captured = sorted(runner.graphs.graphs)  # read before close(), which frees the graphs
    assert got == [stock_greedy(model, p, n)[0] for p, n in zip(prompts, lengths)]
    return got, runner, captures


def test_decode_graphs_are_captured_at_their_first_step(monkeypatch):
    """Each bucket's graph is captured once, the first time a decode step of that bucket runs (batches 6 and 5 run
    bucket 8; 4 and 3 bucket 4; then 2 and 1), and later decode steps of the bucket replay it; tokens equal stock."""
    _, runner, captures = _graphed_run(monkeypatch)
    assert captures == [8, 4, 2, 1]
    assert runner.captured == [1, 2, 4, 8] and runner.graphs.capture_error is None
    graphed = [s.num_seqs for s in runner.steps if s.kind == "graph"]
    assert len(graphed) > len(captures) and set(graphed) == {1, 2, 3, 4, 5, 6}
    assert not runner.graphs.graphs  # close() dropped them


def test_capture_cudagraphs_captures_every_bucket_before_the_first_step(monkeypatch):
    """What a server does at start-up: every bucket captured, ascending, and none at the decode steps after (each
    replays); tokens equal stock."""
    _, runner, captures = _graphed_run(monkeypatch, capture_first=True)
    assert captures == [1, 2, 4, 8, 4]  # the four buckets, then capture_cudagraphs' count; nothing during the run
    assert runner.captured == [1, 2, 4, 8]
    assert {s.num_seqs for s in runner.steps if s.kind == "graph"} == {1, 2, 3, 4, 5, 6}


def test_capture_cudagraphs_on_a_detached_engine_attaches_for_the_capture(monkeypatch):
    """A warm engine between calls is detached (``LLM(...).llm_engine``): the capture attaches it, captures every
    bucket, and detaches it again; the run after replays them without capturing; tokens equal stock."""
    _, runner, captures = _graphed_run(monkeypatch, capture_first=True, detached_capture=True)
    assert captures == [1, 2, 4, 8, 4]
    assert {s.num_seqs for s in runner.steps if s.kind == "graph"} == {1, 2, 3, 4, 5, 6}


def test_llm_engine_capture_cudagraphs_on_cpu_captures_nothing_and_leaves_it_detached():
    """README's ``llm.llm_engine.capture_cudagraphs()`` on CPU: no graphs (0), no error, the engine detached after."""
    model = make_tiny_model("llama", seed=8)
    with LLM(model, attention_backend="torch", max_model_len=64, kv_cache_memory_bytes=1 << 20) as llm:
        engine = llm.llm_engine
        assert not engine.attached
        assert engine.capture_cudagraphs() == 0
        assert not engine.attached and attn_implementation(model.config) != ATTENTION_NAME
        (out,) = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert out.outputs[0].token_ids == stock_greedy(model, [3, 4, 5], 3)[0]


def test_decode_steps_above_max_cudagraph_capture_size_run_eagerly(monkeypatch):
    """``max_cudagraph_capture_size=4`` with 8 sequences: buckets 1, 2, 4 only; the decode steps of 5 and 6
    sequences run eagerly; tokens equal stock."""
    _, runner, captures = _graphed_run(monkeypatch, max_cudagraph_capture_size=4)
    assert captures == [4, 2, 1] and runner.captured == [1, 2, 4]
    decode = [s for s in runner.steps if s.num_tokens == s.num_seqs]
    assert {s.num_seqs for s in decode if s.kind == "graph"} == {1, 2, 3, 4}
    assert {s.num_seqs for s in decode if s.kind == "eager"} >= {5, 6}


def test_capture_cudagraphs_without_graphs_captures_nothing():
    model = make_tiny_model("llama", seed=8)
    with LLMEngine(model, engine_config=EngineConfig(attention_backend="torch", max_model_len=64)) as engine:
        assert engine.capture_cudagraphs() == 0  # CPU: no graphs
    with pytest.raises(RuntimeError, match="closed"):
        engine.capture_cudagraphs()


def test_a_failed_capture_leaves_the_runner_eager(monkeypatch):
    """The second capture (bucket 4) fails: every graph is dropped, nothing is captured again, and every later
    step runs eagerly; tokens still equal stock."""
    _, runner, captures = _graphed_run(monkeypatch, fail_at=2)
    assert captures == [8, 4]
    assert not runner.graphs.enabled and runner.captured == []
    assert "not permitted" in runner.graphs.capture_error
    first_eager_decode = next(i for i, s in enumerate(runner.steps) if s.kind == "eager" and s.num_seqs == 4)
    assert all(s.kind == "eager" for s in runner.steps[first_eager_decode:])
    assert any(s.kind == "graph" for s in runner.steps[:first_eager_decode])  # bucket 8 replayed before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_decode_equals_eager():
    """fp32 on the GPU with the Triton backend: greedy tokens with graphs on equal graphs off, decode steps
    really replayed graphs, and mixed steps ran eagerly."""
    model = make_tiny_model("llama", max_position_embeddings=512).cuda()
    prompts = random_prompts(12, 3, 60, seed=4)
    lengths = [5 + 3 * i for i in range(len(prompts))]

    def run(enforce_eager):
        config = EngineConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=128, num_gpu_blocks=256,
                              attention_backend="triton", enforce_eager=enforce_eager)
        with LLMEngine(model, engine_config=config) as engine:
            engine.runner.record_steps = True
            for i, (prompt, n) in enumerate(zip(prompts, lengths)):
                engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            done = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
            graphs = engine.runner.graphs
            buckets = sorted(graphs.graphs) if graphs is not None else []  # read before close(), which frees them
            return done, engine.runner, buckets

    eager, eager_runner, eager_buckets = run(True)
    graphed, runner, buckets = run(False)
    assert runner.graphs.capture_error is None, runner.graphs.capture_error
    assert not eager_buckets and buckets
    assert not runner.graphs.graphs  # close() dropped them
    kinds = [s.kind for s in runner.steps]
    assert "graph" in kinds and "eager" in kinds, kinds
    assert all(s.kind == "eager" for s in eager_runner.steps)
    assert graphed == eager
    assert [len(graphed[str(i)]) for i in range(len(prompts))] == lengths
