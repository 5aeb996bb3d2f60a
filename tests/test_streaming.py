"""Streaming: incremental detokenization never splits or repeats a multi-byte UTF-8 character;
``stream(engine)`` yields every token once; ``TextIteratorStreamer`` with the patched generate gives
stock's text."""

import threading

import torch
from transformers import TextIteratorStreamer

import paged_transformers
from paged_transformers import LLMEngine, SamplingParams
from paged_transformers.streaming import IncrementalDetokenizer, stream

TEXT = "naïve café, 世界 and emoji 🙂🚀 — ok"


def test_incremental_detokenizer_multibyte(smollm2):
    _, tokenizer = smollm2
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert len(ids) > len(TEXT.split())  # some characters span several tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some token completed no character on its own


def test_stream_engine_tokens_and_text(smollm2):
    model, tokenizer = smollm2
    prompts = ["Write a greeting in Japanese:", "List three emoji:"]
    params = SamplingParams(temperature=0, max_tokens=12)
    with LLMEngine(model, tokenizer=tokenizer) as engine:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        deltas = list(stream(engine))
    for i, p in enumerate(prompts):
        mine = [d for d in deltas if d.request_id == str(i)]
        ids = [t for d in mine for t in d.token_ids]
        enc = tokenizer(p, return_tensors="pt")
        stock = model.generate(**enc, max_new_tokens=12, do_sample=False)[0, enc.input_ids.shape[1]:].tolist()
        assert ids == stock
        assert "".join(d.text for d in mine) == tokenizer.decode(ids, skip_special_tokens=True)
        assert mine[-1].finished and not any(d.finished for d in mine[:-1])


def test_text_iterator_streamer_patched(smollm2):
    model, tokenizer = smollm2
    enc = tokenizer("Say something in French:", return_tensors="pt")

    def streamed(patched):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        kwargs = dict(**enc, max_new_tokens=10, do_sample=False, streamer=streamer)
        if patched:
            with paged_transformers.patch():
                out = model.generate(**kwargs)  # the engine feeds the streamer token by token
                return "".join(streamer), out
        thread = threading.Thread(target=lambda: result.append(model.generate(**kwargs)))
        result = []
        thread.start()
        text = "".join(streamer)
        thread.join()
        return text, result[0]

    stock_text, stock_out = streamed(False)
    paged_text, paged_out = streamed(True)
    assert paged_text == stock_text and torch.equal(paged_out, stock_out)

