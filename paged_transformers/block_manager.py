"""The KV block pool: free list, reference counts, per-sequence block tables, fork and copy-on-write.

A sequence's tokens live in fixed-size blocks; its block table maps token position to slot::

    position p  ->  block_table[p // block_size] * block_size + p % block_size   (its slot)

    block_table [7, 2, 9]  (block_size 4, 10 tokens)
    tokens  0-3 -> block 7 | 4-7 -> block 2 | 8-9 -> block 9 (2 of 4 rows used)

A sequence holds ``ceil(num_tokens / block_size)`` blocks, never more. Blocks can be shared
(``fork``): each block keeps a ``ref_cnt`` equal to the number of block tables that hold it, and
a write into a shared block first copies it to a private one (copy-on-write). Designed after vLLM's
``BlockPool``/``KVCacheManager`` (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023).
"""

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One copy-on-write: the cache must copy block ``src`` into block ``dst`` before the step writes."""

    src: int
    dst: int


class BlockManager:
    """Owns the pool of ``num_blocks`` KV blocks and every sequence's block table.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` not positive.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks=} {block_size=}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt = [0] * num_blocks
        # NOTE: FIFO of free block ids; a freed block goes to the back so recently used blocks are
        # reused last (this is the eviction order prefix caching builds on).
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}  # seq_id -> block ids, in position order

    @property
    def num_free_blocks(self) -> int:
        """Blocks held by no sequence."""
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        block_id = self.free_blocks.popleft()
        assert self.ref_cnt[block_id] == 0, f"free block {block_id} has ref_cnt {self.ref_cnt[block_id]}"
        self.ref_cnt[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        assert self.ref_cnt[block_id] > 0, f"releasing block {block_id} with ref_cnt {self.ref_cnt[block_id]}"
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id] == 0:
            self.free_blocks.append(block_id)

    def allocate_slots(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int) -> list[BlockCopy] | None:
        """Make room to write tokens ``num_computed_tokens .. num_computed_tokens + num_new_tokens - 1``.

        Grows the block table to ``ceil((num_computed_tokens + num_new_tokens) / block_size)`` blocks and
        gives the sequence private copies of any shared block those tokens land in.

        Returns:
            The copies the cache must make before writing (empty when nothing is shared), or None when
            the pool has too few free blocks; then nothing changed.
        """
        table = self.block_tables.setdefault(seq_id, [])
        end = num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, self.blocks_for(end) - len(table))
        first, last = num_computed_tokens // self.block_size, min(self.blocks_for(end), len(table))
        shared = [i for i in range(first, last) if self.ref_cnt[table[i]] > 1]
        if num_new_blocks + len(shared) > len(self.free_blocks):
            if not table:
                del self.block_tables[seq_id]
            return None
        copies = []
        for i in shared:
            src = table[i]
            table[i] = self._take()
            self._release(src)
            copies.append(BlockCopy(src, table[i]))
        table.extend(self._take() for _ in range(num_new_blocks))
        return copies

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Give ``child_seq_id`` the parent's blocks by reference (no copy; ref counts go up).

        Raises:
            ValueError: the parent has no blocks or the child already has some.
        """
        if parent_seq_id not in self.block_tables:
            raise ValueError(f"cannot fork sequence {parent_seq_id}: it holds no blocks")
        if child_seq_id in self.block_tables:
            raise ValueError(f"cannot fork into sequence {child_seq_id}: it already holds blocks")
        table = self.block_tables[parent_seq_id]
        for block_id in table:
            self.ref_cnt[block_id] += 1
        self.block_tables[child_seq_id] = list(table)

    def free(self, seq_id: int) -> None:
        """Drop the sequence's block table; blocks no other sequence holds return to the free list."""
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            self._release(block_id)

    def slot(self, seq_id: int, position: int) -> int:
        """The cache slot (``block_id * block_size + offset``) of token ``position`` of the sequence."""
        return self.block_tables[seq_id][position // self.block_size] * self.block_size + position % self.block_size
