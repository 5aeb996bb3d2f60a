"""``KVPool``: the engine's KV cache, per-layer K/V tensors in blocks and the block manager that hands the blocks out.

The engine (``LLMEngine``) owns the block tables through ``block_manager``, the runner writes and reads K/V through
the attention backend, and ``copy_blocks`` carries out the copy-on-write copies the block manager asks for.
``cache.PagedCache``, the ``transformers.Cache`` for stock ``generate()``, keeps its block tables in a pool of its own.
"""

import torch

from .block_manager import BlockCopy, BlockManager


class KVPool:
    """K and V tensors of every layer, allocated once, and the ``BlockManager`` of their blocks.

    Per layer (vLLM's flash layout; ``slot = block_id * block_size + offset``)::

        key_cache[layer], value_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]

    The block tables live in ``block_manager`` (``block_manager.block_tables[seq_id]``). A sequence holds
    ``ceil(num_tokens / block_size)`` blocks; nothing is reserved up to ``max_model_len``.

    Args:
        num_layers: decoder layers (one K and one V tensor each).
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        num_kv_heads, head_dim: the model's KV shape.
        dtype, device: of the K/V tensors (the model's compute dtype and device).

    Raises:
        ValueError: a size that is not positive.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.block_manager = BlockManager(num_blocks, block_size)
        self.num_layers = num_layers
        self._shape, self._dtype = (num_blocks, block_size, num_kv_heads, head_dim), dtype
        self.device = torch.empty(0, device=device).device  # resolved ("cuda" -> "cuda:0"); kept after release()
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []
        self.allocate()

    def allocate(self) -> None:
        """(Re)allocate the K/V tensors, uninitialized, in the shape, dtype and device the pool was made with
        (at construction, and ``LLMEngine.wake_up`` after ``release``)."""
        self.key_cache = [torch.empty(self._shape, dtype=self._dtype, device=self.device) for _ in range(self.num_layers)]
        self.value_cache = [torch.empty(self._shape, dtype=self._dtype, device=self.device) for _ in range(self.num_layers)]

    def release(self) -> None:
        """Drop the K/V tensors (``LLMEngine.close`` and ``sleep``): their memory can go back to the device. The
        block manager, with its counters, stays; the pool holds no K/V until ``allocate``."""
        self.key_cache, self.value_cache = [], []

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V (what the engine divides its KV budget by)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy whole blocks (copy-on-write) in every layer: ``dst <- src`` for each pair."""
        if not copies:
            return
        src = torch.tensor([c.src for c in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.int64, device=self.device)
        for k, v in zip(self.key_cache, self.value_cache):
            k[dst] = k[src]
            v[dst] = v[src]

    def __repr__(self) -> str:
        return (
            f"KVPool(num_layers={self.num_layers}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_used_blocks={self.block_manager.num_used_blocks})"
        )
