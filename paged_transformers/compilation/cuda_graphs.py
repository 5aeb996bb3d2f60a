"""Decode steps replayed from CUDA graphs, one per batch-size bucket, each captured at its bucket's first step.

A decode-only step (every sequence one token, every one sampled) of ``S`` sequences runs the graph of the
smallest bucket ``>= S`` on the runner's static buffers, padded to the bucket (CUDA graphs: NVIDIA's
``cudaGraphLaunch``; bucketed capture as in vLLM's ``CUDAGraphRunner``). Capturing lazily keeps engine start-up
to the compile: a process that only ever decodes at batch 1 captures one graph. Mixed and prefill steps run
eagerly.
"""

import logging
from typing import Callable

import torch

logger = logging.getLogger("paged_transformers")

# NOTE: vLLM's bucket ladder: every size up to 4, then multiples of 8 up to 16 and of 16 after it. A
# decode step at batch S runs the smallest bucket >= S; the padding rows cost compute only (their
# weights are read anyway), and decode is bandwidth-bound, so coarse buckets above 16 are nearly free.
_SMALL_BUCKETS = (1, 2, 4, 8)
_BUCKET_STRIDE = 16


def graph_batch_sizes(max_cudagraph_capture_size: int) -> list[int]:
    """Batch sizes (sequences) a decode CUDA graph is captured for, ascending; the last is
    ``max_cudagraph_capture_size`` (``EngineConfig``'s: 256 for 256 sequences gives 20 buckets, 512 gives 36).

    Raises:
        ValueError: ``max_cudagraph_capture_size`` not positive.
    """
    largest = max_cudagraph_capture_size
    if largest <= 0:
        raise ValueError(f"max_cudagraph_capture_size must be positive, got {largest}")
    sizes = [s for s in _SMALL_BUCKETS if s < largest]
    sizes += [s for s in range(_BUCKET_STRIDE, largest, _BUCKET_STRIDE)]
    sizes.append(largest)
    return sorted(set(sizes))


class DecodeGraphs:
    """The decode graphs of one runner: bucket sizes, the captured graphs and their static outputs.

    Args:
        device: the CUDA device the graphs run on.
        max_cudagraph_capture_size: the largest bucket (``graph_batch_sizes``).

    Attributes:
        enabled: False after a failed capture (every graph dropped; decode steps run eagerly from then on).
        sizes: the buckets, ascending.
        graphs: bucket -> its ``torch.cuda.CUDAGraph``; logits: bucket -> its static output ``[1, bucket, vocab]``.
        capture_error: why the capture failed, or None.
    """

    def __init__(self, device: torch.device, max_cudagraph_capture_size: int):
        self.device = device
        self.enabled = True
        self.sizes = graph_batch_sizes(max_cudagraph_capture_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_error: str | None = None
        self._pool = None  # the memory pool all decode graphs share (created at the first capture)
        self._stream: torch.cuda.Stream | None = None

    def bucket(self, num_seqs: int, dummy_step: Callable[[int], Callable[[], torch.Tensor]]) -> int | None:
        """The bucket that runs a decode-only step of ``num_seqs`` sequences, or None to run it eagerly (more
        sequences than the largest bucket, or graphs disabled). A bucket's first step captures its graph:
        ``dummy_step(size)`` fills the buffers with a padded dummy step of ``size`` rows and returns the forward
        to record. A failed capture disables graphs for good (``capture_error`` says why)."""
        if not self.enabled or num_seqs > self.sizes[-1]:
            return None
        size = next(size for size in self.sizes if size >= num_seqs)
        if size not in self.graphs:
            try:
                self.graphs[size], self.logits[size] = self.record(dummy_step(size))
            except Exception as e:  # an op that syncs or allocates on the host inside the forward
                self.release()
                self.enabled = False
                self.capture_error = f"{type(e).__name__}: {e}"
                logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", self.capture_error)
                return None
        return size

    def capture_all(self, dummy_step: Callable[[int], Callable[[], torch.Tensor]]) -> int:
        """Capture every bucket not captured yet, ascending (``bucket``'s capture, so a failure disables graphs as
        there): what a server does before it takes requests, so that no decode step waits for a capture. Returns the
        number of graphs captured now."""
        before = len(self.graphs)
        for size in self.sizes:
            if self.bucket(size, dummy_step) is None:
                break
        return len(self.graphs) - before

    def replay(self, size: int, num_seqs: int) -> torch.Tensor:
        """Replay bucket ``size``'s graph; returns the logits of its first ``num_seqs`` rows ``[num_seqs, vocab]``
        (a view of the static output, in the model's dtype)."""
        self.graphs[size].replay()
        return self.logits[size][0, :num_seqs]

    def record(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record ``forward()`` (a dummy decode step on the static buffers that writes no KV) as a CUDA graph in
        the shared memory pool. It runs eagerly twice first, on the capture stream (Triton JIT, cuBLAS
        workspaces).

        Returns:
            ``(graph, logits)``: the graph and its static output ``[1, bucket, vocab]``.
        """
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        stream, current = self._stream, torch.cuda.current_stream(self.device)
        try:
            stream.wait_stream(current)  # the steps before (and the dummy step's buffer writes) come first
            with torch.cuda.stream(stream):
                for _ in range(2):
                    forward()
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                logits = forward()
        finally:
            torch.cuda.synchronize(self.device)  # the real step's buffer writes come after the capture's reads
        return graph, logits

    def release(self) -> None:
        """Drop the captured graphs and their memory pool (they hold the KV pool's addresses: the engine's
        ``sleep`` and ``close``). Later decode steps capture their buckets' graphs again."""
        self.graphs.clear()
        self.logits.clear()
        self._pool = None
