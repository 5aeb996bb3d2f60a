"""``StepLoop``: the stepping side of the server's engine front (``async_engine.AsyncEngine``), in its stepping thread
or in the engine process (``engine_process``): apply the commands, step the engine, emit its outputs and counters."""

import dataclasses
import logging
import time
from collections.abc import Callable

from ..config import EngineConfig
from ..sampling_params import SamplingParams

logger = logging.getLogger("paged_transformers")

IDLE_POLL_S = 0.5  # how often an idle stepping loop wakes up to look for a stop (seconds)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's counters after a step, published by the stepping loop for metrics and admission.

    Attributes:
        num_running: requests with a sequence in the running batch.
        num_waiting: requests queued (in the engine's waiting queue, or handed over and not yet added).
        kv_cache_usage: KV blocks held by sequences / blocks in the pool, 0.0 to 1.0.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in the prefix cache / found there.
        num_preemptions: sequences preempted since the engine started.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class EngineLimits:
    """What the front checks requests against, fixed for the engine's life: the vocabulary size (tokens), the
    longest sequence (``max_model_len``, tokens) and the engine's ``EngineConfig``."""

    vocab_size: int
    max_model_len: int
    config: EngineConfig

    @classmethod
    def of(cls, engine) -> "EngineLimits":
        return cls(engine.vocab_size, engine.max_model_len, engine.config)


class StepLoop:
    """The stepping side of the front: applies the commands, steps the engine, emits its outputs and counters.

    Args:
        engine: the attached ``LLMEngine``, touched by this loop alone.
        next_command: ``next_command(block)`` returns the next command, waiting up to ``IDLE_POLL_S`` seconds for
            one when ``block``, or None when there is none.
        emit: called with each message: ``("snapshot", EngineSnapshot)``, ``("outputs", [RequestOutput])``,
            ``("added", count)``, ``("failed", request_id, exception)``.
        should_stop: polled when no command came; True ends the loop.
    """

    def __init__(self, engine, next_command: Callable[[bool], tuple | None], emit: Callable[[tuple], None],
                 should_stop: Callable[[], bool] = lambda: False):  # fmt: skip
        self.engine, self.next_command, self.emit, self.should_stop = engine, next_command, emit, should_stop
        self._period = _BusyPeriod(engine.config.max_num_seqs)

    def prepare(self) -> None:
        """Before the first request: capture every decode CUDA graph (no step waits for a capture), publish the
        counters."""
        t0 = time.perf_counter()
        num_graphs = self.engine.capture_cudagraphs()
        if num_graphs:
            logger.info("paged_transformers: captured %d decode CUDA graphs in %.1f s", num_graphs, time.perf_counter() - t0)
        self.publish_snapshot()

    def run(self) -> None:
        """Step until a ``("stop",)`` command (or ``should_stop``). Each busy period (from the first step after an
        idle wait to the next idle wait of ``IDLE_POLL_S`` with no command, or the stop) ends with a log line of how
        the loop spent it: steps, emitting their outputs and counters, the CPU time of the whole process (all its
        threads), and how fast the period's requests came (over how many seconds they were added, and how long after
        the first the ``max_num_seqs``-th came), so that a server's log shows whether the engine or the front bounds it: whether
        the process was short of CPU (stepping wall time well over its CPU time; a CUDA wait spins, so CPU time near
        wall time does not by itself mean the host bounds the step), and whether the steps waited for requests to
        arrive."""
        engine, clock = self.engine, time.perf_counter
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                applied = self.apply_commands(block=idle)
                if applied is None:
                    return
                if idle and not applied:
                    self._period = self._period.log_and_reset()
                if not engine.has_unfinished_requests():
                    continue
                t0 = clock()
                outputs = engine.step()
                t1 = clock()
                self.publish_snapshot()
                if outputs:
                    self.emit(("outputs", outputs))
                self._period.add_step(t0, t1, clock())
        finally:
            self._period.log_and_reset()

    def apply_commands(self, block: bool) -> int | None:
        """Apply the queued commands (waiting for one when ``block``). Returns how many were applied, or None on
        ``stop`` (or when none came and ``should_stop`` says so)."""
        engine, added, applied = self.engine, 0, 0
        try:
            command = self.next_command(block)
            if command is None:
                return None if self.should_stop() else 0
            while command is not None:
                if command[0] == "stop":
                    return None
                applied += 1
                if command[0] == "add":
                    added += 1
                    self._add(*command[1:])
                else:
                    engine.abort_request(command[1])
                command = self.next_command(False)
            return applied
        finally:
            if applied:  # published before the front stops counting the added ones as handed over: never undercounted
                self.publish_snapshot()
            if added:
                self.emit(("added", added))

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._period.add_request(time.perf_counter())
        try:
            self.engine.add_request(request_id, prompt_token_ids, params)
        except Exception as e:  # noqa: BLE001 - checked before (check_request): a failure here is this request's alone
            self.emit(("failed", request_id, e))

    def publish_snapshot(self) -> None:
        engine = self.engine
        stats = engine.stats()
        running = {seq.request_id for seq in engine.scheduler.running}
        self.emit(("snapshot", EngineSnapshot(
            num_running=len(running), num_waiting=len(engine.requests) - len(running),
            kv_cache_usage=stats.num_used_blocks / stats.num_blocks if stats.num_blocks else 0.0,
            prefix_cache_queries=stats.num_prompt_tokens, prefix_cache_hits=stats.num_cached_tokens,
            num_preemptions=stats.num_preemptions,
        )))  # fmt: skip


class _BusyPeriod:
    """Where the stepping loop's time went since its last idle wait: from its first step's start to its last step's
    end, steps, time stepping and emitting, the process's CPU time over the period, and when its requests were added
    (seconds; ``max_num_seqs`` names the arrival worth reporting: the one that can fill the running batch)."""

    __slots__ = ("max_num_seqs", "start", "end", "cpu_start", "cpu_end", "num_steps", "step_s", "emit_s", "add_times")

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.start, self.end, self.num_steps, self.step_s, self.emit_s = None, None, 0, 0.0, 0.0
        self.cpu_start = self.cpu_end = 0.0
        self.add_times: list[float] = []

    def add_request(self, t: float) -> None:
        self.add_times.append(t)

    def add_step(self, t_step: float, t_stepped: float, t_emitted: float) -> None:
        if self.start is None:
            self.start, self.cpu_start = t_step, time.process_time()
        self.end, self.cpu_end = t_emitted, time.process_time()
        self.num_steps += 1
        self.step_s += t_stepped - t_step
        self.emit_s += t_emitted - t_stepped

    def log_and_reset(self) -> "_BusyPeriod":
        if self.num_steps:
            adds, k = self.add_times, self.max_num_seqs
            arrivals = f"{len(adds)} requests added over {adds[-1] - adds[0]:.2f} s" if adds else "no requests added"
            if len(adds) > k:
                arrivals += f" (the {k}th after {adds[k - 1] - adds[0]:.2f} s)"
            logger.info("paged_transformers: busy for %.2f s: %d steps, %.2f s stepping, %.2f s emitting outputs and "
                        "counters, %.2f s of process CPU, %s", self.end - self.start, self.num_steps, self.step_s,
                        self.emit_s, self.cpu_end - self.cpu_start, arrivals)
        return _BusyPeriod(self.max_num_seqs)
