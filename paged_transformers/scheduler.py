"""Iteration-level scheduler: which sequences run in the next step, and with how many tokens.

One rule covers prefill, chunked prefill, decode and resume after preemption: each step gives a
sequence ``min(num_tokens - num_computed_tokens, remaining budget)`` tokens (vLLM V1's scheduler;
Yu et al., "Orca", OSDI 2022, for iteration-level scheduling). Running sequences go first, in
arrival order; waiting ones join while the token budget (``max_num_batched_tokens``), the sequence
limit (``max_num_seqs``) and the free blocks allow. When a running sequence needs a block and none is
free, the most recently admitted running sequence is preempted by recompute: its blocks are freed,
``num_computed_tokens`` goes back to 0, and it waits at the front of the queue.
"""

from collections import deque
from dataclasses import dataclass
from typing import Callable

from .block_manager import BlockCopy, BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan; the runner turns it into tensors, ``update_from_output`` applies the result."""

    seqs: list[Sequence]  # scheduled sequences, in batch order
    num_scheduled_tokens: list[int]  # seqs[i] computes tokens num_computed_tokens .. + num_scheduled_tokens[i]
    block_copies: list[BlockCopy]  # copy-on-write copies to make before the forward
    preempted: list[Sequence]  # sequences preempted while planning this step

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens in the step; <= max_num_batched_tokens."""
        return sum(self.num_scheduled_tokens)

    def samples(self, i: int) -> bool:
        """Whether ``seqs[i]`` catches up with its tokens this step, so its last row is sampled."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_scheduled_tokens[i] == seq.num_tokens


class Scheduler:
    """Waiting and running queues over one ``BlockManager``.

    Args:
        config: the engine limits (``max_num_seqs``, ``max_num_batched_tokens``, chunked prefill).
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

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            granted = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            while granted is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                granted = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            if granted is None:
                break
            seqs.append(seq)
            counts.append(num_new)
            copies.extend(granted)
            budget -= num_new
            i += 1

        # NOTE: no admissions in a step that had to preempt: the pool is full.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_new = min(remaining, budget)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                break
            granted = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            if granted is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(num_new)
            copies.extend(granted)
            budget -= num_new

        out = SchedulerOutput(seqs, counts, copies, preempted)
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens, (
            f"scheduled {out.total_num_scheduled_tokens} tokens over the budget {self.config.max_num_batched_tokens}"
        )
        assert len(self.running) <= self.config.max_num_seqs, f"{len(self.running)} running > max_num_seqs"
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Apply a finished step: advance ``num_computed_tokens``, append sampled tokens, check stops.

        Args:
            out: the step's plan.
            sampled: seq_id -> the token sampled for it, for each sequence that ``out.samples``.

        Returns:
            The sequences that finished in this step; their blocks are already freed.
        """
        finished = []
        for seq, num_new in zip(out.seqs, out.num_scheduled_tokens):
            if seq.is_finished:  # aborted during the step
                continue
            seq.num_computed_tokens += num_new
            if seq.seq_id not in sampled:
                continue
            seq.token_ids.append(sampled[seq.seq_id])
            status = self.check_stop(seq)
            if status is not None:
                self.finish(seq, status)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (stop, length, abort or error) and free its blocks at once."""
        assert status.is_finished, status
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.seq_id)
