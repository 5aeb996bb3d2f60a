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

A plan is a message (``messages.SchedulerOutput``): per sequence the tokens to compute and its new
blocks. Planning a step advances ``num_computed_tokens`` at once and counts the tokens that step samples
as ``num_output_placeholders``; ``update_from_output`` appends the sampled tokens (a
``messages.ModelRunnerOutput``, its only input), so the next plan can be made before they are known
(``schedule_ahead``, async scheduling). Stop checks are not the scheduler's: the output processor reads
the new tokens and ends sequences with ``finish``.

Prompt logprobs (``SamplingParams.prompt_logprobs``): the plan lists the rows of each prompt chunk whose logits
score the next prompt token (``messages.PromptLogprobRows``), and ``update_from_output`` appends their logprobs.
A sequence whose prompt logprobs are incomplete takes no prefix-cache hits (it needs every position's logits);
its full blocks are still offered to the cache. With a prompt of 8 tokens in chunks of 4::

    prompt tokens   t0  t1  t2  t3 | t4  t5  t6  t7
    chunk 1 rows    p0  p1  p2  p3                    score t1 t2 t3 t4
    chunk 2 rows                     p4  p5  p6  p7   score t5 t6 t7; p7 is sampled (the first output token)
    prompt_logprobs [None, t1, ..., t7]: 8 entries

A sequence preempted midway recomputes its prompt, and the positions already scored are not listed again.

n > 1 sampling: a request's first sequence carries the other ``n - 1`` in ``pending_forks``
(``sequence.fan_out``). The step that samples its first token forks them: they take its blocks by
reference (copy-on-write on the first write into the shared last block) and sample their own first
token from a copy of its logits row. Admission reserves their ``max_num_seqs`` seats up front.
"""

from collections import deque

from .block_manager import BlockCopy, BlockManager
from ..config import EngineConfig
from .messages import ForkedSeq, ModelRunnerOutput, PromptLogprobRows, ScheduledSeq, SchedulerOutput
from .prefix_cache import CacheStats, extend_block_hashes
from .sequence import Sequence, SequenceStatus


class Scheduler:
    """Waiting and running queues over one ``BlockManager``.

    Args:
        config: the engine limits (``max_num_seqs``, ``max_num_batched_tokens``, chunked prefill,
            prefix caching).
        block_manager: the pool the scheduled sequences draw blocks from.
        max_model_len: longest sequence in tokens (``schedule_ahead`` plans no token past it).
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}  # seq_id -> every unfinished sequence (pending forks included)
        self.stats = CacheStats(num_blocks=block_manager.num_blocks)  # request and preemption counters
        self._finished_seq_ids: list[int] = []  # finished since the last plan that was not empty
        self._step_id = 0

    def add(self, seq: Sequence) -> None:
        """Queue a request's first sequence; its ``pending_forks`` join when it samples its first token."""
        self.seqs[seq.seq_id] = seq
        for child in seq.pending_forks:
            self.seqs[child.seq_id] = child
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, sit_out: frozenset[int] = frozenset()) -> SchedulerOutput:
        """Plan the next step (see the module docstring) and advance the planned sequences. The running
        sequences whose ids are in ``sit_out`` are left out of it (``schedule_ahead``: they stop with the
        token being sampled)."""
        budget = self.config.max_num_batched_tokens
        entries: list[tuple[Sequence, int, int, list[BlockCopy]]] = []  # (seq, num_new, old table length, copies)
        preempted: list[Sequence] = []
        budget = self._schedule_running(budget, entries, preempted, sit_out)
        if not preempted:  # NOTE: no admissions in a step that had to preempt: the pool is full.
            self._schedule_waiting(budget, entries)
        return self._make_plan(entries, preempted)

    def schedule_ahead(self) -> SchedulerOutput | None:
        """Plan the next step while the last planned one is still being sampled (async scheduling), or None
        when that plan could differ from the one ``schedule()`` makes after its tokens are read: some
        sequence waits or is left out of that step, needs host work to sample (``Sequence.needs_host_sampling``,
        fixed when its request was added),
        or the pool lacks the blocks for every next token (``BlockManager.num_blocks_needed``: no
        preemption). A sequence that stops by length with the token being sampled
        (``Sequence.at_length_limit``) sits the plan out: the output processor ends it once that token is
        read, whatever the token, so ``schedule()`` would leave it out too. Each other running sequence
        computes one token: the one being sampled, whose id is on the device. None too when every
        sequence stops."""
        running, bm = self.running, self.block_manager
        if self.waiting or not running or len(running) > self.config.max_num_batched_tokens:
            return None
        num_blocks, stopping = 0, []
        for seq in running:
            if seq.num_output_placeholders != 1 or seq.num_computed_tokens != seq.num_tokens:
                return None
            if seq.at_length_limit(self.max_model_len, 1):
                stopping.append(seq.seq_id)
                continue
            if seq.needs_host_sampling:
                return None
            num_blocks += bm.num_blocks_needed(seq.seq_id, seq.num_computed_tokens, 1)
        if num_blocks > bm.num_free_blocks or len(stopping) == len(running):
            return None
        plan = self.schedule(frozenset(stopping))
        assert (not plan.preempted_seq_ids
                and plan.total_num_scheduled_tokens == len(plan.seqs) == len(running) - len(stopping)), plan
        return plan

    def _schedule_running(self, budget: int, entries: list, preempted: list[Sequence], sit_out: frozenset[int]) -> int:
        """Grant the running sequences not in ``sit_out`` their tokens in order, preempting from the back when
        the pool is full. Returns the budget left."""
        # NOTE: the loop runs for every running sequence at every step: locals, and the block manager's
        # own fast path for a decode token that lands in a block the sequence holds.
        allocate_slots, tables = self.block_manager.allocate_slots, self.block_manager.block_tables
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if sit_out and seq.seq_id in sit_out:
                i += 1
                continue
            num_new = min(seq.num_tokens + seq.num_output_placeholders - seq.num_computed_tokens, budget)
            old_len = len(tables.get(seq.seq_id, ()))
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
            entries.append((seq, num_new, old_len, granted))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, entries: list) -> None:
        """Admit waiting sequences in order while the budget, the seats and the pool allow."""
        max_num_seqs = self.config.max_num_seqs
        seats = len(self.running) + sum(len(s.pending_forks) for s in self.running if s.pending_forks)  # n > 1: forks hold their seats early
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats + 1 + len(seq.pending_forks) > max_num_seqs:
                break
            admitted = self._admit(seq, budget)
            if admitted is None:
                break
            num_new, granted = admitted
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            entries.append((seq, num_new, 0, granted))
            budget -= num_new
            seats += 1 + len(seq.pending_forks)
        assert seats <= max_num_seqs, f"{seats} running sequences and forks > max_num_seqs"

    def _make_plan(self, entries: list, preempted: list[Sequence]) -> SchedulerOutput:
        """The plan of ``entries``; advances each sequence by its tokens (a sampled one gets a placeholder)
        and forks the pending n > 1 sequences of the ones sampled for the first time."""
        tables = self.block_manager.block_tables
        seqs, forked, copies, prompt_rows = [], [], [], []
        for seq, num_new, old_len, granted in entries:
            start = seq.num_computed_tokens
            table = tables[seq.seq_id]
            replace = not old_len or bool(granted)
            samples = start + num_new == seq.num_tokens + seq.num_output_placeholders
            seqs.append(ScheduledSeq(seq.seq_id, seq.request_id, start, num_new, tuple(seq.token_ids[start : start + num_new]),
                                     tuple(table if replace else table[old_len:]), replace, samples))
            if seq.prompt_logprobs is not None:
                # positions first .. end - 1 score prompt tokens first + 1 .. end; those scored before a preemption
                # are skipped
                first, end = max(start, len(seq.prompt_logprobs) - 1), min(start + num_new, seq.num_prompt_tokens - 1)
                if end > first:
                    prompt_rows.append(PromptLogprobRows(seq.seq_id, first, tuple(seq.token_ids[first + 1 : end + 1])))
            copies += granted
            seq.num_computed_tokens = start + num_new
            if samples:
                seq.num_output_placeholders += 1
                if seq.pending_forks:
                    forked += self._fork(seq)
        assert sum(s.num_scheduled_tokens for s in seqs) <= self.config.max_num_batched_tokens, seqs
        finished = ()
        if seqs:  # an empty plan is not run: the runner hears of the finished sequences with the next one
            finished, self._finished_seq_ids = tuple(self._finished_seq_ids), []
        self._step_id += 1
        return SchedulerOutput(self._step_id, tuple(seqs), tuple(forked), tuple(copies),
                               tuple(s.seq_id for s in preempted), finished, tuple(prompt_rows))

    def _fork(self, parent: Sequence) -> list[ForkedSeq]:
        """Start the n > 1 sequences of a parent whose first token this step samples: each takes its blocks
        by reference and samples its own first token from a copy of the parent's logits row."""
        forks, parent.pending_forks = parent.pending_forks, []
        forked = []
        for child in forks:
            if child.is_finished:  # aborted
                continue
            assert child.num_tokens == parent.num_prompt_tokens == parent.num_computed_tokens, (child, parent)
            self.block_manager.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_output_placeholders = 1
            child.block_hashes = list(parent.block_hashes)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
            forked.append(ForkedSeq(child.seq_id, child.request_id, parent.seq_id,
                                    tuple(self.block_manager.block_tables[child.seq_id])))
        return forked

    def _admit(self, seq: Sequence, budget: int) -> tuple[int, list[BlockCopy]] | None:
        """Grant a waiting sequence its blocks (prefix-cache hits first). Returns (num_new, copies), or
        None when it does not fit this step (then nothing changed)."""
        num_computed, hits = seq.num_computed_tokens, []
        if self.config.enable_prefix_caching and num_computed == 0 and not seq.needs_prompt_logprobs:
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
        assert not seq.num_output_placeholders, f"{seq} preempted with a step being sampled"
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def update_from_output(self, plan: SchedulerOutput, output: ModelRunnerOutput) -> list[Sequence]:
        """Apply a step's results: cache the blocks that filled up, append the prompt logprobs of its
        ``prompt_logprob_rows``, append each sampled token (and its logprobs) in place of its placeholder, and end
        the rows that failed (``FINISHED_ABORTED``, with the row's error). Sequences that finished meanwhile
        (aborted, stopped by an earlier step) are skipped.

        Returns:
            The sequences of ``plan``'s sampled rows that were unfinished, in row order (the output
            processor's input: it checks their stops).
        """
        seqs = self.seqs
        if self.config.enable_prefix_caching:
            for entry in plan.seqs:
                seq = seqs.get(entry.seq_id)
                if seq is not None:
                    self._cache_blocks(seq)
        for rows in plan.prompt_logprob_rows:
            seq = seqs.get(rows.seq_id)
            if seq is not None:
                assert len(seq.prompt_logprobs) == rows.first_position + 1, (seq, len(seq.prompt_logprobs), rows)
                seq.prompt_logprobs += output.prompt_logprobs[rows.seq_id]
        updated = []
        sampled, logprobs, errors = output.sampled_token_ids, output.logprobs, output.errors
        for seq_id in plan.sampled_seq_ids:
            seq = seqs.get(seq_id)
            if seq is None:
                continue
            seq.num_output_placeholders -= 1
            if seq_id in errors:
                seq.error = errors[seq_id]
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)
            else:
                seq.token_ids.append(sampled[seq_id])
                if seq_id in logprobs:
                    logprob, top_logprobs = logprobs[seq_id]
                    seq.logprobs.append(top_logprobs)
                    seq.cumulative_logprob += logprob
            updated.append(seq)
        return updated

    def _cache_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's full blocks of known tokens whose K/V is written (or being written by a
        planned step, which runs first in stream order) to the prefix cache."""
        bm = self.block_manager
        num_tokens = min(seq.num_computed_tokens, len(seq.token_ids))
        # only when a block filled up since the last offer (cache_full_blocks would do nothing else)
        if num_tokens // bm.block_size > bm.num_hashed_blocks.get(seq.seq_id, 0):
            bm.cache_full_blocks(seq.seq_id, extend_block_hashes(seq.block_hashes, seq.token_ids, bm.block_size), num_tokens)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (stop, length, abort or error) and free its blocks at once (a planned step still
        running on the device may write into them: stream order puts that write before any later step's use)."""
        assert status.is_finished, status
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.seq_id)
        if self.seqs.pop(seq.seq_id, None) is not None:
            self._finished_seq_ids.append(seq.seq_id)
