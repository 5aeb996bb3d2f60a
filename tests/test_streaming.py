"""Streaming: incremental detokenization never splits or repeats a multi-byte UTF-8 character;
``stream(engine)`` yields every token once; ``TextIteratorStreamer`` with the patched generate gives
stock's text."""

import threading

import pytest
import torch
from transformers import TextIteratorStreamer

import paged_transformers
from paged_transformers import LLMEngine, SamplingParams
from paged_transformers.integration.streaming import IncrementalDetokenizer, stream

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



# -- n > 1 and stop strings: every character streamed once, joined stream == final text ------------------


class PieceTokenizer:
    """A toy tokenizer: token id ``t`` decodes to the UTF-8 bytes ``pieces[t]`` (pieces may split a character;
    ids without a piece decode to '.'), as a byte-level BPE decodes."""

    def __init__(self, pieces: dict[int, bytes]):
        self.pieces = pieces
        self.eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces.get(int(i), b".") for i in ids).decode("utf-8", errors="replace")


def forcing(prompt_len: int, script: list[int]):
    """A logits processor that makes output token ``k`` be ``script[k]``."""

    def processor(input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced[..., script[input_ids.shape[1] - prompt_len]] = 0.0
        return forced

    return processor


def stream_and_finals(model, tokenizer, requests):
    """``stream()`` the ``requests`` (``request_id -> (prompt, SamplingParams)``); returns the deltas and the
    engine's own finished ``RequestOutput``s of the same run."""
    finals = {}
    with LLMEngine(model, tokenizer=tokenizer) as engine:
        step = engine.step

        def recording_step():
            outputs = step()
            finals.update((out.request_id, out) for out in outputs if out.finished)
            return outputs

        engine.step = recording_step
        for request_id, (prompt, params) in requests.items():
            engine.add_request(request_id, prompt, params)
        deltas = list(stream(engine))
    return deltas, finals


def assert_streamed_once(deltas, finals):
    """Per sequence: token ids and texts join to the final output, exactly one delta is finished (the last)."""
    for request_id, final in finals.items():
        for comp in final.outputs:
            mine = [d for d in deltas if d.request_id == request_id and d.index == comp.index]
            assert [d.finished for d in mine] == [False] * (len(mine) - 1) + [True], (request_id, comp.index)
            assert [t for d in mine for t in d.token_ids] == comp.token_ids, (request_id, comp.index)
            assert "".join(d.text for d in mine) == comp.text, (request_id, comp.index, [d.text for d in mine])


def test_stream_n_gt_1_yields_finished_sequences_once(tiny_model):
    """Sequences of one request finishing at different steps used to be yielded again, whole, at every
    later step of their siblings."""
    model = tiny_model("llama")
    tokenizer = PieceTokenizer({t: bytes([65 + t % 26]) for t in range(128)})
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=30, stop_token_ids=list(range(3, 30)))
    deltas, finals = stream_and_finals(model, tokenizer, {"a": ([5, 6, 7], params), "b": ([8, 9], params)})
    lengths = {len(c.token_ids) for out in finals.values() for c in out.outputs}
    assert len(lengths) > 1, "the sequences should finish at different steps"
    assert all(c.finish_reason == "stop" for out in finals.values() for c in out.outputs)
    assert_streamed_once(deltas, finals)


PIECES = {10: b"ABC", 11: b"DEF", 12: b"GH", 20: "x世".encode(), 21: "界".encode()[:2], 22: "界".encode()[2:] + b"y",
          23: "人".encode()}


@pytest.mark.parametrize(
    "script, stop, texts, final",
    [([10, 11, 12], ["DE"], ["ABC", ""], "ABC"),  # the stop begins at a token boundary
     ([10, 11, 12], ["CD"], ["AB", ""], "AB"),  # the stop spans two tokens: "C" held back, then cut
     ([10, 12, 11], ["CD"], ["AB", "CGH", "DEF"], "ABCGHDEF"),  # "C" held back, released when "GH" shows no stop
     ([20, 21, 22, 12], ["世界"], ["x", "", ""], "x"),  # multi-byte stop, its last character split over tokens
     ([20, 23, 21, 22], ["世界"], ["x", "世人", "", "界y"], "x世人界y"),  # a multi-byte prefix held, then released
     ([10, 11, 12], ["Z", "EF", "BCD"], ["A", ""], "A")],  # several stops: the text is cut at the earliest one
    ids=["boundary", "spanning", "released", "multibyte", "multibyte-released", "earliest"],
)
def test_stream_holds_back_stop_string_prefixes(tiny_model, script, stop, texts, final):
    """The stream used to yield "ABC", "DEF" for stop "DE" (final text "ABC"), and a partial "C" for stop "CD"."""
    model = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=len(script), ignore_eos=True, stop=stop,
                            logits_processors=[forcing(3, script)])
    deltas, finals = stream_and_finals(model, PieceTokenizer(PIECES), {"a": ([5, 6, 7], params)})
    assert [d.text for d in deltas] == texts
    assert finals["a"].outputs[0].text == final
    assert_streamed_once(deltas, finals)


@pytest.mark.parametrize(
    "script, extra, text, token_ids, stop_reason",
    [([10, 11, 12], dict(stop_token_ids=[11]), "ABC", [10, 11], 11),  # an ordinary token as the stop token
     ([10, 11, 12], dict(stop_token_ids=[11], include_stop_str_in_output=True), "ABCDEF", [10, 11], 11),
     ([10, 11, 2], {}, "ABCDEF", [10, 11, 2], None),  # EOS (the tiny Llama's id 2), decoded "." by the toy tokenizer
     ([10, 11, 2], dict(include_stop_str_in_output=True), "ABCDEF.", [10, 11, 2], None),
     ([10, 11, 12], dict(stop=["DE"], include_stop_str_in_output=True), "ABCDE", [10, 11], "DE")],
    ids=["stop-token", "stop-token-included", "eos", "eos-included", "stop-string-included"],
)
def test_stop_token_text_left_out_as_vllm(tiny_model, script, extra, text, token_ids, stop_reason):
    """vLLM keeps the stop token (or EOS) that ended a sequence in ``token_ids`` and leaves its text out of
    ``text`` unless ``include_stop_str_in_output``; the text used to end with the stop token's "DEF". The
    stream joins to the same text."""
    model = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=len(script), logits_processors=[forcing(3, script)], **extra)
    deltas, finals = stream_and_finals(model, PieceTokenizer(PIECES), {"a": ([5, 6, 7], params)})
    comp = finals["a"].outputs[0]
    assert (comp.text, comp.token_ids, comp.finish_reason, comp.stop_reason) == (text, token_ids, "stop", stop_reason)
    assert_streamed_once(deltas, finals)


def test_stream_stop_strings_n_gt_1_random(tiny_model):
    """Random sampling over pieces that make the stops appear often, n=3, with multi-byte pieces split
    over tokens: every sequence's stream joins to its final text, which is cut before its stop."""
    model = tiny_model("llama")
    alphabet = [b"a", b"b", b"ab", b"ba", "é".encode()[:1], "é".encode()[1:], "é".encode(), b" "]
    tokenizer = PieceTokenizer({t: alphabet[t % len(alphabet)] for t in range(3, 128)})
    stops = ["bab", "éa", "a é"]
    requests = {str(seed): ([5 + seed, 6, 7], SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=24, stop=stops))
                for seed in range(6)}
    deltas, finals = stream_and_finals(model, tokenizer, requests)
    assert_streamed_once(deltas, finals)
    cut = 0
    for out in finals.values():
        for comp in out.outputs:
            full = tokenizer.decode(comp.token_ids)
            assert not any(s in comp.text for s in stops)
            if comp.finish_reason == "stop":
                assert full.startswith(comp.text + comp.stop_reason) and comp.stop_reason in stops
                cut += 1
            else:
                assert comp.text == full
    assert cut >= 6, f"only {cut} sequences stopped at a stop string"


def test_stream_stop_string_smollm2(smollm2):
    model, tokenizer = smollm2
    prompt = "Write one sentence about the sea:"
    with LLMEngine(model, tokenizer=tokenizer) as engine:
        engine.add_request("full", prompt, SamplingParams(temperature=0, max_tokens=16))
        full = [d for d in stream(engine)]
    text = "".join(d.text for d in full)
    # a stop string that starts inside a token and ends in a later one, first found at `start`
    start = next(p for p in range(6, len(text) - 4) if text.find(text[p : p + 4]) == p and text[p] != " ")
    stop = text[start : start + 4]
    deltas, finals = stream_and_finals(
        model, tokenizer, {"a": (prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop]))}
    )
    assert finals["a"].outputs[0].text == text[:start]
    assert_streamed_once(deltas, finals)


class ChunkTokenizer:
    """Tokens are chunks of 1 to 3 bytes of UTF-8 (token t is ``chunks[t]``), so a token can end a character
    and begin the next one: its complete characters decode only with the next token(s)."""

    def __init__(self):
        self.chunks: list[bytes] = []

    def encode(self, data: bytes, rng) -> list[int]:
        ids, i = [], 0
        while i < len(data):
            n = rng.randint(1, 3)
            self.chunks.append(data[i : i + n])
            ids.append(len(self.chunks) - 1)
            i += n
        return ids

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.chunks[t] for t in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("seed", range(30))
def test_incremental_stop_search_finds_what_a_full_decode_finds(seed):
    """The output processor searches stop strings in incrementally decoded text, only where new text can
    complete one; reference: the earliest stop in a full decode of the output after each token, the first
    token at which one appears. Texts mix ASCII and multi-byte characters, and a stop may end inside a token
    that also holds the first bytes of the next character."""
    import random

    from paged_transformers.core.output_processor import _StopStrings, first_stop

    rng = random.Random(seed)
    text = "".join(rng.choice(["a", "b", "é", "✓", "😀", " "]) for _ in range(40))
    tokenizer = ChunkTokenizer()
    ids = tokenizer.encode(text.encode(), rng)
    stops = [text[i : i + rng.randint(1, 4)] for i in (rng.randrange(40) for _ in range(2))] + ["zz"]
    search = _StopStrings(tokenizer, stops)
    for n in range(1, len(ids) + 1):
        want = first_stop(tokenizer.decode(ids[:n]), stops)
        assert search.find(ids[:n]) == want, (n, text, stops)
        if want is not None:
            break
    else:
        pytest.fail(f"no stop found in {text!r} for {stops}")
