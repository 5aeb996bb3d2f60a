"""``model.generate(..., past_key_values=PagedCache)`` against the same call with the default DynamicCache
(tiny Llama / Qwen2 / Mistral, fp32 CPU): left-padded batches of unequal prompts, greedy, seeded
sampling, beams=3, num_return_sequences=4; block accounting (padding never stored, prompt copies
shared by reference, beams remapped with reference counts, every block back after reset)."""

import inspect

import pytest
import torch

from paged_transformers import PagedCache

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32, 33, 34]]
MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=20, temperature=0.8),
    "beams3": dict(do_sample=False, num_beams=3),
    "nrs4": dict(do_sample=True, num_return_sequences=4),
}


def left_pad(prompts, pad_id=0):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def cache_kwarg(model) -> str:
    """``cache`` on transformers >= 5.24, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def generate_both(model, mode, max_new_tokens=8, block_size=4):
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=0, **MODES[mode])
    cache = PagedCache.from_model(model, num_blocks=256, block_size=block_size)
    cache.set_prompt_padding(mask)
    torch.manual_seed(123)
    paged = model.generate(ids, **{cache_kwarg(model): cache}, return_dict_in_generate=True, **kwargs)
    torch.manual_seed(123)
    stock = model.generate(ids, return_dict_in_generate=True, **kwargs)
    return paged, stock, cache


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("mode", list(MODES))
def test_paged_cache_matches_dynamic_cache(tiny_model, arch, mode):
    model = tiny_model(arch)
    paged, stock, cache = generate_both(model, mode)
    assert torch.equal(paged.sequences, stock.sequences), f"{arch} {mode}:\n{paged.sequences}\n{stock.sequences}"
    bm = cache.block_manager
    # each block's ref_cnt equals the number of block tables holding it
    held = [b for table in bm.block_tables.values() for b in table]
    assert all(bm.ref_cnt[b] == held.count(b) for b in set(held))
    assert bm.num_used_blocks == len(set(held))
    cache.reset()
    assert bm.num_free_blocks == bm.num_blocks and not bm.block_tables


def test_padding_never_stored_and_prompt_copies_shared(tiny_model):
    model = tiny_model("llama")
    ids, mask = left_pad(PROMPTS)
    block_size = 4
    cache = PagedCache.from_model(model, num_blocks=256, block_size=block_size)
    cache.set_prompt_padding(mask)
    model.generate(ids, attention_mask=mask, **{cache_kwarg(model): cache}, max_new_tokens=1, do_sample=True,
                   num_return_sequences=4, pad_token_id=0)
    rows = cache._rows
    bm = cache.block_manager
    # after prefill + 1 token: each row holds ceil((len(prompt) + 1 stored tokens - 1 pending) / bs) blocks;
    # the K/V of the last sampled token is not computed yet, so tables cover the prompt only
    for r, seq_id in enumerate(rows.seq_ids):
        assert len(bm.block_tables[seq_id]) == bm.blocks_for(len(PROMPTS[r // 4]))
    # full prompt blocks are shared by the 4 copies, not duplicated: prompt 1 (10 tokens) has 2 full blocks
    tables = [bm.block_tables[s] for s in rows.seq_ids[4:8]]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2] == tables[3][:2]
    assert all(bm.ref_cnt[b] == 4 for b in tables[0][:2])
    unshared = sum(4 * bm.blocks_for(len(p)) for p in PROMPTS)
    assert bm.num_used_blocks < unshared


def test_reorder_cache_remaps_without_copy(tiny_model):
    model = tiny_model("llama")
    cache = PagedCache.from_model(model, num_blocks=64, block_size=4)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    model(ids.repeat(3, 1), **{cache_kwarg(model): cache}, use_cache=True)
    bm = cache.block_manager
    before = [list(bm.block_tables[s]) for s in cache._rows.seq_ids]
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    after = [bm.block_tables[s] for s in cache._rows.seq_ids]
    assert after == [before[2], before[2], before[0]]
    assert all(bm.ref_cnt[b] == 2 for b in before[2]) and bm.num_used_blocks == len(before[0]) + len(before[2])
    cache.crop(3)
    assert cache.get_seq_length() == 3 and all(len(bm.block_tables[s]) == 1 for s in cache._rows.seq_ids)


def test_set_prompt_padding_rejects_right_padding(tiny_model):
    cache = PagedCache.from_model(tiny_model("llama"), num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="left padding"):
        cache.set_prompt_padding(torch.tensor([[1, 1, 0]]))


def test_pool_exhaustion_raises(tiny_model):
    model = tiny_model("llama")
    cache = PagedCache.from_model(model, num_blocks=2, block_size=4)
    with pytest.raises(RuntimeError, match="pool exhausted"):
        model.generate(torch.tensor([[5, 6, 7, 8, 9, 10]]), **{cache_kwarg(model): cache}, max_new_tokens=8, do_sample=False)


def test_smollm2_paged_cache(smollm2, monkeypatch):
    model, tokenizer = smollm2
    monkeypatch.setattr(tokenizer, "padding_side", "left")
    batch = tokenizer(["The capital of France is", "One, two, three,"], return_tensors="pt", padding=True)
    for mode in ("greedy", "beams3"):
        cache = PagedCache.from_model(model, num_blocks=128, block_size=16)
        cache.set_prompt_padding(batch.attention_mask)
        kwargs = dict(**batch, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id, **MODES[mode])
        paged = model.generate(**kwargs, **{cache_kwarg(model): cache})
        stock = model.generate(**kwargs)
        assert torch.equal(paged, stock), mode



def test_reused_for_another_batch_says_reset(tiny_model):
    """A used cache given a batch of another size used to fail inside the update with
    ``IndexError: The shape of the mask [16] ... does not match``; now a ValueError says to call reset()."""
    model = tiny_model("llama")
    ids, mask = left_pad(PROMPTS[:2])
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    cache = PagedCache.from_model(model, num_blocks=64, block_size=4)
    model.generate(ids, attention_mask=mask, **{cache_kwarg(model): cache}, **kwargs)
    other, other_mask = left_pad([p * 3 for p in PROMPTS])  # 4 rows, longer than the cached 2 x 14 positions
    with pytest.raises(ValueError, match=r"holds a generation of 2 rows.*batch of 4.*reset\(\)"):
        model.generate(other, attention_mask=other_mask, **{cache_kwarg(model): cache}, **kwargs)
    cache.reset()
    cache.set_prompt_padding(other_mask)
    paged = model.generate(other, attention_mask=other_mask, **{cache_kwarg(model): cache}, **kwargs)
    assert torch.equal(paged, model.generate(other, attention_mask=other_mask, **kwargs))


def test_passed_again_continues_like_dynamic_cache(tiny_model):
    """Why a second generate() call does not reset the cache: stock continues from a cache passed again (its
    input is the previous output plus new tokens), and so does a PagedCache."""
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids, mask = left_pad(PROMPTS[:2])
    kwargs = dict(do_sample=False, pad_token_id=0, max_new_tokens=4)
    outs = []
    for cache in (PagedCache.from_model(model, num_blocks=64, block_size=4), DynamicCache(config=model.config)):
        first = model.generate(ids, attention_mask=mask, **{cache_kwarg(model): cache}, **kwargs)
        first_mask = torch.cat([mask, torch.ones_like(first[:, ids.shape[1]:])], 1)
        outs.append(model.generate(first, attention_mask=first_mask, **{cache_kwarg(model): cache}, **kwargs))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], model.generate(ids, attention_mask=mask, **{**kwargs, "max_new_tokens": 8}))


def test_copies_share_only_while_their_kv_is_equal(tiny_model):
    """Rows of one ``num_return_sequences`` group share the prompt's blocks only while their K/V are equal in
    every layer. Here layer 1's K depends on the row's place in the batch (as when a kernel's rounding depends
    on it): layer-0 K of the copies are equal, layer 1's are not. The old rule (equal layer-0 K: share, and the
    copies' own K/V are never written) made the second copy attend to the first's layer-1 K."""
    model = tiny_model("llama")
    ids, mask = left_pad(PROMPTS[:2])
    noise = torch.randn(64, model.config.num_key_value_heads * model.config.head_dim,
                        generator=torch.Generator().manual_seed(3))

    def by_row(module, args, out):  # [batch, tokens, kv_dim]: row b gets b * noise at each position
        rows = torch.arange(out.shape[0], dtype=out.dtype)[:, None, None]
        return out + 0.5 * rows * noise[: out.shape[1]]

    handle = model.model.layers[1].self_attn.k_proj.register_forward_hook(by_row)
    try:
        kwargs = dict(attention_mask=mask, max_new_tokens=3, pad_token_id=0, do_sample=True, num_return_sequences=2,
                      return_dict_in_generate=True, output_logits=True)
        cache = PagedCache.from_model(model, num_blocks=64, block_size=4)
        cache.set_prompt_padding(mask)
        torch.manual_seed(0)
        paged = model.generate(ids, **{cache_kwarg(model): cache}, **kwargs)
        torch.manual_seed(0)
        stock = model.generate(ids, **kwargs)
    finally:
        handle.remove()
    for step, (ours, theirs) in enumerate(zip(paged.logits, stock.logits)):
        torch.testing.assert_close(ours, theirs, msg=lambda m: f"step {step}: {m}")
    assert torch.equal(paged.sequences, stock.sequences)
    bm = cache.block_manager
    assert all(bm.ref_cnt[b] == 1 for t in bm.block_tables.values() for b in t), "unequal copies share a block"
