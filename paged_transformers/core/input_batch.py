"""The runner's persistent batch: the running sequences' block tables and the step's input buffers.

Step overhead is what decides throughput once the kernels are fast, so every step's metadata lives in
buffers allocated once (vLLM's persistent input buffers and ``InputBatch``; nano-vllm's
``prepare_decode``)::

    host (pinned, numpy views)  --one non_blocking copy per field-->  device buffers (max sizes)

Each running sequence owns a row of a host block-table array, kept up to date from the plans' diffs (a
``ScheduledSeq``'s new block ids, a whole table for a sequence new to the batch, rows freed for finished
and preempted sequences), so a step gathers its tables with one numpy index instead of rebuilding them.
The buffers are built with numpy over whole arrays, not Python loops over tokens.
"""

import itertools

import numpy as np
import torch

from .messages import SchedulerOutput


class InputBatch:
    """Host staging and device buffers of the maximum step sizes, and the block table of every sequence in
    the batch.

    Args:
        max_num_tokens: tokens of the largest step (and of the largest decode graph bucket).
        max_num_seqs: sequences in the batch at once (block-table rows).
        max_num_blocks_per_seq: block-table width (``ceil(max_model_len / block_size)``).
        block_size: tokens per KV block.
        device: where the device buffers live (pinned host staging on CUDA).
    """

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_num_blocks_per_seq: int, block_size: int,
                 device: torch.device):
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.max_num_blocks_per_seq, self.block_size, self.device = max_num_blocks_per_seq, block_size, device
        pin = device.type == "cuda"
        T, S, W = max_num_tokens, max_num_seqs, max_num_blocks_per_seq

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, host.numpy(), torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids_h, self.input_ids_np, self.input_ids = pair((T,), torch.int64)
        self.positions_h, self.positions_np, self.positions = pair((T,), torch.int64)
        self.slot_mapping_h, self.slot_mapping_np, self.slot_mapping = pair((T,), torch.int64)
        self.seq_lens_h, self.seq_lens_np, self.seq_lens = pair((S,), torch.int32)
        self.query_start_loc_h, self.query_start_loc_np, self.query_start_loc = pair((S + 1,), torch.int32)
        self.logits_indices_h, self.logits_indices_np, self.logits_indices = pair((T,), torch.int64)
        # block tables: host staging is compact [num_seqs, width] for the step's width; device is full width
        self.block_tables_h, self.block_tables_np, _ = pair((S * W,), torch.int32)
        self.block_tables = torch.zeros((S, W), dtype=torch.int32, device=device)
        # the persistent state: row -> its sequence's block table (entries past table_lens[row] are stale)
        self.tables = np.zeros((S, W), dtype=np.int32)
        self.table_lens = np.zeros(S, dtype=np.int64)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self._free_rows = list(range(S - 1, -1, -1))
        self._applied_step_id = 0  # the last plan whose diffs were applied
        self.fork_rows: list[int] | None = None  # the step's logits rows gathered for its forks (``prepare``)
        self.staged: torch.cuda.Event | None = None  # recorded after prepare's host-to-device copies

    def device_buffers(self) -> dict[str, torch.Tensor]:
        """The device tensors a forward reads, by name: the first rows of each are the prepared step's."""
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "logits_indices", "block_tables")
        return {name: getattr(self, name) for name in names}

    # -- the persistent block tables --------------------------------------------------------------
    def update(self, plan: SchedulerOutput) -> None:
        """Apply ``plan``'s diffs to the block tables, once per plan (plans come in ``step_id`` order)."""
        if plan.step_id == self._applied_step_id:
            return
        assert plan.step_id > self._applied_step_id, (plan.step_id, self._applied_step_id)
        for seq_id in plan.finished_seq_ids + plan.preempted_seq_ids:
            row = self.row_of.pop(seq_id, None)
            if row is not None:
                self._free_rows.append(row)
        for entry in plan.seqs:
            self._set(entry.seq_id, entry.new_block_ids, entry.replace_table)
        for fork in plan.forked:
            self._set(fork.seq_id, fork.block_ids, True)
        self._applied_step_id = plan.step_id

    def _set(self, seq_id: int, block_ids: tuple[int, ...], replace: bool) -> None:
        """Append ``block_ids`` to the sequence's table, or make them its table (``replace``; a new row)."""
        row = self.row_of.get(seq_id)
        if row is None:
            assert replace, f"sequence {seq_id} is new to the batch but its plan entry has only new blocks"
            row = self.row_of[seq_id] = self._free_rows.pop()
        start = 0 if replace else int(self.table_lens[row])
        end = start + len(block_ids)
        assert end <= self.max_num_blocks_per_seq, (seq_id, end, self.max_num_blocks_per_seq)
        self.tables[row, start:end] = block_ids
        self.table_lens[row] = end

    # -- one step's buffers -----------------------------------------------------------------------
    def prepare(self, plan: SchedulerOutput, pad_to: int | None = None) -> tuple[int, int, int, int]:
        """Fill the device buffers for ``plan`` (applying its diffs first); with ``pad_to`` (a decode step),
        pad it to that many rows (token 0 at position 0, ``slot_mapping`` -1, ``seq_len`` 1). Token ids the
        plan does not know (a step planned ahead) are staged as 0: the caller copies the real ones in.
        ``logits_indices`` gets the sampled rows, then the ``plan.num_prompt_logprob_rows`` prompt-logprob rows.

        Returns:
            ``(num_tokens, num_sampled, max_query_len, max_seq_len)`` of the (padded) step.
        """
        self.update(plan)
        # NOTE(async scheduling): the previous step's non-blocking copies read the pinned staging buffers
        # until they have run; with a step still in flight, wait for them before writing the buffers again.
        if self.staged is not None:
            self.staged.synchronize()
            self.staged = None
        entries = plan.seqs
        S = len(entries)
        counts = np.fromiter([e.num_scheduled_tokens for e in entries], dtype=np.int64, count=S)
        starts = np.fromiter([e.num_computed_tokens for e in entries], dtype=np.int64, count=S)
        T = int(counts.sum())
        assert T <= self.max_num_tokens and S <= self.max_num_seqs, (T, S, self.max_num_tokens, self.max_num_seqs)
        seq_lens = starts + counts
        qsl = self.query_start_loc_np
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1 : S + 1])
        token_ids = list(itertools.chain.from_iterable(e.token_ids for e in entries))
        assert len(token_ids) in (T, 0) and (token_ids or T == S), "only a decode step's token ids may be unknown"
        self.input_ids_np[:T] = token_ids or 0
        # position of row r = r - (first row of its sequence) + (its sequence's num_computed_tokens)
        positions = starts if T == S else np.arange(T, dtype=np.int64) + np.repeat(starts - qsl[:S], counts)
        self.positions_np[:T] = positions

        width = self._stage_block_tables(entries)
        bt = self.block_tables_np[: S * width].reshape(S, width)
        block_size = self.block_size
        seq_index = np.repeat(np.arange(S), counts) if T != S else np.arange(S)
        self.slot_mapping_np[:T] = bt[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size
        self.seq_lens_np[:S] = seq_lens

        sampled = np.fromiter([e.samples for e in entries], dtype=bool, count=S)
        num_sampled = int(sampled.sum())
        self.logits_indices_np[:num_sampled] = (qsl[1 : S + 1] - 1)[sampled]
        num_prompt_rows = self._stage_prompt_logprob_rows(plan, num_sampled) if plan.prompt_logprob_rows else 0
        self.fork_rows = self._fork_rows(plan, num_sampled, num_prompt_rows) if plan.forked else None
        rows, seqs_n = T, S
        if pad_to is not None and pad_to > S:
            assert T == S and num_sampled == S, "only decode steps are padded"
            self._pad(S, pad_to)
            rows = seqs_n = num_sampled = pad_to
        self._copy_to_device(rows, seqs_n, num_sampled + num_prompt_rows, S, width)
        return rows, num_sampled, int(counts.max()), int(seq_lens.max())

    def _stage_prompt_logprob_rows(self, plan: SchedulerOutput, num_sampled: int) -> int:
        """Stage the rows of ``plan.prompt_logprob_rows`` in ``logits_indices`` after the ``num_sampled`` sampled
        rows (row of position p = the sequence's first row + p - its ``num_computed_tokens``); returns their number."""
        first_rows = self.query_start_loc_np[: len(plan.seqs)].tolist()
        offset = {e.seq_id: q - e.num_computed_tokens for e, q in zip(plan.seqs, first_rows)}
        rows = np.concatenate([np.arange(len(r.token_ids)) + offset[r.seq_id] + r.first_position
                               for r in plan.prompt_logprob_rows])  # fmt: skip
        self.logits_indices_np[num_sampled : num_sampled + len(rows)] = rows
        return len(rows)

    def _stage_block_tables(self, entries) -> int:
        """Gather the step's block tables, in batch order, into the compact staging ``[S, width]``; returns width."""
        S = len(entries)
        row_of = self.row_of
        rows = np.fromiter([row_of[e.seq_id] for e in entries], dtype=np.int64, count=S)
        width = int(self.table_lens[rows].max())
        self.block_tables_np[: S * width].reshape(S, width)[:] = self.tables[rows, :width]
        return width

    @staticmethod
    def _fork_rows(plan: SchedulerOutput, num_sampled: int, num_prompt_rows: int) -> list[int]:
        """The logits rows of the step, forks included: the sampled rows, then each fork's parent's row, then the
        prompt-logprob rows."""
        row_of = {e.seq_id: i for i, e in enumerate(e for e in plan.seqs if e.samples)}
        return (list(range(num_sampled)) + [row_of[fork.parent_seq_id] for fork in plan.forked]
                + list(range(num_sampled, num_sampled + num_prompt_rows)))

    def _pad(self, S: int, pad_to: int) -> None:
        """Rows ``S .. pad_to - 1`` of a padded decode step: token 0 at position 0 that writes nothing
        (``slot_mapping`` -1) and attends to one slot (``seq_len`` 1), its logits kept."""
        self.input_ids_np[S:pad_to] = 0
        self.positions_np[S:pad_to] = 0
        self.slot_mapping_np[S:pad_to] = -1
        self.seq_lens_np[S:pad_to] = 1
        self.query_start_loc_np[S + 1 : pad_to + 1] = np.arange(S + 1, pad_to + 1)
        self.logits_indices_np[S:pad_to] = np.arange(S, pad_to)

    def _copy_to_device(self, rows: int, seqs_n: int, num_logits: int, S: int, width: int) -> None:
        """One non-blocking host-to-device copy per field; on CUDA an event marks when the staging is free again."""
        for host, dev, n in ((self.input_ids_h, self.input_ids, rows), (self.positions_h, self.positions, rows),
                             (self.slot_mapping_h, self.slot_mapping, rows),
                             (self.logits_indices_h, self.logits_indices, num_logits),
                             (self.seq_lens_h, self.seq_lens, seqs_n), (self.query_start_loc_h, self.query_start_loc, seqs_n + 1)):
            dev[:n].copy_(host[:n], non_blocking=True)
        self.block_tables[:S, :width].copy_(self.block_tables_h[: S * width].view(S, width), non_blocking=True)
        if self.device.type == "cuda":
            self.staged = torch.cuda.Event()
            self.staged.record()
