"""Custom logits processors through the engine: each request's processor sees exactly the history and
scores stock ``generate()`` gives it for that prompt alone, and changes the output the same way;
``PerRequest`` gives stateful processors one instance per request; stop_strings match stock."""

import torch
from transformers import GenerationConfig, LogitsProcessor

import paged_transformers
from paged_transformers import PerRequest, paged_generate

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32, 33, 34]]


class Recorder(LogitsProcessor):
    """Records every call's history and raw scores, and bans the last token (so it changes the output)."""

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, scores):
        self.calls.append((input_ids.clone(), scores.clone()))
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), input_ids[:, -1]] = float("-inf")
        return scores


def stock_alone(model, prompt, **kwargs):
    rec = Recorder()
    out = model.generate(torch.tensor([prompt]), logits_processor=[rec], max_new_tokens=6, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist(), rec.calls


def test_recorder_sees_own_history_patched_generate(tiny_model):
    model = tiny_model("llama")
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[2] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    rec = PerRequest(Recorder)
    instances = []
    original_new = rec.new
    rec.new = lambda: instances.append(original_new()) or instances[-1]
    with paged_transformers.patch():
        out = model.generate(ids, attention_mask=mask, logits_processor=[rec], max_new_tokens=6, do_sample=False)
    assert len(instances) == len(PROMPTS)  # one instance per request
    for row, (prompt, inst) in enumerate(zip(PROMPTS, instances)):
        tokens, calls = stock_alone(model, prompt)
        assert out[row, width : width + len(tokens)].tolist() == tokens
        assert len(inst.calls) == len(calls)
        for (h, s), (h_ref, s_ref) in zip(inst.calls, calls):
            assert torch.equal(h, h_ref)  # [1, len] unpadded history, nobody else's tokens
            assert torch.allclose(s, s_ref, atol=1e-4, rtol=1e-4)


def test_recorder_sees_own_history_paged_generate(tiny_model):
    model = tiny_model("qwen2")
    recorders = {}

    def factory():
        recorders[len(recorders)] = Recorder()
        return recorders[len(recorders) - 1]

    outs = paged_generate(model, PROMPTS, generation_config=GenerationConfig(max_new_tokens=6, do_sample=False),
                          logits_processor=[PerRequest(factory)], use_tqdm=False)
    assert len(recorders) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        tokens, calls = stock_alone(model, prompt)
        assert out.outputs[0].token_ids == tokens
        # recorders are created in prompt order; find the one whose first history is this prompt
        rec = next(r for r in recorders.values() if r.calls[0][0][0].tolist() == prompt)
        assert [h.tolist() for h, _ in rec.calls] == [h.tolist() for h, _ in calls]


def test_stop_strings_match_stock(smollm2):
    model, tokenizer = smollm2
    prompts = ["Count: one, two, three,", "The alphabet: a, b, c,"]
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        kwargs = dict(max_new_tokens=12, do_sample=False, stop_strings=[","], tokenizer=tokenizer)
        stock = model.generate(**ids, **kwargs)
        with paged_transformers.patch():
            paged = model.generate(**ids, **kwargs)
        assert torch.equal(paged, stock)
        assert stock.shape[1] < ids.input_ids.shape[1] + 12  # the stop string did stop it
    outs = paged_generate(model, prompts, tokenizer=tokenizer, use_tqdm=False,
                          generation_config=GenerationConfig(max_new_tokens=12, do_sample=False, stop_strings=[","]))
    for prompt, out in zip(prompts, outs):
        ids = tokenizer(prompt, return_tensors="pt")
        stock = model.generate(**ids, max_new_tokens=12, do_sample=False, stop_strings=[","], tokenizer=tokenizer)
        assert out.outputs[0].token_ids == stock[0, ids.input_ids.shape[1]:].tolist()



def test_per_request_with_explicit_sampling_params(tiny_model):
    """``PerRequest`` next to explicit ``SamplingParams`` used to give every request one shared instance."""
    model = tiny_model("llama")
    made = []

    def factory():
        made.append(Recorder())
        return made[-1]

    params = paged_transformers.SamplingParams(temperature=0.0, max_tokens=6)
    outs = paged_generate(model, PROMPTS, params, logits_processor=[PerRequest(factory)], use_tqdm=False)
    assert len(made) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        tokens, calls = stock_alone(model, prompt)
        assert out.outputs[0].token_ids == tokens
        rec = next(r for r in made if r.calls[0][0][0].tolist() == prompt)
        assert [h.tolist() for h, _ in rec.calls] == [h.tolist() for h, _ in calls]  # its own history only
    # through the engine directly, n=2: one instance per sequence
    made.clear()
    params = paged_transformers.SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=3,
                                               logits_processors=[PerRequest(factory)])
    outs = paged_generate(model, PROMPTS[:1], params, use_tqdm=False)
    assert len(made) == 2 and all(len(r.calls) == 3 for r in made)
