"""Logits processors the engine treats specially: ``PerRequest``, a processor built fresh for every request.

Below the engine (``core`` builds each sequence's own instances) and the transformers integration (which builds
each request's processor list), so that neither imports the other for it.
"""

from typing import Any, Callable, Iterable

import torch
from transformers import LogitsProcessor

__all__ = ["PerRequest", "instantiate_per_request"]


class PerRequest(LogitsProcessor):
    """A logits processor built fresh for every request (for processors that keep state).

    Args:
        factory: ``() -> LogitsProcessor``; called once per request sequence by the engine, once in all
            by stock ``generate()`` (which then calls that instance with the whole batch).

    Raises:
        ValueError: ``factory`` is not callable.

    Examples:
        >>> from transformers import NoRepeatNGramLogitsProcessor
        >>> from paged_transformers.logits_process import PerRequest
        >>> proc = PerRequest(lambda: NoRepeatNGramLogitsProcessor(2))
        >>> proc.new() is proc.new()
        False
    """

    def __init__(self, factory: Callable[[], Any]):
        if not callable(factory):
            raise ValueError(f"PerRequest needs a callable factory, got {factory!r}")
        self.factory = factory
        self._shared = None

    def new(self):
        """A fresh instance for one request."""
        return self.factory()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._shared is None:
            self._shared = self.factory()
        return self._shared(input_ids, scores)


def instantiate_per_request(processors: Iterable | None) -> list:
    """The processors for one request: ``PerRequest`` entries replaced by fresh instances."""
    return [p.new() if isinstance(p, PerRequest) else p for p in (processors or [])]
