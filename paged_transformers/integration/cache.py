"""``PagedCache``: a ``transformers.Cache`` whose K/V live in blocks of a ``KVPool``, for stock ``generate()``.

``model.generate(..., past_key_values=cache)`` (``cache=`` on transformers >= 5.24) keeps one block table per
batch row, writes each step's K/V into blocks, and hands the model's own attention (eager / SDPA) a dense
``[batch, num_kv_heads, kv_length, head_dim]`` view gathered through the block tables. Left-padding tokens are
never written (their rows in the view are zeros, and the attention mask hides them); ``num_return_sequences``
copies of a prompt share its blocks by reference; beam search reorders block tables with reference counts
(``reorder_cache``) instead of copying K/V; a write into a shared block copies it first.

The engine does not use this class: it owns a ``kv_pool.KVPool`` directly.
"""

import torch
from transformers import Cache

from ..core.block_manager import BlockManager
from ..core.kv_pool import KVPool
from .generate_rows import GenerateRows

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size (bytes) -> int dtype


class PagedCache(Cache):
    """The paged KV cache of one ``generate()`` batch: a ``KVPool`` plus one block table per batch row.

    It subclasses ``transformers.Cache`` so it can stand where transformers expects a cache; the K/V tensors and
    the block manager are the pool's (``pool.key_cache``, ``block_manager``).

    Args and errors: those of the ``KVPool`` it builds (layers, blocks, tokens per block, KV heads, head_dim, dtype,
    device); ``from_model`` reads them from a model.
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
        self.pool = KVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        self.num_layers = num_layers
        # generate() state: the rows of the generation in progress, and the prompt padding for the next one
        self._rows: GenerateRows | None = None
        self._pad_hint: list[int] | None = None

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> "PagedCache":
        """A cache shaped for ``model`` (layers, KV heads, head_dim from its config).

        Args:
            model: a transformers causal LM.
            num_blocks: blocks in the pool; ``generate()`` needs about
                ``batch * num_beams_or_sequences * ceil(max_length / block_size)`` of them (fewer when
                prompts are left-padded or shared).
            block_size: tokens per block.
            dtype, device: default: the model's floating-point dtype and its device.

        Examples:
            >>> import torch
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> from paged_transformers import PagedCache
            >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
            <...>
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
            >>> ids = torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]]); mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
            >>> cache = PagedCache.from_model(model, num_blocks=16, block_size=4)
            >>> cache.set_prompt_padding(mask)
            >>> paged = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
            >>> stock = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
            >>> bool((paged == stock).all())
            True
        """
        from ..core.sizing import model_compute_dtype, model_kv_shape

        num_layers, num_kv_heads, head_dim = model_kv_shape(model.config)
        dtype = dtype or model_compute_dtype(model)
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device or next(model.parameters()).device)

    @property
    def block_manager(self) -> BlockManager:
        """The pool's ``BlockManager``: the rows' block tables (``block_tables[seq_id]``), ref counts, free blocks."""
        return self.pool.block_manager

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    # -- generate() path: transformers' generate() and the model's attention layers call these --------------
    # (the rows' block tables and their "dense" positions: generate_rows.py)

    def set_prompt_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Tell the cache which prompt positions are left padding, so they are never written.

        Call it before ``generate()`` with the same ``attention_mask`` (the patched ``generate`` does it
        for you). Without it every position is stored, which is still correct (the mask hides padding).
        When ``generate()`` expands the batch (``num_return_sequences``, ``num_beams``), each row's
        padding is repeated for its copies.

        Args:
            attention_mask: ``[batch, prompt_len]`` of 0/1 with the zeros on the left; None = no padding.

        Raises:
            ValueError: a mask that is not 2-D or has a 0 after a 1 in some row (right padding), or
                the cache already holds a generation (call ``reset()`` first).
        """
        if self._rows is not None:
            raise ValueError("this PagedCache already holds a generation; call reset() before reusing it")
        if attention_mask is None:
            self._pad_hint = None
            return
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be [batch, prompt_len], got shape {tuple(attention_mask.shape)}")
        mask = attention_mask.to("cpu", torch.int64)
        pad_lens = (mask.cumsum(dim=-1) == 0).sum(dim=-1)  # leading zeros per row
        real = mask.sum(dim=-1)
        bad = (pad_lens + real != mask.shape[1]).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"PagedCache needs left padding; attention_mask rows {bad[:5]} have a 0 after a 1")
        self._pad_hint = pad_lens.tolist()

    def reset(self) -> None:
        """Free every block a ``generate()`` call holds, so the cache can serve a new batch. Without it, the
        next ``generate()`` call continues from the cached tokens, as with a ``DynamicCache`` passed again."""
        if self._rows is not None:
            self._rows.free()
        self._rows = None
        self._pad_hint = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store one layer's new K/V for every row and return the layer's whole K/V (``generate()`` path).

        Args:
            key_states, value_states: ``[batch, num_kv_heads, num_new_tokens, head_dim]``, the new
                dense positions ``num_dense .. num_dense + num_new_tokens - 1`` of every row.
            layer_idx: the decoder layer.

        Returns:
            ``(keys, values)``, each ``[batch, num_kv_heads, num_dense + num_new_tokens, head_dim]`` in the
            cache dtype; rows of padding positions are zeros.

        Raises:
            RuntimeError: the pool has no free block left (names the sizes).
            ValueError: a batch size that does not fit the padding given to ``set_prompt_padding``, or
                another batch size than the generation the cache holds (``reset()`` it first).
        """
        batch, num_kv_heads, num_new, head_dim = key_states.shape
        if self._rows is None:
            self._rows = self._start(batch)
        rows = self._rows
        if batch != len(rows.seq_ids):
            # NOTE: no automatic reset: a cache passed to generate() again continues its generation (as a
            # DynamicCache does: the new call's input is the previous output plus new tokens), so a new
            # batch on a used cache is a mistake to report, not a cue to drop the cached K/V.
            raise ValueError(
                f"this PagedCache holds a generation of {len(rows.seq_ids)} rows, but got a batch of {batch}: "
                "call cache.reset() before using it for another batch"
            )
        start = rows.layer_lens[layer_idx]
        if start == rows.num_dense:  # the first layer to see these positions grants their slots
            rows.grant(num_new)
        assert start + num_new == rows.num_dense, (layer_idx, start, num_new, rows.num_dense)
        rows.layer_lens[layer_idx] = rows.num_dense
        if rows.sharing:
            self._unshare_unequal_copies(key_states, value_states)
        slots = rows.slot_index  # [batch, num_dense] int64, -1 = padding
        new_slots = slots[:, start:].reshape(-1)
        write = new_slots >= 0
        if rows.write_rows is not None:  # prompt copies that share their leader's blocks do not write
            write &= rows.write_rows.repeat_interleave(num_new)
        k_pool = self.pool.key_cache[layer_idx].view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        v_pool = self.pool.value_cache[layer_idx].view(-1, num_kv_heads, head_dim)
        # [B, Hkv, T, D] -> [B*T, Hkv, D]
        k_new = key_states.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
        v_new = value_states.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
        k_pool[new_slots[write]] = k_new[write].to(k_pool.dtype)
        v_pool[new_slots[write]] = v_new[write].to(v_pool.dtype)
        valid = (slots >= 0)[:, :, None, None]
        gather = slots.clamp(min=0)
        # [B, L] slots -> [B, L, Hkv, D] -> [B, Hkv, L, D]
        # NOTE: where, not a multiply: never-written slots may hold NaN from torch.empty.
        keys = torch.where(valid, k_pool[gather], 0.0).transpose(1, 2)
        values = torch.where(valid, v_pool[gather], 0.0).transpose(1, 2)
        if layer_idx == self.num_layers - 1:
            rows.end_forward()
        return keys, values

    def _start(self, batch: int) -> GenerateRows:
        """Open one sequence per row at the first ``update``.

        generate() expands a batch of ``len(pad_hint)`` prompts to ``batch`` rows with ``repeat_interleave``
        (``num_return_sequences``, ``num_beams``), so each group of ``batch // len(pad_hint)`` rows holds copies
        of one prompt: every row of a group starts as a copy of the group's first row, its leader, and shares
        the leader's prompt blocks for as long as its K/V equal the leader's (``_unshare_unequal_copies``).
        """
        hint = self._pad_hint or [0] * batch
        if batch % len(hint):
            raise ValueError(f"generate() batch of {batch} rows does not fit the padding of {len(hint)} rows given to set_prompt_padding")
        group = batch // len(hint)
        pad_lens = [p for p in hint for _ in range(group)]
        return GenerateRows(self.pool, pad_lens, [b - b % group for b in range(batch)], self.num_layers)

    def _unshare_unequal_copies(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Give private blocks to each prompt copy whose K or V in this layer differ from its leader's.

        A copy shares the leader's blocks only while its K/V are equal bit for bit in every layer seen so far,
        so its attention reads exactly what it would have written itself. A copy that differs gets its own
        blocks, filled with the leader's K/V (equal in the earlier layers), and writes from this layer on.
        """
        rows = self._rows
        copies = rows.sharing
        rows_of = torch.tensor(copies, device=key_states.device)
        leaders_of = torch.tensor([rows.leaders[b] for b in copies], device=key_states.device)
        equal = torch.ones(len(copies), dtype=torch.bool, device=key_states.device)
        for states in (key_states, value_states):
            bits = states.view(_BITS[states.element_size()])  # [B, Hkv, T, D]: compared bit for bit (NaN, -0.0)
            equal &= (bits[rows_of] == bits[leaders_of]).flatten(1).all(dim=1)
        unequal = [b for b, same in zip(copies, equal.tolist()) if not same]
        if unequal:
            rows.unshare(unequal)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues row ``beam_idx[i]`` (block tables remapped, no K/V copied)."""
        if self._rows is not None:
            self._rows.select([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (in that order)."""
        if self._rows is not None:
            self._rows.select([int(i) for i in indices.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times (by reference)."""
        if self._rows is not None:
            self._rows.select([b for b in range(len(self._rows.seq_ids)) for _ in range(repeats)])

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` dense positions (negative: drop ``-max_length`` from the end);
        blocks past the kept tokens are released."""
        if self._rows is None:
            return
        num_dense = self._rows.num_dense
        if max_length < 0:
            max_length = num_dense + max_length
        if max_length < num_dense:
            self._rows.crop(max(0, max_length))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Dense positions (left padding included) the layer has seen; what ``generate()`` calls past length."""
        return 0 if self._rows is None else self._rows.layer_lens[layer_idx]

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the attention mask: all past positions plus the query, offset 0."""
        if isinstance(query_length, torch.Tensor):  # some versions pass cache_position [query_length]
            query_length = query_length.shape[0]
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows block by block; no fixed maximum

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def batch_size(self) -> int:
        return -1 if self._rows is None else len(self._rows.seq_ids)

    def __repr__(self) -> str:
        return (
            f"PagedCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_used_blocks={self.block_manager.num_used_blocks})"
        )

