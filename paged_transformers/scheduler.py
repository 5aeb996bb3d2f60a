"""Iteration-level scheduler: which sequences run in the next step, and with how many tokens.

One rule covers prefill, chunked prefill, decode, prefix-cache hits and resume after preemption:
each step gives a sequence ``min(num_tokens - num_computed_tokens, remaining budget)`` tokens (vLLM
V1's scheduler; Yu et al., "Orca", OSDI 2022, for iteration-level scheduling). Running sequences go
first, in arrival order; waiting ones join while the token budget (``max_num_batched_tokens``), the
sequence limit (``max_num_seqs``) and the free blocks allow. When a running sequence needs a block
and none is free, the most recently admitted running sequence is preempted by recompute: its blocks
are freed, ``num_computed_tokens`` goes back to 0, and it waits at the front of the queue.

Prefix caching (``enable_prefix_caching``): a sequence admitted with ``num_computed_tokens == 0``
first takes the longest run of cached full blocks matching its tokens and starts at
``num_computed_tokens = min(hits * block_size, num_tokens - 1)``: at least its last token is
computed, so there are logits to sample from. After each step, blocks that became full are offered
to the cache. A preempted sequence therefore resumes from its cached blocks unless they were evicted.

n > 1 sampling: a request's first sequence carries the other ``n - 1`` in ``pending_forks``. When its
prompt is done, ``update_from_output`` forks them: they take its blocks by reference (copy-on-write on
the first write into the shared last block) and their own first token, sampled from the same logits
row. Admission reserves their ``max_num_seqs`` seats up front.
"""

from collections import deque
from dataclasses import dataclass
from typing import Callable

from .block_manager import BlockCopy, BlockManager
from .config import EngineConfig
from .prefix_cache import CacheStats, extend_block_hashes
from .sequence import PLACEHOLDER_TOKEN_ID, Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan; the runner turns it into tensors, ``update_from_output`` applies the result."""

    seqs: list[Sequence]  # scheduled sequences, in batch order
    num_scheduled_tokens: list[int]  # seqs[i] computes tokens num_computed_tokens .. + num_scheduled_tokens[i]
    block_copies: list[BlockCopy]  # copy-on-write copies to make before the forward
    preempted: list[Sequence]  # sequences preempted while planning this step
    # sample_mask[i]: seqs[i] catches up with its tokens this step, so its last row is sampled. Computed
    # once at construction (when the sequences' num_computed_tokens are the step's) for the runner, the
    # engine and update_from_output; pass None to have it computed.
    sample_mask: list[bool] | None = None

    def __post_init__(self):
        if self.sample_mask is None:
            mask = [seq.num_computed_tokens + n == seq.num_tokens for seq, n in zip(self.seqs, self.num_scheduled_tokens)]
            object.__setattr__(self, "sample_mask", mask)

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens in the step; <= max_num_batched_tokens."""
        return sum(self.num_scheduled_tokens)

    def samples(self, i: int) -> bool:
        """Whether ``seqs[i]`` catches up with its tokens this step, so its last row is sampled."""
        return self.sample_mask[i]


class Scheduler:
    """Waiting and running queues over one ``BlockManager``.

    Args:
        config: the engine limits (``max_num_seqs``, ``max_num_batched_tokens``, chunked prefill,
            prefix caching).
        block_manager: the pool the scheduled sequences draw blocks from.
        check_stop: called after a token is appended; returns the finished status or None.
    """

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        check_stop: Callable[[Sequence], SequenceStatus | None],
    ):
        self.config = config
        self.block_manager = block_manager
        self.check_stop = check_stop
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = CacheStats(num_blocks=block_manager.num_blocks)  # request and preemption counters

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring)."""
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        copies: list[BlockCopy] = []
        preempted: list[Sequence] = []

        # NOTE: the loop below runs for every running sequence at every step: locals, and the block
        # manager's own fast path for a decode token that lands in a block the sequence holds.
        allocate_slots = self.block_manager.allocate_slots
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            granted = allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            while granted is None:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                granted = allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            if granted is None:
                break
            seqs.append(seq)
            counts.append(num_new)
            if granted:
                copies.extend(granted)
            budget -= num_new
            i += 1

        # NOTE: no admissions in a step that had to preempt: the pool is full.
        seats = len(self.running) + sum(len(s.pending_forks) for s in self.running if s.pending_forks)  # n > 1: forks hold their seats early
        while not preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats + 1 + len(seq.pending_forks) > self.config.max_num_seqs:
                break
            admitted = self._admit(seq, budget)
            if admitted is None:
                break
            num_new, granted = admitted
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(num_new)
            copies.extend(granted)
            budget -= num_new
            seats += 1 + len(seq.pending_forks)

        out = SchedulerOutput(seqs, counts, copies, preempted)
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens, (
            f"scheduled {out.total_num_scheduled_tokens} tokens over the budget {self.config.max_num_batched_tokens}"
        )
        assert seats <= self.config.max_num_seqs, f"{seats} running sequences and forks > max_num_seqs"
        return out

    def _admit(self, seq: Sequence, budget: int) -> tuple[int, list[BlockCopy]] | None:
        """Grant a waiting sequence its blocks (prefix-cache hits first). Returns (num_new, copies), or
        None when it does not fit this step (then nothing changed)."""
        num_computed, hits = seq.num_computed_tokens, []
        if self.config.enable_prefix_caching and num_computed == 0:
            bm = self.block_manager
            hits = bm.find_cached_prefix(extend_block_hashes(seq.block_hashes, seq.token_ids, bm.block_size))
            num_computed = min(len(hits) * bm.block_size, seq.num_tokens - 1)
        remaining = seq.num_tokens - num_computed
        num_new = min(remaining, budget)
        # NOTE: with chunking off only a fresh prompt must fit whole: a sequence resumed after preemption
        # recomputes prompt + outputs, which can exceed the budget and would otherwise wait forever.
        if num_new < remaining and not self.config.enable_chunked_prefill and seq.num_output_tokens == 0:
            return None
        granted = self.block_manager.allocate_slots(seq.seq_id, num_computed, num_new, cached_blocks=hits)
        if granted is None:
            return None
        if seq.num_preemptions == 0 and seq.num_computed_tokens == 0 and seq.num_output_tokens == 0:
            seq.num_cached_tokens = num_computed
            self.stats.num_requests += 1
            self.stats.num_prompt_tokens += seq.num_prompt_tokens
            self.stats.num_cached_tokens += num_computed
        seq.num_computed_tokens = num_computed
        return num_new, granted

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Apply a finished step: advance ``num_computed_tokens``, cache full blocks, fork n > 1
        sequences whose prompt is done, append sampled tokens, check stops.

        Args:
            out: the step's plan.
            sampled: seq_id -> the token sampled for it, for each sequence that ``out.samples``, and
                for the ``pending_forks`` of each of those whose prompt is done.

        Returns:
            The sequences that finished in this step; their blocks are already freed.
        """
        finished = []
        caching = self.config.enable_prefix_caching
        bm = self.block_manager
        block_size = bm.block_size
        num_hashed = bm.num_hashed_blocks
        for seq, num_new, samples in zip(out.seqs, out.num_scheduled_tokens, out.sample_mask):
            forks = seq.pending_forks if samples else None
            if forks:
                seq.pending_forks = []
            if seq.status.is_finished:  # aborted during the step, or its sampling failed
                if forks:
                    finished += self._start_forks(seq, forks, sampled)
                continue
            seq.num_computed_tokens += num_new
            # only when a block filled up since the last offer (cache_full_blocks would do nothing else)
            if caching and seq.num_computed_tokens // block_size > num_hashed.get(seq.seq_id, 0):
                bm.cache_full_blocks(seq.seq_id, extend_block_hashes(seq.block_hashes, seq.token_ids, block_size),
                                     seq.num_computed_tokens)
            if forks:
                finished += self._start_forks(seq, forks, sampled)
            token_id = sampled.get(seq.seq_id)
            if token_id is not None and self._append_token(seq, token_id):
                finished.append(seq)
        return finished

    # -- async scheduling: update_from_output in two halves ------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """The first half of ``update_from_output`` for a step whose sampled tokens are still on the device
        (``LLMEngine.step`` pipelines the next step): advance ``num_computed_tokens``, cache full blocks,
        and append ``PLACEHOLDER_TOKEN_ID`` to each sampled sequence, so that ``schedule()`` plans its
        next decode token. ``replace_placeholders`` applies the tokens once they are on the host.

        Every unfinished sequence of ``out`` must be sampled in it, and no sequence may have pending forks
        (the engine pipelines only such steps). Blocks are hashed before the placeholder is appended, over
        tokens that are all real (``num_computed_tokens == num_tokens``).
        """
        assert not any(seq.pending_forks for seq in out.seqs), out
        self.update_from_output(out, {})  # no sampled tokens: advances and caches, appends nothing, stops nothing
        for seq, samples in zip(out.seqs, out.sample_mask):
            if seq.status.is_finished:  # aborted while the step ran
                continue
            assert samples and seq.token_ids[-1] != PLACEHOLDER_TOKEN_ID, seq
            assert seq.num_computed_tokens == seq.num_tokens, (seq.num_computed_tokens, seq.num_tokens)
            seq.token_ids.append(PLACEHOLDER_TOKEN_ID)

    def replace_placeholders(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """The second half of ``update_from_output`` after ``advance(out)``: put each sequence's sampled
        token in place of its placeholder and check the stops.

        Args:
            out: the step's plan, given to ``advance`` before.
            sampled: seq_id -> the token sampled for it (every unfinished sequence of ``out``).

        Returns:
            The sequences that finished; their blocks are already freed (a step still running on the
            device may write into them: stream order puts that write before any later step's use).
        """
        finished = []
        for seq in out.seqs:
            if seq.status.is_finished:  # aborted while its step ran, or finished by an earlier step
                continue
            assert seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID, seq
            seq.token_ids.pop()
            if self._append_token(seq, sampled[seq.seq_id]):
                finished.append(seq)
        return finished

    def _append_token(self, seq: Sequence, token_id: int) -> bool:
        """Append a sampled token and check the stop conditions; True when the sequence finished (its
        blocks are freed then)."""
        seq.token_ids.append(token_id)
        status = self.check_stop(seq)
        if status is not None:
            self.finish(seq, status)
        return status is not None

    def _start_forks(self, parent: Sequence, forks: list[Sequence], sampled: dict[int, int]) -> list[Sequence]:
        """Start the n > 1 forks of a parent whose prompt was just computed. Each shares the parent's
        blocks by reference and appends its own first token; if the parent no longer holds blocks
        (its sampling failed), a fork waits to compute the prompt itself. Returns the forks that
        finished at once."""
        finished = []
        for child in forks:
            if child.is_finished:  # aborted, or its own sampling failed
                continue
            assert child.num_tokens == parent.num_prompt_tokens == parent.num_computed_tokens or parent.is_finished
            if parent.is_finished:
                child.num_computed_tokens = 0
                self.waiting.appendleft(child)
            else:
                self.block_manager.fork(parent.seq_id, child.seq_id)
                child.num_computed_tokens = parent.num_computed_tokens
                child.block_hashes = list(parent.block_hashes)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
            if self._append_token(child, sampled[child.seq_id]):
                finished.append(child)
        return finished

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (stop, length, abort or error) and free its blocks at once. A sequence ended while
        it holds an async step's placeholder (``advance``; its sampling failed, or an abort) drops it: the
        placeholder is never replaced then, and must not reach an output."""
        assert status.is_finished, status
        seq.status = status
        if seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            seq.token_ids.pop()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.seq_id)
