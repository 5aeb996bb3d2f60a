"""The engine core: a step plans, runs and updates, one way (``docs/architecture.md`` has the diagram).

    engine.py            LLMEngine: add / abort / step / stats, and ``run_engine``, the driver loop
    engine_inputs.py     prompt and SamplingParams checks at the boundary
    engine_lifecycle.py  attach / detach / sleep / wake_up / close, the model handed back between calls
    scheduler.py         the step plan (``messages.SchedulerOutput``) and the update from ``ModelRunnerOutput``
    block_manager.py     KV blocks: allocation, copy-on-write sharing, the O(1) free queue
    prefix_cache.py      full blocks keyed by their tokens (and everything before them), LRU eviction
    sequence.py          a request's sequences (n > 1 fanned out at add_request)
    messages.py          the messages between scheduler, runner and engine
    input_batch.py       the runner's persistent batch, updated by the plans' diffs
    runner.py            one packed step through the unmodified model
    attention.py         the attention function registered with transformers
    sampling_batch.py    the sampler's per-sequence state, updated from the plans; a step's SamplingMetadata
    sampling.py, draw.py the sampler (batched, on the device) and its random draw
    output_processor.py  stop conditions (fixed at add_request) and their checks, incremental detokenization,
                         RequestOutputs
    sizing.py            the KV pool's size from the device's memory
    weights.py           weights snapshots between calls (live weights, stale-weight errors)
    cpu_linear.py        oneDNN projections for eager fp32 steps on CPU
"""
