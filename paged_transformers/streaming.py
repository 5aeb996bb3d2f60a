"""The old path of ``paged_transformers.integration.streaming`` (before the package was laid out by idea), kept so
that code written against it still imports: importing it warns once per process (a FutureWarning naming the new
path) and gives the same objects (``stream``, ``StreamDelta``, ``TextStream``, ``IncrementalDetokenizer``)."""

import warnings

from .integration.streaming import IncrementalDetokenizer, StreamDelta, TextStream, stream

__all__ = ["IncrementalDetokenizer", "StreamDelta", "TextStream", "stream"]

warnings.warn("paged_transformers.streaming moved to paged_transformers.integration.streaming: import from there "
              "(this alias will be removed)", FutureWarning, stacklevel=2)
