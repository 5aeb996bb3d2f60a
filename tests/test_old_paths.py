"""Module paths that moved keep importing, with a warning naming the new path: code written against an earlier
README must not break on import."""

import importlib
import sys
import warnings

import pytest

import paged_transformers.integration.streaming as streaming


def test_streaming_alias_warns_once_and_gives_the_same_objects(monkeypatch):
    monkeypatch.delitem(sys.modules, "paged_transformers.streaming", raising=False)
    with pytest.warns(FutureWarning, match=r"paged_transformers\.integration\.streaming"):
        old = importlib.import_module("paged_transformers.streaming")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from paged_transformers.streaming import StreamDelta, TextStream, stream  # a second import: no warning
    assert (stream, StreamDelta, TextStream) == (streaming.stream, streaming.StreamDelta, streaming.TextStream)
    assert set(old.__all__) <= set(streaming.__all__)
