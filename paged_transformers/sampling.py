"""The sampler: per-request penalties and logits processors, then greedy or random sampling.

Order (vLLM's): raw logits -> logprobs (if asked) -> penalties -> logits processors -> min_tokens
mask -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> sample.
"""

from dataclasses import dataclass

import torch

from .sequence import Sequence


@dataclass(slots=True)
class SampleResult:
    """What the sampler produced for one sequence: a token, or the error that failed it."""

    token_id: int | None
    logprob: float | None = None  # of the sampled token, from the raw logits
    top_logprobs: dict[int, float] | None = None  # token id -> logprob, sampled token included
    error: BaseException | None = None


@dataclass(slots=True)
class SamplerOutput:
    """One step's samples, batched: rows in the order of the sequences given to ``Sampler.sample_tokens``."""

    token_ids: list[int | None]  # the sampled token of each row; None for a failed row
    errors: dict[int, BaseException]  # row -> the exception that failed it
    logprobs: dict[int, tuple[float, dict[int, float]]]  # row -> (logprob of the token, {token_id: logprob})


class Sampler:
    """Samples one token per sequence from a batch of logits.

    Args:
        eos_token_ids: ids masked until ``min_tokens`` outputs exist (with ``stop_token_ids``).
        vocab_size: logits columns past it (padding in some checkpoints) are never sampled.
    """

    def __init__(self, eos_token_ids: set[int], vocab_size: int):
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        """Sample for ``seqs`` from ``logits [len(seqs), vocab_size]`` float32 (rows in ``seqs`` order).

        A logits processor that raises, returns anything but a tensor of its input's shape
        ``[1, vocab_size]``, or leaves its row no finite logit, fails only its own row: that row's result
        carries the exception. ``sample_tokens`` returns the same, batched (what the engine uses).
        """
        out = self.sample_tokens(logits, seqs)
        results = []
        for i, token_id in enumerate(out.token_ids):
            if i in out.errors:
                results.append(SampleResult(None, error=out.errors[i]))
            elif i in out.logprobs:
                logprob, top_logprobs = out.logprobs[i]
                results.append(SampleResult(token_id, logprob, top_logprobs))
            else:
                results.append(SampleResult(token_id))
        return results

    def sample_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> "SamplerOutput":
        """``sample`` without a result object per row: one token list for the batch (``SamplerOutput``).

        NOTE: this runs once per step for every running sequence, and on a GPU everything after the
        ``tolist()`` (the one sync of the step) leaves the device idle, so the per-row Python work is
        kept to list comprehensions over attributes; rows are only touched when they need it.
        """
        logits = logits[:, : self.vocab_size]
        params = [seq.sampling_params for seq in seqs]
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        errors: dict[int, BaseException] = {}
        # NOTE: only rows with penalties, processors or an active min_tokens mask are touched (the rows that
        # _process_row can change): a per-row copy costs a kernel launch, which at a few hundred rows per
        # step is milliseconds of host time.
        rows = [i for i, (seq, p) in enumerate(zip(seqs, params)) if (
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.logits_processors
            or len(seq.token_ids) - seq.num_prompt_tokens < p.min_tokens)]
        if rows:
            logits = logits.clone()
        for i in rows:
            try:
                logits[i] = self._process_row(logits[i], seqs[i])
            except Exception as e:  # a user's processor; keep the other rows going
                errors[i] = e
        if rows:
            # A processed row with a NaN or no finite logit cannot be sampled: it fails alone (and is
            # zeroed so that the batch's draw stays valid).
            processed = logits[torch.tensor(rows, device=logits.device)]
            unusable = (processed.isnan().any(dim=-1) | ~processed.isfinite().any(dim=-1)).tolist()
            for i, bad in zip(rows, unusable):
                if bad and i not in errors:
                    errors[i] = ValueError(
                        f"logits processors left request {seqs[i].request_id!r} no finite logit (all -inf or NaN)"
                    )
            for i in errors:
                logits[i] = 0.0

        # decided on the host: no device round trip when all greedy; only the sampled rows are drawn
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        token_ids = logits.argmax(dim=-1)
        if sample_rows:
            index = torch.tensor(sample_rows, device=logits.device)
            probs = self._probs(logits[index], [params[i] for i in sample_rows])
            token_ids[index] = self._draw(probs, [seqs[i] for i in sample_rows])

        token_list = token_ids.tolist()
        for i in errors:
            token_list[i] = None
        logprobs = {}
        for i in want_logprobs:
            if i in errors:
                continue
            tok = token_list[i]
            row = raw_logprobs[i]
            logprob = float(row[tok])
            k = params[i].logprobs
            top = torch.topk(row, k) if k else None
            top_logprobs = {tok: logprob}
            if top is not None:
                top_logprobs.update(zip(top.indices.tolist(), top.values.tolist()))
            logprobs[i] = (logprob, top_logprobs)
        return SamplerOutput(token_list, errors, logprobs)

    def _process_row(self, row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """Penalties, processors and the min_tokens mask on one row ``[vocab_size]``."""
        sp = seq.sampling_params
        if sp.repetition_penalty != 1.0:
            # CTRL / transformers: over prompt + output, divide positive logits, multiply negative ones.
            ids = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64, device=row.device)
            picked = row[ids]
            row[ids] = torch.where(picked > 0, picked / sp.repetition_penalty, picked * sp.repetition_penalty)
        if sp.presence_penalty or sp.frequency_penalty:
            counts = torch.bincount(
                torch.tensor(seq.output_token_ids, dtype=torch.int64, device=row.device), minlength=row.numel()
            )[: row.numel()].to(row.dtype)
            row = row - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).to(row.dtype)
        if sp.logits_processors:
            input_ids = torch.tensor([seq.token_ids], dtype=torch.int64, device=row.device)
            scores = row.unsqueeze(0)
            for proc in sp.logits_processors:
                scores = proc(input_ids, scores)
                _check_scores(scores, row.numel(), proc)
            row = scores[0]
        if seq.num_output_tokens < sp.min_tokens:
            banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_token_ids)
            banned_ids = [t for t in banned if t < row.numel()]
            if banned_ids:
                row = row.index_fill(0, torch.tensor(banned_ids, dtype=torch.int64, device=row.device), float("-inf"))
        return row

    @staticmethod
    def _probs(logits: torch.Tensor, params: list) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p over ``logits [num_seqs, vocab_size]`` -> probabilities."""
        device = logits.device
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
        logits = logits / temperature[:, None]
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device).clamp(max=vocab)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=device)[None, :]
            drop = ranks >= top_k[:, None]
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= top_p[:, None]
            drop[:, 0] = False
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    @staticmethod
    def _draw(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One draw per row; seeded sequences use their own generator so the batch cannot change them."""
        out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
        unseeded = [i for i, seq in enumerate(seqs) if seq.generator is None]
        if unseeded:
            out[unseeded] = torch.multinomial(probs[unseeded], 1).squeeze(1)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                out[i] = torch.multinomial(probs[i], 1, generator=seq.generator)[0]
        return out


def _check_scores(scores, vocab_size: int, proc) -> None:
    """A processor's return value must be a tensor ``[1, vocab_size]``, as it was given: a 1-D ``[vocab_size]``
    row would otherwise broadcast into the logits row silently (token 0 every step).

    Raises:
        ValueError: naming the processor and what it returned.
    """
    if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (1, vocab_size):
        got = f"shape {list(scores.shape)}" if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"logits processor {proc!r} must return scores of shape [1, {vocab_size}] (as given), got {got}")

