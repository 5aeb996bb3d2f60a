"""Block hashing for prefix caching, and the cache's counters.

A full block is keyed by a hash chained over its parent block's hash and its own token ids, so a
key names the block's tokens *and everything before them* (the K/V of a token depends on its whole
prefix)::

    tokens   | t0 .. t15 | t16 .. t31 | t32 .. t40 (partial: never hashed)
    hash     |    h0     |     h1     |
    h0 = H(b"", t0..t15)    h1 = H(h0, t16..t31)

Two prompts share cached blocks exactly as far as their block-aligned prefixes agree. Only full
blocks are hashed: a partially filled block is still being written. Design after vLLM's
``hash_block_tokens`` (``vllm/v1/core/kv_cache_utils.py``) and SGLang's RadixAttention (Zheng et al.,
"SGLang: Efficient Execution of Structured Language Model Programs", 2024).
"""

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes  # 16-byte blake2b digest of (parent hash, block token ids)

_ROOT = b""  # the parent "hash" of a sequence's first block


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash.

    NOTE(prefix-cache): blake2b over the parent digest and the ids packed as int64, not Python's
    ``hash()``. ``hash()`` of a tuple of ints is stable across processes (ints are not salted), but
    it is a 64-bit non-cryptographic hash with a public, easily inverted construction: two prompts
    with equal hashes (crafted or by chance) would silently share K/V and produce wrong tokens.
    blake2b-128 costs about a microsecond per 16-token block, negligible next to a forward. The
    encoding is unambiguous: the parent digest is empty (first block) or 16 bytes, and each id is 8.

    Args:
        parent_hash: the previous block's hash, or None for a sequence's first block.
        token_ids: the block's ``block_size`` token ids (ints in ``[0, 2**63)``).

    Returns:
        The block's 16-byte hash.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(_ROOT if parent_hash is None else parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Append to ``block_hashes`` the hashes of the full blocks of ``token_ids`` it lacks.

    Tokens are append-only, so a sequence keeps its list and this call hashes only blocks that
    filled up since the last one (``len(token_ids) // block_size`` hashes in all).

    Args:
        block_hashes: the hashes of the first ``len(block_hashes)`` blocks; extended in place.
        token_ids: the sequence's tokens (prompt + output).
        block_size: tokens per block.

    Returns:
        ``block_hashes`` (the same list).

    Examples:
        >>> from paged_transformers.core.prefix_cache import extend_block_hashes, hash_block_tokens
        >>> hashes = extend_block_hashes([], list(range(40)), block_size=16)
        >>> len(hashes)  # tokens 32..39 fill only part of a third block: not hashed
        2
        >>> hashes[1] == hash_block_tokens(hashes[0], list(range(16, 32)))
        True
        >>> len(extend_block_hashes(hashes, list(range(48)), block_size=16))  # the third block is full now
        3
    """
    for i in range(len(block_hashes), len(token_ids) // block_size):
        parent = block_hashes[i - 1] if i else None
        block_hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return block_hashes


@dataclass(slots=True)
class CacheStats:
    """Counters of the KV pool and the prefix cache since the engine started (``LLMEngine.stats()``).

    Attributes:
        num_requests: sequences that looked the prefix cache up on their first admission.
        num_prompt_tokens: prompt tokens of those sequences.
        num_cached_tokens: of those, tokens served from the cache (not computed).
        num_blocks: blocks in the pool.
        num_used_blocks / peak_num_used_blocks: blocks held by at least one sequence, now / at peak.
        num_shared_blocks / peak_num_shared_blocks: blocks held by two or more sequences (n > 1 forks,
            or requests sharing a cached prefix), now / at peak.
        num_cached_blocks: blocks that carry a hash (held or free-but-reusable).
        num_evicted_blocks: cached blocks whose hash was dropped to reuse the block.
        num_preemptions: sequences preempted (by recompute).
    """

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_blocks: int = 0
    num_used_blocks: int = 0
    peak_num_used_blocks: int = 0
    num_shared_blocks: int = 0
    peak_num_shared_blocks: int = 0
    num_cached_blocks: int = 0
    num_evicted_blocks: int = 0
    num_preemptions: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens looked up (0.0 before any request)."""
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
