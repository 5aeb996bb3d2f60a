"""``GenerateRows``: the block tables of one ``generate()`` batch on a ``PagedCache``, one sequence per batch row.

Each row is a sequence of the cache's ``KVPool`` with its own block table. "Dense" positions are those of
generate()'s tensors and count left padding; stored tokens do not::

    dense position p of row b:   0 .. pad_lens[b]-1 | pad_lens[b] .. num_dense-1
                                 (padding, never     | real token p - pad_lens[b], at
                                  written, zeros)    |   slot block_table[(p-pad)//bs]*bs + (p-pad)%bs

In the first forward a row may be a copy of an earlier row of the batch, its leader (``leaders[b] != b``): it holds
the leader's blocks by reference and writes nothing in that forward unless ``unshare`` gives it blocks of its own.
After the forward it holds them as a fork: its first write into a shared block copies the block.
"""

import itertools

import torch

from ..core.block_manager import BlockCopy
from ..core.kv_pool import KVPool

# NOTE: one counter for the process, so a pool never sees a row id twice; negative, unlike the engine's Sequence ids.
_generate_seq_ids = itertools.count(-1, -1)


class GenerateRows:
    """Per-row block tables and slot index of one ``generate()`` call.

    Args:
        pool: the cache's pool (its block manager holds the tables; ``copy_blocks`` carries out the copies).
        pad_lens: left-padding positions of each row (never stored).
        leaders: row whose prompt blocks each row shares in the first forward (itself if none); a leader
            comes before the rows that copy it.
        num_layers: decoder layers (each layer's stored length is kept apart).
    """

    def __init__(self, pool: KVPool, pad_lens: list[int], leaders: list[int], num_layers: int):
        self.pool = pool
        self.seq_ids = [next(_generate_seq_ids) for _ in pad_lens]  # block-manager sequence id of each row
        self.pad_lens = pad_lens
        self.leaders = leaders
        self.layer_lens = [0] * num_layers  # dense positions each layer has stored
        self.num_dense = 0  # dense positions granted (max of layer_lens)
        self.slot_index: torch.Tensor | None = None  # [batch, num_dense] int64 slot, -1 = padding
        self.write_rows: torch.Tensor | None = None  # [batch] bool: rows that write (None: all); False = sharing

    @property
    def sharing(self) -> list[int]:
        """Rows that hold their leader's blocks by reference (first forward only)."""
        return [b for b, leader in enumerate(self.leaders) if leader != b]

    def grant(self, num_new: int) -> None:
        """Grow every row's block table by ``num_new`` dense positions and rebuild ``slot_index``. In the
        first forward a row that copies its leader's prompt takes the leader's blocks by reference.

        Raises:
            RuntimeError: the pool has no free block left.
        """
        bm = self.pool.block_manager
        old_dense = self.num_dense
        self.num_dense += num_new
        copies = []
        for b, seq_id in enumerate(self.seq_ids):
            before, after = max(0, old_dense - self.pad_lens[b]), max(0, self.num_dense - self.pad_lens[b])
            leader = self.leaders[b]
            if leader != b:
                if self.seq_ids[leader] in bm.block_tables:
                    bm.fork(self.seq_ids[leader], seq_id)  # the prompt by reference
                continue
            if after > before:
                copies.extend(self._allocate(seq_id, before, after - before))
        self.pool.copy_blocks(copies)
        self._build_slot_index()

    def unshare(self, rows: list[int]) -> None:
        """Give each of ``rows`` (sharing its leader's blocks) private blocks holding the leader's K/V, in every
        layer; from now on the row writes its own.

        Raises:
            RuntimeError: the pool has no free block left.
        """
        bm = self.pool.block_manager
        copies = []
        for b in rows:
            seq_id = self.seq_ids[b]
            shared = bm.block_tables.get(seq_id, [])
            bm.free(seq_id)
            self.leaders[b] = b
            num_tokens = self.num_dense - self.pad_lens[b]
            if num_tokens > 0:
                self._allocate(seq_id, 0, num_tokens)
                copies.extend(BlockCopy(src, dst) for src, dst in zip(shared, bm.block_tables[seq_id]))
        self.pool.copy_blocks(copies)
        self._build_slot_index()

    def end_forward(self) -> None:
        """The first forward is over: rows still sharing keep their leader's blocks, as forks."""
        self.leaders = list(range(len(self.seq_ids)))
        self.write_rows = None

    def select(self, indices: list[int]) -> None:
        """New row ``i`` continues old row ``indices[i]``: block tables are shared by reference (ref counts
        up), the old tables released. A later write into a shared block copies it first."""
        bm = self.pool.block_manager
        new_ids = [next(_generate_seq_ids) for _ in indices]
        for new_id, old in zip(new_ids, indices):
            if self.seq_ids[old] in bm.block_tables:
                bm.fork(self.seq_ids[old], new_id)
        self.free()
        self.seq_ids = new_ids
        self.pad_lens = [self.pad_lens[i] for i in indices]
        self.leaders = list(range(len(indices)))
        self._build_slot_index()

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` dense positions (``0 <= max_length < num_dense``); blocks past the kept
        tokens are released."""
        bm = self.pool.block_manager
        for b, seq_id in enumerate(self.seq_ids):
            if seq_id in bm.block_tables:
                bm.truncate(seq_id, bm.blocks_for(max(0, max_length - self.pad_lens[b])))
        self.num_dense = max_length
        self.layer_lens = [min(n, max_length) for n in self.layer_lens]
        self._build_slot_index()

    def free(self) -> None:
        """Release every row's blocks."""
        for seq_id in self.seq_ids:
            self.pool.block_manager.free(seq_id)

    def _allocate(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int) -> list[BlockCopy]:
        """``block_manager.allocate_slots``, raising when the pool is exhausted."""
        bm = self.pool.block_manager
        granted = bm.allocate_slots(seq_id, num_computed_tokens, num_new_tokens)
        if granted is None:
            raise RuntimeError(
                f"PagedCache pool exhausted: {bm.num_blocks} blocks of {bm.block_size} tokens, "
                f"{bm.num_free_blocks} free; build it with more num_blocks"
            )
        return granted

    def _build_slot_index(self) -> None:
        """Rebuild ``slot_index`` from the block tables, and ``write_rows`` from the leaders."""
        bm, device = self.pool.block_manager, self.pool.device
        writes = [leader == b for b, leader in enumerate(self.leaders)]
        self.write_rows = None if all(writes) else torch.tensor(writes, device=device)
        tables = [bm.block_tables.get(seq_id, []) for seq_id in self.seq_ids]
        width = max(1, max(len(t) for t in tables))
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)
        pad = torch.tensor(self.pad_lens, dtype=torch.int64, device=device)
        real = torch.arange(self.num_dense, device=device)[None, :] - pad[:, None]  # [B, num_dense]
        block = block_tables.gather(1, real.clamp(min=0) // bm.block_size)
        slots = block * bm.block_size + real.clamp(min=0) % bm.block_size
        self.slot_index = torch.where(real >= 0, slots, -1)
