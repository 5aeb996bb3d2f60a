"""Turns a ``SchedulerOutput`` into one ragged, unpadded batch and runs the unmodified model forward."""

import torch

from .attention import ATTENTION_NAME, AttentionMetadata
from .cache import PagedCache
from .scheduler import SchedulerOutput


class ModelRunner:
    """Runs the transformers model on one packed step and returns the logits of the sampled rows.

    The step's sequences are concatenated into a single row (no padding)::

        input_ids    [1, num_tokens]   the scheduled tokens of seq 0, then seq 1, ...
        position_ids [1, num_tokens]   each token's position in its own sequence (RoPE per token)
        slot_mapping [num_tokens]      where each token's K/V is written
        logits_indices [num_sampled]   the last row of each sequence that is sampled this step

    The model's LM head runs only on ``logits_indices`` (``logits_to_keep``).

    Args:
        model: a transformers causal LM whose ``attn_implementation`` is ``ATTENTION_NAME``.
        cache: the paged cache the attention reads and writes.
        write_kv, attend: the attention backend's functions (``attention.resolve_backend``).
    """

    def __init__(self, model: torch.nn.Module, cache: PagedCache, write_kv, attend):
        assert model.config._attn_implementation == ATTENTION_NAME, model.config._attn_implementation
        self.model = model
        self.cache = cache
        self.write_kv = write_kv
        self.attend = attend
        self.device = cache.key_cache[0].device

    def prepare(self, out: SchedulerOutput) -> tuple[dict, torch.Tensor]:
        """Build the forward's keyword arguments and the ``logits_indices [num_sampled]`` int64 tensor."""
        block_size = self.cache.block_size
        tables = self.cache.block_manager.block_tables
        input_ids, positions, seq_index, seq_lens, starts, logits_indices = [], [], [], [], [0], []
        for i, (seq, num_new) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + num_new])
            positions.extend(range(start, start + num_new))
            seq_index.extend([i] * num_new)
            seq_lens.append(start + num_new)
            starts.append(starts[-1] + num_new)
            if out.samples(i):
                logits_indices.append(starts[-1] - 1)
        max_blocks = max(len(tables[seq.seq_id]) for seq in out.seqs)
        block_tables = [tables[seq.seq_id] + [0] * (max_blocks - len(tables[seq.seq_id])) for seq in out.seqs]

        def tensor(data, dtype):
            return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

        block_tables_t = tensor(block_tables, torch.int32)
        positions_t = tensor(positions, torch.int64)
        seq_index_t = tensor(seq_index, torch.int64)
        # slot of token t = block_tables[seq, pos // block_size] * block_size + pos % block_size
        slot_mapping = block_tables_t[seq_index_t, positions_t // block_size].long() * block_size + positions_t % block_size
        metadata = AttentionMetadata(
            cache=self.cache,
            slot_mapping=slot_mapping,
            block_tables=block_tables_t,
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=tensor(starts, torch.int32),
            max_query_len=max(out.num_scheduled_tokens),
            max_seq_len=max(seq_lens),
            write_kv=self.write_kv,
            attend=self.attend,
        )
        kwargs = dict(
            input_ids=tensor([input_ids], torch.int64),
            position_ids=positions_t.unsqueeze(0),
            use_cache=False,
            paged_metadata=metadata,
        )
        return kwargs, tensor(logits_indices, torch.int64)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step. Returns float32 logits ``[num_sampled, vocab_size]``, rows in ``out.seqs`` order."""
        self.cache.copy_blocks(out.block_copies)
        kwargs, logits_indices = self.prepare(out)
        logits = self.model(**kwargs, logits_to_keep=logits_indices).logits
        return logits[0].float()
