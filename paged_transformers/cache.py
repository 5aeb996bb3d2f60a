"""``PagedCache``: the per-layer KV block pools and the block manager that hands their blocks out."""

import torch
from transformers import Cache

from .block_manager import BlockCopy, BlockManager


class PagedCache(Cache):
    """The paged KV cache of one model: K and V tensors allocated once, plus per-sequence block tables.

    Per layer (vLLM's flash layout; ``slot = block_id * block_size + offset``)::

        key_cache[layer], value_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]

    The block tables live in ``block_manager`` (``block_manager.block_tables[seq_id]``). A request
    holds ``ceil(num_tokens / block_size)`` blocks; nothing is reserved up to ``max_model_len``.
    It subclasses ``transformers.Cache`` so it can stand where transformers expects a cache.

    Args:
        num_layers: decoder layers (one K and one V tensor each).
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        num_kv_heads, head_dim: the model's KV shape.
        dtype, device: of the cache tensors (the model's compute dtype and device).

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
        super().__init__(layers=[])
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.block_manager = BlockManager(num_blocks, block_size)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V."""
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
        device = self.key_cache[0].device
        src = torch.tensor([c.src for c in copies], dtype=torch.int64, device=device)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.int64, device=device)
        for k, v in zip(self.key_cache, self.value_cache):
            k[dst] = k[src]
            v[dst] = v[src]
