"""Temperature, top-k, top-p, min-p and the random draw, batched over a step's sampled rows.

The distribution (vLLM's order): logits / temperature -> keep the top_k largest -> keep the smallest prefix
of those, largest first, whose probability (renormalised over the top-k) reaches top_p (the largest always
stays) -> drop tokens under min_p x the largest kept probability -> draw in proportion to the kept
probabilities.

Rows with top-k or top-p are computed on candidates, their largest logits in order (``torch.topk``), not on a
sort of the whole vocabulary (on the CPU a sort of the vocabulary costs ~24x a ``torch.topk`` of 256):

    top-k rows:      the candidates are the largest top_k: exact.
    top-p rows (no top-k), on CPU: ``top_p_candidates`` (256) candidates, the probabilities normalised over the
                     whole row; when a row's candidates hold less than top_p of the mass, the batch falls back to
                     the whole row in order (the check reads the device, so on CUDA such rows always take it).
    other rows:      the whole vocabulary, no ordering.

The draw is an exponential race: with ``E_i ~ Exp(1)`` independent, ``argmax_i p_i / E_i`` is ``i`` with
probability ``p_i / sum(p)`` (the Gumbel-max trick in another form; vLLM's sampler uses it because
``torch.multinomial`` checks its input with a host read), so kept probabilities need no renormalising. A
seeded row draws its noise from its own generator, over a length fixed by its own parameters (its top_k, else
the vocabulary), so the rest of the batch cannot change its tokens; the other rows share the global stream (a
batch of rows without top-k / top-p draws ``[rows, vocab]`` of it, as ``torch.multinomial`` does on CPU).
"""

import torch

from ..kernels.argmax import argmax_rows

TOP_P_CANDIDATES = 256  # candidates of a top-p row (no top-k) on CPU, before the fallback to the whole row


def draw(logits: torch.Tensor, params: list, generators: list, top_p_candidates: int = TOP_P_CANDIDATES):
    """Draw one token per row of ``logits [num_rows, vocab_size]`` float32 (rows not greedy).

    Args:
        params: each row's ``SamplingParams``; generators: each row's ``torch.Generator`` or None.
        top_p_candidates: candidates of a top-p row without top-k on CPU (see the module docstring).

    Returns:
        ``(token_ids [num_rows] int64, undrawable [num_rows] bool)``, both on the device; a row is undrawable
        when its probabilities are NaN (a +inf or NaN logit, or no finite one): its token id is then an index
        the NaNs put first, not a draw.
    """
    vocab = logits.shape[-1]
    temperature = [p.temperature for p in params]
    if any(t != 1.0 for t in temperature):
        logits = logits / host_to_device(temperature, torch.float32, logits.device)[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    filtered = [i for i, p in enumerate(params) if top_k[i] < vocab or p.top_p < 1.0]
    if not filtered:
        return _draw_whole(logits, params, generators)
    if len(filtered) == len(params):
        return _draw_candidates(logits, params, top_k, generators, top_p_candidates)
    token_ids = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    undrawable = torch.empty(len(params), dtype=torch.bool, device=logits.device)
    plain = sorted(set(range(len(params))) - set(filtered))
    for rows, filters in ((filtered, True), (plain, False)):
        index = host_to_device(rows, torch.int64, logits.device)
        sub_params, sub_generators = [params[i] for i in rows], [generators[i] for i in rows]
        token_ids[index], undrawable[index] = (
            _draw_candidates(logits[index], sub_params, [top_k[i] for i in rows], sub_generators, top_p_candidates)
            if filters else _draw_whole(logits[index], sub_params, sub_generators))
    return token_ids, undrawable


def _draw_whole(logits, params, generators):
    """Rows without top-k / top-p: softmax over the vocabulary, min-p, the race."""
    probs = _min_p(logits.softmax(dim=-1), params, largest=None)
    choice = _race(probs, generators, [probs.shape[-1]] * len(params))
    return choice, _picked_is_nan(probs, choice)


def _draw_candidates(logits, params, top_k: list[int], generators, top_p_candidates: int):
    """Rows with top-k or top-p: the kept probabilities of the candidates, in order, then the race."""
    vocab = logits.shape[-1]
    top_p_only = [k >= vocab for k in top_k]  # a top-p row without top-k: normalised over its whole row
    if not any(top_p_only):
        num_candidates = max(top_k)
    elif logits.device.type == "cpu":
        num_candidates = min(vocab, max([top_p_candidates] + [k for k in top_k if k < vocab]))
    else:
        num_candidates = vocab
    top_p = host_to_device([p.top_p for p in params], torch.float32, logits.device)
    probs, ids, drop = _candidates(logits, top_k, top_p_only, num_candidates)
    # a top-p row whose candidates hold less than top_p of its mass: its nucleus reaches past them (CPU: a free read)
    if num_candidates < vocab and any(top_p_only) and bool((probs.sum(dim=-1) < top_p).any()):
        probs, ids, drop = _candidates(logits, top_k, top_p_only, vocab)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False  # the largest always stays
    probs = _min_p(probs.masked_fill(drop, 0.0), params, largest=probs[:, :1])
    choice = _race(probs, generators, top_k)
    return ids.gather(1, choice[:, None]).squeeze(1), _picked_is_nan(probs, choice)


def _candidates(logits, top_k: list[int], top_p_only: list[bool], num_candidates: int):
    """The largest ``num_candidates`` logits of each row, in order -> ``(probs [rows, K] float32, token ids
    [rows, K] int64, drop [rows, K] bool)``: past its top-k a row's candidates are dropped, and the others'
    probabilities are normalised over the row's top-k (all among the candidates) or, for a top-p-only row,
    over the whole row."""
    vocab = logits.shape[-1]
    device = logits.device
    if num_candidates < vocab:
        values, ids = torch.topk(logits, num_candidates, dim=-1)
    else:
        values, ids = logits.sort(dim=-1, descending=True)
    drop = torch.arange(num_candidates, device=device) >= host_to_device(top_k, torch.int64, device)[:, None]
    kept = values.masked_fill(drop, float("-inf"))
    log_total = torch.logsumexp(kept, dim=-1)
    if any(top_p_only) and num_candidates < vocab:
        log_total = torch.where(host_to_device(top_p_only, torch.bool, device), torch.logsumexp(logits, dim=-1), log_total)
    return (kept - log_total[:, None]).exp(), ids, drop


def _min_p(probs: torch.Tensor, params: list, largest: torch.Tensor | None) -> torch.Tensor:
    """Zero the probabilities under min_p x the row's largest (``largest [rows, 1]``; None: the row max)."""
    min_p = [p.min_p for p in params]
    if not any(m > 0 for m in min_p):
        return probs
    if largest is None:
        largest = probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < host_to_device(min_p, torch.float32, probs.device)[:, None] * largest, 0.0)


def _race(probs: torch.Tensor, generators: list, lengths: list[int]) -> torch.Tensor:
    """``argmax(probs / E)`` per row of ``probs [rows, n]`` with ``E ~ Exp(1)``; the noise of a seeded row is the
    first ``n`` of ``lengths[i]`` draws of its own generator (past ``lengths[i]`` its probabilities are 0)."""
    noise = torch.empty_like(probs, dtype=torch.float32)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        noise.exponential_()
    width = probs.shape[-1]
    for i in seeded:
        own = torch.empty(lengths[i], dtype=torch.float32, device=probs.device).exponential_(generator=generators[i])
        noise[i, : min(width, lengths[i])] = own[:width]
        noise[i, lengths[i]:] = 1.0
    # an exact 0 (possible in float32) would make 0 / 0 = NaN the argmax on a zero-probability token
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return argmax(probs / noise)


def _picked_is_nan(probs: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """``[rows]`` bool: the chosen entry is NaN, so the row held a NaN, which ``argmax`` puts first (no draw)."""
    return probs.gather(1, choice[:, None]).squeeze(1).isnan()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row argmax ``[num_rows, V] -> [num_rows]`` int64, ``torch.argmax``'s indices (first maximum, NaN largest).
    On CUDA the two-stage Triton kernel ``argmax_rows``: PyTorch reduces a row in one thread block, tens of
    microseconds of a batch-1 decode step at a 128,256-entry vocabulary, where a split over many blocks is short."""
    return argmax_rows(x) if x.is_cuda else x.argmax(dim=-1)


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without a host sync: staged in pinned memory and copied
    non-blocking on CUDA (``torch.tensor(values, device=...)`` waits for the stream)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
