"""The KV block pool: free queue, reference counts, block tables, fork, copy-on-write, prefix cache.

A sequence's tokens live in fixed-size blocks; its block table maps token position to slot::

    position p  ->  block_table[p // block_size] * block_size + p % block_size   (its slot)

    block_table [7, 2, 9]  (block_size 4, 10 tokens)
    tokens  0-3 -> block 7 | 4-7 -> block 2 | 8-9 -> block 9 (2 of 4 rows used)

A sequence holds ``ceil(num_computed_tokens / block_size)`` blocks after its step, never more.
Blocks can be shared: each block keeps a ``ref_cnt`` equal to the number of block tables that hold
it (``fork`` for n > 1 sampling; prefix-cache hits), and a write into a shared or cached block
first copies it to a private one (copy-on-write, ``BlockCopy``).

Prefix caching: a full, computed block gets a ``block_hash`` (``prefix_cache.hash_block_tokens``)
and an entry in ``cached_blocks`` (hash -> block id). A freed block keeps both and waits in the free
queue; a later request whose prefix hashes match takes it back instead of recomputing it. A block
loses its hash only when the pool hands it out again (eviction). Free queue order, front first::

    [ unhashed free blocks | cached free blocks, least recently freed first ]
      ^ handed out first                                     most recent ^

A sequence's blocks are released tail first, so its last blocks (the least shareable) are evicted
before its first. Designed after vLLM's ``BlockPool``/``KVCacheManager``/``FreeKVCacheBlockQueue``
(Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP 2023).
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from .prefix_cache import BlockHash


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One copy-on-write: the cache must copy block ``src`` into block ``dst`` before the step writes."""

    src: int
    dst: int


class BlockManager:
    """Owns the pool of ``num_blocks`` KV blocks, every sequence's block table and the prefix cache.

    The block manager is mechanism only: it never hashes tokens itself. The scheduler decides
    whether prefix caching is on and passes each sequence's block hashes
    (``prefix_cache.extend_block_hashes``) to ``find_cached_prefix`` and ``cache_full_blocks``;
    without those calls no block ever gets a hash and the pool is a plain ref-counted free list.

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
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached_blocks: dict[BlockHash, int] = {}  # block_hash -> the one block cached under it
        # NOTE(prefix-cache): an OrderedDict used as an ordered set, not a deque: a cache hit takes a
        # block out of the middle of the queue, which is O(1) here and O(n) in a deque.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}  # seq_id -> block ids, in position order
        # seq_id -> leading blocks of its table already offered to the cache (read-only outside; the scheduler
        # reads it to skip cache_full_blocks when no block filled up)
        self.num_hashed_blocks: dict[int, int] = {}
        self.num_shared_blocks = 0  # blocks with ref_cnt > 1
        self.peak_num_shared_blocks = 0
        self.num_evicted_blocks = 0

    # -- counts ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks held by no sequence (cached ones included: they can be evicted)."""
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a hash, held or free."""
        return len(self.cached_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # -- reference counting ----------------------------------------------------------------------
    def _incref(self, block_id: int) -> None:
        """One more table holds the block; a free (cached) block leaves the free queue."""
        if self.ref_cnt[block_id] == 0:
            del self.free_blocks[block_id]
        elif self.ref_cnt[block_id] == 1:
            self.num_shared_blocks += 1
            self.peak_num_shared_blocks = max(self.peak_num_shared_blocks, self.num_shared_blocks)
        self.ref_cnt[block_id] += 1

    def _decref(self, block_id: int) -> None:
        """One table fewer holds the block; at zero it joins the free queue (see the module docstring)."""
        assert self.ref_cnt[block_id] > 0, f"releasing block {block_id} with ref_cnt {self.ref_cnt[block_id]}"
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id] == 1:
            self.num_shared_blocks -= 1
        elif self.ref_cnt[block_id] == 0:
            self.free_blocks[block_id] = None  # back of the queue: evicted last
            if self.block_hash[block_id] is None:
                self.free_blocks.move_to_end(block_id, last=False)  # nothing to keep: hand it out first

    def _take(self) -> int:
        """A fresh private block from the front of the free queue, evicting its hash if it has one."""
        block_id, _ = self.free_blocks.popitem(last=False)
        assert self.ref_cnt[block_id] == 0, f"free block {block_id} has ref_cnt {self.ref_cnt[block_id]}"
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            assert self.cached_blocks[block_hash] == block_id, f"hash of block {block_id} maps elsewhere"
            del self.cached_blocks[block_hash]
            self.block_hash[block_id] = None
            self.num_evicted_blocks += 1
        self.ref_cnt[block_id] = 1
        return block_id

    # -- prefix cache ----------------------------------------------------------------------------
    def find_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The longest run of cached blocks matching a sequence's leading full blocks.

        Args:
            block_hashes: the sequence's full-block hashes, in order (``extend_block_hashes``).

        Returns:
            Block ids of the hits (possibly empty), to pass to ``allocate_slots`` as ``cached_blocks``.
            Nothing is reserved until then.
        """
        hits = []
        for block_hash in block_hashes:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq_id: int, block_hashes: Sequence[BlockHash], num_computed_tokens: int) -> None:
        """Offer the sequence's full, computed blocks to the prefix cache (call after each step).

        A block whose hash is already cached under another block stays unhashed: identical blocks
        are not merged, because a block table is never rewritten behind a running sequence (vLLM
        makes the same choice, see ``BlockHashToBlockMap``).

        Args:
            seq_id: a sequence holding blocks.
            block_hashes: its full-block hashes; at least ``num_computed_tokens // block_size`` of them.
            num_computed_tokens: tokens of the sequence whose K/V is written.
        """
        table = self.block_tables[seq_id]
        start, end = self.num_hashed_blocks.get(seq_id, 0), num_computed_tokens // self.block_size
        assert end <= len(block_hashes) and end <= len(table), (
            f"seq {seq_id}: {end} full blocks but {len(block_hashes)} hashes and {len(table)} blocks"
        )
        for i in range(start, end):
            block_id, block_hash = table[i], block_hashes[i]
            if self.block_hash[block_id] is not None:
                assert self.block_hash[block_id] == block_hash, f"block {block_id} of seq {seq_id} holds other tokens"
            elif block_hash not in self.cached_blocks:
                self.block_hash[block_id] = block_hash
                self.cached_blocks[block_hash] = block_id
        self.num_hashed_blocks[seq_id] = max(start, end)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash (e.g. after the weights changed), so no later request reuses old K/V.

        Only allowed while no block is held: a running sequence's K/V would be as stale as the
        cache's, so the caller must drain or abort requests first.

        Returns:
            True if the cache was emptied; False (nothing changed) while any sequence holds blocks.
        """
        if self.num_used_blocks:
            return False
        self.cached_blocks.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(
        self,
        seq_id: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: Sequence[int] = (),
    ) -> list[BlockCopy] | None:
        """Make room to write tokens ``num_computed_tokens .. num_computed_tokens + num_new_tokens - 1``.

        Layout of the sequence's table after the call::

            | cached_blocks (hits) | blocks held before | new blocks |
            |<---- num_computed_tokens ---->|<-- num_new_tokens -->|
                                     ^ blocks the new tokens land in must be private

        Grows the table to ``ceil((num_computed_tokens + num_new_tokens) / block_size)`` blocks. A
        block the new tokens land in that is shared (``ref_cnt > 1``) or cached (has a hash) is
        replaced by a private copy (copy-on-write): the first write after a fork, or the recomputed
        last token of a prompt found entirely in the cache.

        Args:
            seq_id: the sequence.
            num_computed_tokens: its tokens already in the cache (including hits).
            num_new_tokens: tokens the step computes.
            cached_blocks: prefix-cache hits (``find_cached_prefix``) for a sequence that holds no
                blocks yet; they become its first blocks.

        Returns:
            The copies the cache must make before writing (empty when nothing is shared), or None when
            the pool has too few free blocks; then nothing changed.
        """
        # NOTE: called for every running sequence at every step, so this is written for the decode case
        # (one token into a block the sequence already owns): locals, no generator expressions.
        table = self.block_tables.get(seq_id)
        new_table = not table
        if new_table:
            table = list(cached_blocks)
        else:
            assert not cached_blocks, f"seq {seq_id} already holds blocks; hits are for new sequences"
        assert len(table) * self.block_size >= num_computed_tokens, (
            f"seq {seq_id}: {num_computed_tokens} computed tokens but {len(table)} blocks"
        )
        num_new_blocks, to_copy = self._slots_needed(table, num_computed_tokens, num_new_tokens)
        if not num_new_blocks and not to_copy and not new_table:
            return []  # the tokens land in private blocks the sequence holds: nothing to do
        num_free_hits = sum(1 for b in cached_blocks if self.ref_cnt[b] == 0) if cached_blocks else 0
        if num_new_blocks + len(to_copy) > len(self.free_blocks) - num_free_hits:
            return None
        for block_id in cached_blocks:
            self._incref(block_id)
        copies = []
        for i in to_copy:
            src = table[i]
            table[i] = self._take()
            self._decref(src)
            copies.append(BlockCopy(src, table[i]))
        if num_new_blocks:
            table.extend(self._take() for _ in range(num_new_blocks))
        self.block_tables[seq_id] = table
        return copies

    def _slots_needed(self, table: list[int], num_computed_tokens: int, num_new_tokens: int) -> tuple[int, list[int]]:
        """``(new blocks, indices of table entries to copy)`` for writing the tokens (``allocate_slots``'s rule):
        blocks past the table, and the shared or cached blocks the new tokens land in."""
        block_size = self.block_size
        needed = -(-(num_computed_tokens + num_new_tokens) // block_size)
        ref_cnt, block_hash = self.ref_cnt, self.block_hash
        to_copy = []
        for i in range(num_computed_tokens // block_size, min(needed, len(table))):
            block_id = table[i]
            if ref_cnt[block_id] > 1 or block_hash[block_id] is not None:
                to_copy.append(i)
        return max(0, needed - len(table)), to_copy

    def num_blocks_needed(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Free blocks ``allocate_slots(seq_id, num_computed_tokens, num_new_tokens)`` would take (new blocks and
        copy-on-write copies), without taking them: with at most ``num_free_blocks`` in all, every call succeeds."""
        num_new_blocks, to_copy = self._slots_needed(self.block_tables.get(seq_id, []), num_computed_tokens, num_new_tokens)
        return num_new_blocks + len(to_copy)

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
            self._incref(block_id)
        self.block_tables[child_seq_id] = list(table)
        self.num_hashed_blocks[child_seq_id] = self.num_hashed_blocks.get(parent_seq_id, 0)

    def truncate(self, seq_id: int, num_blocks: int) -> None:
        """Keep the first ``num_blocks`` blocks of the sequence's table and release the rest, tail first
        (``PagedCache.crop``)."""
        table = self.block_tables[seq_id]
        for block_id in reversed(table[num_blocks:]):
            self._decref(block_id)
        del table[num_blocks:]
        if seq_id in self.num_hashed_blocks:
            self.num_hashed_blocks[seq_id] = min(self.num_hashed_blocks[seq_id], num_blocks)

    def free(self, seq_id: int) -> None:
        """Drop the sequence's block table, tail first; blocks no one else holds join the free queue."""
        self.num_hashed_blocks.pop(seq_id, None)
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            self._decref(block_id)

    def slot(self, seq_id: int, position: int) -> int:
        """The cache slot (``block_id * block_size + offset``) of token ``position`` of the sequence."""
        return self.block_tables[seq_id][position // self.block_size] * self.block_size + position % self.block_size
