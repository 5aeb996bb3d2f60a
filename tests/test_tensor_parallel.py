"""Tensor parallelism on CPU (gloo, 2 and 4 processes): greedy tokens equal stock ``generate()`` and the one-process
engine with chunked prefill, preemption, prefix caching and n > 1; logits processors see the same histories; aborts
and bad requests leave every rank's batch and pool whole; bad configurations are refused before a worker starts;
no process outlives its engine.

Each engine is started once per module (``tp_llm``): its worker processes are spawned, which dominates the time.
"""

import json
import logging
import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import TINY_ARCHS, assert_pool_whole, make_tiny_model, random_prompts, stock_greedy
from paged_transformers import LLM, PerRequest, SamplingParams, load_model, paged_generate, release

# 5 prompts of up to 50 tokens in 24 blocks of 8 tokens: preemption; prompts over 32 tokens: chunked prefill
ENGINE = dict(skip_tokenizer_init=True, max_model_len=128, max_num_batched_tokens=32, block_size=8, num_gpu_blocks=24)
GREEDY = SamplingParams(temperature=0, max_tokens=10)
PROMPTS = random_prompts(5, 3, 40, seed=1)
pytestmark = pytest.mark.slow  # the tests spawn worker processes or a torchrun


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(arch, **overrides) -> (model, folder)``: a tiny model and its checkpoint folder, once per module."""
    cache = {}

    def get(arch, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            model = make_tiny_model(arch, **overrides)
            folder = tmp_path_factory.mktemp(arch)
            model.save_pretrained(folder)
            cache[key] = model, str(folder)
        return cache[key]

    return get


class OneLLM:
    """``tp_llm(arch_or_folder, tp, **engine_kwargs)``: an ``LLM`` over a saved tiny model (or a checkpoint folder),
    kept while the following tests ask for the same arguments; ``close()`` before a test starts its own (one
    tensor-parallel engine per process at a time: the tests are ordered so)."""

    def __init__(self, saved):
        self.saved, self.key, self.llm = saved, None, None

    def __call__(self, source, tp, **kwargs):
        key = (source, tp, repr(sorted(kwargs.items())))
        if key != self.key:
            self.close()
            folder = self.saved(source)[1] if source in TINY_ARCHS else source
            self.llm, self.key = LLM(folder, tensor_parallel_size=tp, **{**ENGINE, **kwargs}), key
        return self.llm

    def close(self):
        if self.llm is not None:
            self.llm.close()
        self.key = self.llm = None


@pytest.fixture(scope="module")
def tp_llm(saved):
    one = OneLLM(saved)
    yield one
    one.close()


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_ranks_agree(llm) -> None:
    """Rank 0's pool is whole and every rank's persistent batch holds the same block tables as rank 0's."""
    engine = llm.llm_engine
    assert_pool_whole(engine)
    tables = engine.worker_tables()
    assert all(t == tables[0] for t in tables), tables


def test_preemption_prefix_caching_and_n(tp_llm, saved):
    model = saved("llama")[0]
    llm = tp_llm("llama", 2)
    shared = [PROMPTS[-1][:24] + p for p in PROMPTS[:3]]  # a 3-block common prefix
    want = [stock_greedy(model, p, GREEDY.max_tokens)[0] for p in PROMPTS + shared]
    assert tokens(llm.generate(PROMPTS + shared, GREEDY, use_tqdm=False)) == want
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0, stats
    outs = llm.generate(shared, SamplingParams(temperature=0, max_tokens=10, n=2), use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == [[w, w] for w in want[len(PROMPTS):]]
    assert_ranks_agree(llm)


class Recorder:
    """A per-request processor recording each call's history; bans the last token (so it changes the output)."""

    def __init__(self):
        self.histories = []

    def __call__(self, input_ids, scores):
        self.histories.append(input_ids.tolist())
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), input_ids[:, -1]] = float("-inf")
        return scores


def recorded(generate, prompts):
    instances = []

    def make():
        instances.append(Recorder())
        return instances[-1]

    params = SamplingParams(temperature=0, max_tokens=6, logits_processors=[PerRequest(make)])
    outs = generate(prompts, params)
    return tokens(outs), sorted(h for r in instances for h in r.histories)


def test_logits_processor_sees_tp1_histories(tp_llm, saved):
    model = saved("llama")[0]
    want = recorded(lambda p, sp: paged_generate(model, p, sp, use_tqdm=False), PROMPTS)
    got = recorded(lambda p, sp: tp_llm("llama", 2).generate(p, sp, use_tqdm=False), PROMPTS)
    assert got == want and len(got[1]) == 6 * len(PROMPTS)


def test_abort_and_bad_request_leave_every_rank_whole(tp_llm, saved):
    llm = tp_llm("llama", 2)
    with llm.llm_engine.for_call() as engine:
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, GREEDY)
        engine.step()
        engine.step()
        engine.abort_request("1")
        with pytest.raises(ValueError):
            engine.add_request("bad", [1, 10_000], GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
    with llm.llm_engine.for_call() as engine:  # a call that fails midway: its requests are aborted on exit
        engine.add_request("x", PROMPTS[0], GREEDY)
        engine.step()
    llm.llm_engine.reset_prefix_cache()
    assert_ranks_agree(llm)
    model = saved("llama")[0]
    assert tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == [stock_greedy(model, p, 10)[0] for p in PROMPTS[:2]]


def test_sleep_wake_up_every_rank(tp_llm, saved):
    llm = tp_llm("llama", 2)
    llm.sleep()
    assert llm.llm_engine.stats().num_blocks == 0
    llm.wake_up()
    model = saved("llama")[0]
    assert tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == [stock_greedy(model, p, 10)[0] for p in PROMPTS[:2]]


@pytest.mark.parametrize("arch,tp", [("llama", 2), ("qwen2", 2), ("llama", 4)])
def test_greedy_equals_stock(tp_llm, saved, arch, tp):
    """Chunked prefill (prompts up to 40 tokens, 32-token budget); llama at tp=4 replicates its 2 KV heads."""
    model = saved(arch)[0]
    want = [stock_greedy(model, p, GREEDY.max_tokens)[0] for p in PROMPTS]
    llm = tp_llm(arch, tp)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert tokens(paged_generate(model, PROMPTS, GREEDY, use_tqdm=False)) == want  # tp=1
    assert llm.llm_engine.num_pipelined_steps > 0  # async scheduling: steps whose input ids were broadcast on the device
    assert_ranks_agree(llm)


FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "models"


# tiny-qwen2-awq-4bit-g128: 128-row groups straddle both row splits at tp=2, so o_proj and down_proj stay whole
# and gather their input; the GPTQ act-order o_proj does too, while its down_proj splits by the permuted rows
@pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"fixtures folder {FIXTURES} (../shared/fixtures beside the repo) is missing")
@pytest.mark.parametrize("name", ["tiny-llama-gptq-4bit-g32-actorder-asym", "tiny-llama-awq-4bit-g64-gemm",
                                  "tiny-qwen2-awq-4bit-g128-gemm"])
def test_quantized_greedy_equals_tp1(tp_llm, name):
    model = load_model(FIXTURES / name, dtype=torch.float32, device="cpu")
    want = tokens(paged_generate(model, PROMPTS, GREEDY, use_tqdm=False))
    release(model)
    llm = tp_llm(str(FIXTURES / name), 2, dtype="float32")
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert_ranks_agree(llm)


def test_act_order_down_proj_splits_by_permuted_rows():
    """The GPTQ act-order fixture's down_proj shard holds no permutation and the input features gate/up keep."""
    from paged_transformers.distributed.sharding import _split_rows

    if not FIXTURES.is_dir():
        pytest.skip(f"fixtures folder {FIXTURES} is missing")
    model = load_model(FIXTURES / "tiny-llama-gptq-4bit-g32-actorder-asym", dtype=torch.float32, device="cpu")
    down = model.model.layers[0].mlp.down_proj
    perm, full = down.perm.clone(), down.dequantize()  # [out, in], original input order
    features = _split_rows(down, torch.arange(192, 384), rank=1, tp=2, group=None, free=True)
    assert down.perm is None and torch.equal(features, perm[192:])
    assert torch.equal(down.dequantize(), full[:, features])


@pytest.mark.parametrize("tp,match", [(3, "does not divide .* num_attention_heads=4"), (0, "positive integer"),
                                      (True, "positive integer"), (10_000, "over the")])
def test_bad_tensor_parallel_size(tp_llm, saved, tp, match):
    tp_llm.close()
    with pytest.raises(ValueError, match=match):
        LLM(saved("llama")[1], tensor_parallel_size=tp, **ENGINE)
    assert not multiprocessing.active_children()


def test_unsplittable_architecture_and_loaded_model(tp_llm, saved):
    tp_llm.close()
    with pytest.raises(ValueError, match="Phi3ForCausalLM cannot be split"):
        LLM(saved("phi3")[1], tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match="needs a checkpoint folder"):
        LLM(saved("llama")[0], tensor_parallel_size=2, **ENGINE)
    assert not multiprocessing.active_children()


def test_close_ends_the_workers(tp_llm, saved):
    tp_llm.close()
    llm = LLM(saved("llama")[1], tensor_parallel_size=2, **ENGINE)
    procs = list(llm.llm_engine.worker_processes)
    llm.close()
    assert procs and not any(p.is_alive() for p in procs) and not multiprocessing.active_children()


@pytest.mark.parametrize("how", ["close", "with"])
def test_close_after_a_worker_died_is_quiet(tp_llm, saved, caplog, how):
    """``close()`` (and leaving a ``with LLM(...)`` block) after a worker was killed used to raise gloo's error for the
    lost peer (the cleanup itself ran); now it closes, logging the worker's death once, and ends every worker."""
    tp_llm.close()
    caplog.set_level(logging.WARNING, logger="paged_transformers")
    with LLM(saved("llama")[1], tensor_parallel_size=2, **ENGINE) as llm:
        procs = list(llm.llm_engine.worker_processes)
        procs[0].kill()
        procs[0].join(10)
        if how == "close":
            llm.close()
            llm.close()  # idempotent, and quiet again
    died = [r for r in caplog.records if "exited with code" in r.getMessage()]
    assert len(died) == 1 and procs[0].name in died[0].getMessage(), [r.getMessage() for r in caplog.records]
    assert not any(p.is_alive() for p in procs) and not multiprocessing.active_children()


def test_exit_after_a_worker_died_is_quiet(saved, tmp_path):
    """A script that ends without ``close()`` after a worker died: the exit handler used to print gloo's error for
    the lost peer ("Exception ignored in atexit callback"); now it logs the death and exits cleanly."""
    script = textwrap.dedent("""
        import sys, torch
        from paged_transformers import LLM
        if __name__ == "__main__":
            torch.set_num_threads(1)
            llm = LLM(sys.argv[1], tensor_parallel_size=2, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks=8)
            worker = llm.llm_engine.worker_processes[0]
            worker.kill()
            worker.join(10)
    """)
    run = subprocess.run([sys.executable, "-c", script, saved("llama")[1]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "Traceback" not in run.stderr and "exited with code" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("ending", ["raise RuntimeError('driver failed')", "pass  # interpreter exit, no close()"])
def test_no_worker_outlives_its_driver(saved, ending, tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, torch
        from paged_transformers import LLM
        if __name__ == "__main__":
            torch.set_num_threads(1)
            llm = LLM(sys.argv[1], tensor_parallel_size=2, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks=8)
            print(*[p.pid for p in llm.llm_engine.worker_processes], flush=True)
            {ending}
    """)
    # cwd outside the checkout: `-c` puts the working directory first on sys.path (CI tests the installed wheel)
    run = subprocess.run([sys.executable, "-c", script, saved("llama")[1]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    pids = [int(pid) for pid in run.stdout.split()]
    assert pids, run.stderr[-2000:]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_bench_tensor_parallel_flag(tp_llm, saved, tmp_path):
    from paged_transformers.bench.command import main

    tp_llm.close()
    with pytest.raises(ValueError, match="needs --model as a checkpoint path"):
        main(["--model", "llama-3-8b", "--tensor-parallel-size", "2"])
    out = tmp_path / "report.json"
    assert main(["--model", saved("llama")[1], "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2",
                 "--num-requests", "4", "--input-len-range", "8", "16", "--output-len-range", "4", "8",
                 "--max-model-len", "64", "--no-batch1", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["engine_config"]["tensor_parallel_size"] == 2 and "error" not in report["engines"]["paged"]
    assert not multiprocessing.active_children()


def test_under_torchrun_uses_its_group(tp_llm, saved, tmp_path):
    """Two torchrun processes, each with the gloo group made: rank 0 drives, rank 1 serves inside ``LLM()``."""
    tp_llm.close()
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from paged_transformers import LLM, SamplingParams
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        llm = LLM(sys.argv[1], tensor_parallel_size=2, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks=16)
        outs = llm.generate([[int(t) for t in sys.argv[2:]]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        print("TOKENS", *outs[0].outputs[0].token_ids, flush=True)
        llm.close()
        dist.destroy_process_group()
    """))
    model, folder = saved("llama")
    prompt = PROMPTS[0]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), folder]
    run = subprocess.run(command + [str(t) for t in prompt], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 1, run.stderr[-3000:]
    assert [int(t) for t in lines[0]] == stock_greedy(model, prompt, 6)[0]
    if run.returncode != 0 and "terminate called without an active exception" in run.stderr:
        # NOTE: a known bug, open: under a loaded machine (the full CI suite on 2 cores) rank 0 sometimes aborts at
        # interpreter exit after a clean close() and destroy_process_group(); alone it passed 6 of 6 runs
        pytest.xfail("rank 0 aborted at interpreter exit after a correct run (known teardown race under torchrun)")
    assert run.returncode == 0, run.stderr[-3000:]


def test_server_on_a_split_model(tp_llm, saved, tmp_path):
    """``serve --tensor-parallel-size 2``'s path: the OpenAI server over ``LLM(folder, tensor_parallel_size=2)``
    (the stepping thread drives rank 0's engine): a greedy completion of token ids, streamed and not, equals stock."""
    from serving import skip_without_server_deps

    skip_without_server_deps()
    import httpx
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from paged_transformers.entrypoints.openai.api_server import ServerThread, build_app

    tp_llm.close()
    model, folder = saved("llama")
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0").save_pretrained(tmp_path)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (Path(folder) / name).exists():
            (tmp_path / name).write_bytes((Path(folder) / name).read_bytes())
    prompt = PROMPTS[0]
    want = stock_greedy(model, prompt, 8)[0]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, max_model_len=128, num_gpu_blocks=24, block_size=8)
    try:
        with ServerThread(build_app(llm, ["tp"], log_requests=False)) as server:
            body = {"model": "tp", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0}
            reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            got = [int(t.removeprefix("t")) for t in reply["choices"][0]["logprobs"]["tokens"]]
            assert got == want and reply["usage"]["completion_tokens"] == 8
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert "".join(c["choices"][0]["text"] for c in chunks) == reply["choices"][0]["text"]
    finally:
        llm.close()


def test_a_script_without_a_main_guard_gets_an_error_not_a_hang(tp_llm, saved, tmp_path):
    """Spawned ranks import the main module again: a script that builds the LLM at its top level used to hang rank 0
    in the group's rendezvous (its workers died starting); now LLM raises, naming the fix."""
    tp_llm.close()
    script = tmp_path / "unguarded.py"
    folder = saved("llama")[1]
    script.write_text(f"from paged_transformers import LLM\nLLM({folder!r}, tensor_parallel_size=2, skip_tokenizer_init=True)\n")
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode != 0 and 'if __name__ == "__main__":' in run.stderr, run.stderr[-2000:]
