"""BlockManager: ref counts, fork and copy-on-write, prefix-cache hits, eviction order, and a
Hypothesis state machine over random allocate / append / fork / free / preempt / reset sequences.

The state machine simulates the K/V contents of every slot independently of the block manager: a
written slot holds the whole token prefix up to and including its token (the K/V of a token depends
on all of them). After every step it checks that each live sequence reads its own prefix back
through its block table, that no write lands in a shared or cached block, that a cached block's
contents are the tokens its hash was computed from, and the pool invariants of STYLE.md section 10.
CPU only, no model.
"""

import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from paged_transformers.core import prefix_cache
from paged_transformers.core.block_manager import BlockCopy, BlockManager
from paged_transformers.core.prefix_cache import extend_block_hashes, hash_block_tokens

BS = 4  # block_size in these tests


def hashes(tokens, block_size=BS):
    return extend_block_hashes([], tokens, block_size)


def admit(bm, seq_id, tokens, caching=True):
    """What the scheduler does for a new sequence: hits, then slots for the rest. Returns (copies, num_computed)."""
    block_hashes = hashes(tokens)
    hits = bm.find_cached_prefix(block_hashes) if caching else []
    num_computed = min(len(hits) * BS, len(tokens) - 1)
    copies = bm.allocate_slots(seq_id, num_computed, len(tokens) - num_computed, cached_blocks=hits)
    if copies is not None and caching:
        bm.cache_full_blocks(seq_id, block_hashes, len(tokens))
    return copies, num_computed


# -- hashing -------------------------------------------------------------------------------------


def test_hash_is_chained_over_the_parent():
    a, b = [5, 6, 7, 8], [9, 10, 11, 12]
    h_a = hash_block_tokens(None, a)
    assert hash_block_tokens(h_a, b) != hash_block_tokens(None, b)  # same tokens, other prefix
    assert hash_block_tokens(h_a, b) == hash_block_tokens(hash_block_tokens(None, a), b)
    assert hashes(a + b + [1, 2]) == [h_a, hash_block_tokens(h_a, b)]  # the partial block is not hashed
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])


def test_hash_is_stable_across_processes():
    """Block hashes must not depend on the process (PYTHONHASHSEED), or a cache shared between
    workers would miss."""
    # load the module file alone: importing the package would import torch and transformers (slow)
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('pc', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "print(m.hash_block_tokens(m.hash_block_tokens(None, [1, 2]), [3, 4]).hex())"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code, prefix_cache.__file__], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4]).hex()}


# -- allocation, fork, copy-on-write ----------------------------------------------------------------


def test_allocate_grows_by_blocks_and_refuses_without_change():
    bm = BlockManager(4, BS)
    assert bm.allocate_slots(0, 0, 5) == []
    assert len(bm.block_tables[0]) == 2 and bm.num_free_blocks == 2
    assert bm.allocate_slots(0, 5, 3) == []  # fills block 2 (8 tokens): no new block
    assert len(bm.block_tables[0]) == 2
    before = (dict(bm.block_tables), list(bm.ref_cnt), list(bm.free_blocks))
    assert bm.allocate_slots(1, 0, 13) is None  # needs 4 blocks, 2 free
    assert (dict(bm.block_tables), list(bm.ref_cnt), list(bm.free_blocks)) == before
    assert 1 not in bm.block_tables


def test_fork_shares_blocks_and_first_write_copies_the_partial_block():
    bm = BlockManager(8, BS)
    bm.allocate_slots(0, 0, 6)  # 6 prompt tokens: block 0 full, block 1 half
    parent = list(bm.block_tables[0])
    bm.fork(0, 1)
    bm.fork(0, 2)
    assert bm.block_tables[1] == parent and all(bm.ref_cnt[b] == 3 for b in parent)
    assert bm.num_shared_blocks == 2 and bm.num_used_blocks == 2
    copies = bm.allocate_slots(1, 6, 1)  # child 1 writes token 6 into the shared half block
    assert copies == [BlockCopy(parent[1], bm.block_tables[1][1])] and bm.block_tables[1][1] != parent[1]
    assert bm.block_tables[1][0] == parent[0] and bm.ref_cnt[parent[0]] == 3 and bm.ref_cnt[parent[1]] == 2
    assert len(bm.allocate_slots(2, 6, 1)) == 1  # child 2 copies too
    assert bm.allocate_slots(0, 6, 1) == []  # the parent is the last holder: writes in place
    assert bm.block_tables[0] == parent and bm.ref_cnt[parent[1]] == 1
    for seq_id in (0, 1, 2):
        bm.free(seq_id)
    assert bm.num_free_blocks == 8 and not any(bm.ref_cnt) and bm.num_shared_blocks == 0


def test_fork_errors_name_the_sequence():
    bm = BlockManager(4, BS)
    with pytest.raises(ValueError, match="sequence 7"):
        bm.fork(7, 8)
    bm.allocate_slots(0, 0, 1)
    bm.allocate_slots(1, 0, 1)
    with pytest.raises(ValueError, match="sequence 1"):
        bm.fork(0, 1)


# -- prefix cache ------------------------------------------------------------------------------------


def test_hits_are_the_longest_cached_run_and_survive_free():
    bm = BlockManager(8, BS)
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks + 2
    admit(bm, 0, prompt)
    first_two = bm.block_tables[0][:2]
    assert bm.num_cached_blocks == 2
    bm.free(0)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2  # freed, still cached
    copies, num_computed = admit(bm, 1, prompt[:8] + [99, 98, 97])
    assert num_computed == 8 and copies == [] and bm.block_tables[1][:2] == first_two
    copies, num_computed = admit(bm, 2, prompt[:4] + [0, 0, 0, 0])  # second block differs
    assert num_computed == 4 and bm.block_tables[2][0] == first_two[0] and bm.ref_cnt[first_two[0]] == 2
    assert admit(bm, 3, [0] + prompt[1:8])[1] == 0  # first block differs: nothing after it counts


def test_fully_cached_prompt_recomputes_its_last_token_in_a_copy():
    bm = BlockManager(8, BS)
    prompt = list(range(3, 11))  # exactly 2 blocks
    admit(bm, 0, prompt)
    cached = list(bm.block_tables[0])
    copies, num_computed = admit(bm, 1, prompt)  # parent still holds the blocks
    assert num_computed == 7
    assert copies == [BlockCopy(cached[1], bm.block_tables[1][1])]
    assert bm.block_tables[1][0] == cached[0] and bm.block_tables[1][1] != cached[1]
    assert bm.block_hash[cached[1]] is not None and bm.block_hash[bm.block_tables[1][1]] is None
    bm.free(0)
    bm.free(1)
    copies, num_computed = admit(bm, 2, prompt)  # nobody holds them now: still copy-on-write
    assert num_computed == 7 and len(copies) == 1 and bm.cached_blocks[hashes(prompt)[1]] == cached[1]


def test_eviction_takes_unhashed_blocks_first_then_least_recently_freed_tail_first():
    bm = BlockManager(6, BS)
    admit(bm, 0, list(range(10, 18)))  # A: 2 cached blocks
    admit(bm, 1, list(range(30, 38)))  # B: 2 cached blocks
    a, b = list(bm.block_tables[0]), list(bm.block_tables[1])
    bm.free(0)
    bm.free(1)
    # queue: the 2 never-used blocks, then A's tail, A's head, B's tail, B's head
    assert list(bm.free_blocks)[2:] == [a[1], a[0], b[1], b[0]]
    bm.allocate_slots(2, 0, 12)  # 3 blocks: 2 unhashed, then A's tail is evicted
    assert bm.num_evicted_blocks == 1 and bm.block_hash[a[1]] is None and bm.block_hash[a[0]] is not None
    assert admit(bm, 3, list(range(10, 18)))[1] == 4  # A's head block is still a hit


def test_reset_prefix_cache_only_when_no_block_is_held():
    bm = BlockManager(4, BS)
    admit(bm, 0, list(range(8)))
    assert bm.reset_prefix_cache() is False and bm.num_cached_blocks == 2
    bm.free(0)
    assert bm.reset_prefix_cache() is True
    assert bm.num_cached_blocks == 0 and all(h is None for h in bm.block_hash)
    assert admit(bm, 1, list(range(8)))[1] == 0


# -- property-based ----------------------------------------------------------------------------------

NUM_BLOCKS = 12
tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=11)  # a 2-letter alphabet: many shared prefixes


class BlockManagerMachine(RuleBasedStateMachine):
    """Random operations on one BlockManager against a simulated K/V store (see the module docstring)."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS)
        self.live: dict[int, list[int]] = {}  # seq_id -> its tokens, all computed
        self.contents: list[list[tuple | None]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.hash_prefix: dict[bytes, tuple] = {}  # block hash -> the token prefix ending with that block
        self.next_id = 0

    def _write(self, seq_id: int, tokens: list[int], start: int, copies: list[BlockCopy]) -> None:
        """The cache's side of a step: copies first (all read before any is written), then new slots."""
        snapshot = {c.src: list(self.contents[c.src]) for c in copies}
        for c in copies:
            self.contents[c.dst] = snapshot[c.src]
        table = self.bm.block_tables[seq_id]
        for p in range(start, len(tokens)):
            block_id = table[p // BS]
            assert self.bm.ref_cnt[block_id] == 1, f"write into block {block_id} shared {self.bm.ref_cnt[block_id]} ways"
            assert self.bm.block_hash[block_id] is None, f"write into cached block {block_id}"
            self.contents[block_id][p % BS] = tuple(tokens[: p + 1])

    def _cache(self, seq_id: int, tokens: list[int]) -> None:
        block_hashes = hashes(tokens)
        for i, h in enumerate(block_hashes):
            self.hash_prefix.setdefault(h, tuple(tokens[: (i + 1) * BS]))
        self.bm.cache_full_blocks(seq_id, block_hashes, len(tokens))

    def _admit(self, seq_id: int, tokens: list[int]) -> bool:
        block_hashes = hashes(tokens)
        hits = self.bm.find_cached_prefix(block_hashes)
        num_computed = min(len(hits) * BS, len(tokens) - 1)
        copies = self.bm.allocate_slots(seq_id, num_computed, len(tokens) - num_computed, cached_blocks=hits)
        if copies is None:
            assert seq_id not in self.bm.block_tables
            return False
        self._write(seq_id, tokens, num_computed, copies)
        self._cache(seq_id, tokens)
        self.live[seq_id] = list(tokens)
        return True

    @rule(target=seqs, tokens=tokens_st)
    def add(self, tokens):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self._admit(seq_id, tokens)
        return seq_id

    @rule(seq_id=seqs, new=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def append(self, seq_id, new):
        if seq_id not in self.live:
            return
        tokens = self.live[seq_id]
        copies = self.bm.allocate_slots(seq_id, len(tokens), len(new))
        if copies is None:
            return
        self._write(seq_id, tokens + new, len(tokens), copies)
        tokens.extend(new)
        self._cache(seq_id, tokens)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        child, self.next_id = self.next_id, self.next_id + 1
        if parent in self.live:
            self.bm.fork(parent, child)
            self.live[child] = list(self.live[parent])
        return child

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id):
        self.bm.free(seq_id)
        self.live.pop(seq_id, None)

    @rule(seq_id=seqs)
    def preempt_and_resume(self, seq_id):
        """Preemption by recompute, then resume from whatever is still cached."""
        if seq_id not in self.live:
            return
        tokens = self.live.pop(seq_id)
        self.bm.free(seq_id)
        self._admit(seq_id, tokens)

    @rule()
    def reset(self):
        emptied = self.bm.reset_prefix_cache()
        assert emptied == (not self.live)

    @precondition(lambda self: self.live)
    @rule()
    def free_all(self):
        for seq_id in list(self.live):
            self.bm.free(seq_id)
        self.live.clear()
        assert self.bm.num_free_blocks == NUM_BLOCKS and not any(self.bm.ref_cnt) and not self.bm.block_tables

    @invariant()
    def pool_accounting(self):
        bm = self.bm
        held = [b for table in bm.block_tables.values() for b in table]
        assert set(bm.block_tables) == set(self.live)
        for block_id in range(NUM_BLOCKS):
            assert bm.ref_cnt[block_id] == held.count(block_id), f"block {block_id}"
        assert not set(held) & set(bm.free_blocks), "a block is both free and held"
        assert bm.num_free_blocks + len(set(held)) == NUM_BLOCKS
        assert bm.num_shared_blocks == sum(1 for c in bm.ref_cnt if c > 1)
        for seq_id, tokens in self.live.items():
            assert len(bm.block_tables[seq_id]) == bm.blocks_for(len(tokens))

    @invariant()
    def every_sequence_reads_its_own_prefix(self):
        for seq_id, tokens in self.live.items():
            table = self.bm.block_tables[seq_id]
            for p in range(len(tokens)):
                assert self.contents[table[p // BS]][p % BS] == tuple(tokens[: p + 1]), f"seq {seq_id} position {p}"

    @invariant()
    def cached_blocks_hold_their_hashed_tokens(self):
        bm = self.bm
        assert sum(h is not None for h in bm.block_hash) == len(bm.cached_blocks)
        for h, block_id in bm.cached_blocks.items():
            assert bm.block_hash[block_id] == h
            prefix = self.hash_prefix[h]
            start = len(prefix) - BS
            assert self.contents[block_id] == [prefix[: start + r + 1] for r in range(BS)], f"block {block_id}"

    @invariant()
    def free_queue_hands_out_unhashed_blocks_first(self):
        hashed = [self.bm.block_hash[b] is not None for b in self.bm.free_blocks]
        assert hashed == sorted(hashed), "an unhashed free block waits behind a cached one"

    def teardown(self):
        for seq_id in list(self.live):
            self.bm.free(seq_id)
        assert self.bm.num_free_blocks == NUM_BLOCKS and not any(self.bm.ref_cnt)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
