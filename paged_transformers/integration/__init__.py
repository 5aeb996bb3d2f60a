"""The transformers side: what turns a transformers model, its GenerationConfig and its callers into engine
requests and back.

    generate.py           paged_generate() and run_to_completion()
    generation_config.py  the one GenerationConfig -> SamplingParams adapter (per-request logits processors)
    padding.py            left padding of a batch, read once
    warm.py               one warm engine per model, shared by every entry point
    cache.py              PagedCache, a transformers.Cache for stock generate()
    streaming.py          token streams to users
    checkpoint.py         checkpoints: local folders, hub ids from the local cache (``hub.py``)
"""
