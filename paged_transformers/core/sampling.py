"""The sampler: per-request penalties and logits processors, then greedy or random sampling.

Prompt logprobs (``SamplingParams.prompt_logprobs``) come from the raw logits of the prompt rows a step kept
(``launch_prompt_logprobs`` / ``collect_prompt_logprobs``).

Order (vLLM's): raw logits -> logprobs (if asked) -> penalties -> logits processors -> min_tokens
mask -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> sample (``draw.py``).
``Sampler.launch`` enqueues a step's sampling on the device and ``Sampler.collect`` reads it back, so
that the engine can launch the next step in between (async scheduling). Only penalties and logits
processors touch rows one at a time; everything else is batched over the step's rows.
"""

from dataclasses import dataclass

import torch

from .draw import TOP_P_CANDIDATES, argmax, draw, host_to_device
from .messages import PromptLogprobRows
from .sampling_batch import SamplingMetadata


@dataclass(slots=True)
class SamplerOutput:
    """One step's samples, batched: rows in the order of the step's ``SamplingMetadata``."""

    token_ids: list[int | None]  # the sampled token of each row; None for a failed row
    errors: dict[int, BaseException]  # row -> the exception that failed it
    logprobs: dict[int, tuple[float, dict[int, float]]]  # row -> (logprob of the token, {token_id: logprob})


@dataclass(slots=True)
class SampleLaunch:
    """A step's sampling enqueued on the device (``Sampler.launch``); ``Sampler.collect`` reads it back.

    ``host`` holds CPU tensors being filled by non-blocking copies (pinned memory on CUDA) until ``event``
    has passed: ``[token_ids]``, then, when rows want logprobs, ``token_logprobs [num_want]`` and, when
    one of them wants a top-k, ``top_ids, top_values [num_want, max_k]``.
    """

    token_ids: torch.Tensor  # [num_rows] int64 on the device: the next step's input ids can come from here
    host: list[torch.Tensor]
    event: "torch.cuda.Event | None"  # recorded after the copies; None on CPU (the copies are done)
    errors: dict[int, BaseException]  # row -> the exception that failed it (host-processed rows only)
    want_logprobs: list[int]  # rows that asked for logprobs, ascending
    ks: list[int]  # their SamplingParams.logprobs (top-k sizes), in the same order

    def tokens_of(self, row_seq_ids: list[int], entries) -> torch.Tensor:
        """The sampled token ids of ``entries``' sequences (plan entries, each sequence one of ``row_seq_ids``, the
        sequences of the rows in order), ``[len(entries)]`` int64 on the device, without reading them: the input ids
        of a decode step planned before the host read this one's tokens."""
        row_of = {seq_id: i for i, seq_id in enumerate(row_seq_ids)}
        rows = [row_of[entry.seq_id] for entry in entries]
        if rows == list(range(len(rows))):
            return self.token_ids[: len(rows)]
        return self.token_ids[host_to_device(rows, torch.int64, self.token_ids.device)]  # some rows' sequences finished


@dataclass(slots=True)
class PromptLogprobsLaunch:
    """A step's prompt logprobs enqueued on the device (``Sampler.launch_prompt_logprobs``); ``collect_prompt_logprobs``
    reads them back. ``host`` holds CPU tensors filled by non-blocking copies until ``event`` has passed:
    ``token_logprobs [num_rows]`` (of each scored prompt token), then, when a request wants a top-k,
    ``top_ids, top_values [num_rows, max(ks)]``."""

    rows: tuple[PromptLogprobRows, ...]
    ks: list[int]  # per entry of rows, its SamplingParams.prompt_logprobs (top-k size)
    host: list[torch.Tensor]
    event: "torch.cuda.Event | None"  # recorded after the copies; None on CPU (the copies are done)


class Sampler:
    """Samples one token per logits row, from a step's ``SamplingMetadata`` (``sampling_batch.py``): it sees
    parameters, random streams and token histories, never the scheduler or its sequences.

    Args:
        vocab_size: logits columns past it (padding in some checkpoints) are never sampled.
        top_p_candidates: candidates of a top-p row without top-k on CPU (``draw.py``).
    """

    def __init__(self, vocab_size: int, top_p_candidates: int = TOP_P_CANDIDATES):
        self.vocab_size = vocab_size
        self.top_p_candidates = top_p_candidates

    def launch(self, logits: torch.Tensor, metadata: SamplingMetadata) -> "SampleLaunch":
        """Enqueue the sampling of ``logits [len(metadata), >= vocab_size]`` (float32, one row per entry of
        ``metadata``) and the copies of its results to the host; ``collect`` reads them.

        Rows with penalties or logits processors (``metadata.host_rows``) are processed here (reading the
        device, so the call then waits for the logits); the other rows enqueue device work only: greedy argmax,
        and temperature / top-k / top-p / min-p with an exponential-race draw, so a step of such rows is launched
        without a host sync (``LLMEngine.step`` launches the next step before collecting this one).

        A logits processor that raises, returns anything but a tensor of its input's shape ``[1, vocab_size]``,
        or leaves its row no finite logit, fails only its own row: ``collect`` reports that row's exception.

        NOTE: this runs once per step for every running sequence, and on a GPU the host time between
        steps leaves the device idle, so the per-row Python work is kept to list comprehensions over
        attributes; rows are only touched when they need it.
        """
        logits = logits[:, : self.vocab_size]
        device = logits.device
        params = metadata.params
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        # NOTE: only rows with penalties or processors are touched one at a time (the rows that _process_row
        # can change): a per-row copy costs a kernel launch, which at a few hundred rows per step is
        # milliseconds of host time.
        rows, banned_rows = metadata.host_rows, metadata.min_tokens_rows
        if rows or banned_rows:
            logits = logits.clone()
        errors = self._process_rows(logits, metadata) if rows else {}
        if banned_rows:  # after the processors, as the order says
            logits.index_put_((host_to_device(banned_rows, torch.int64, device),
                               host_to_device(metadata.min_tokens_ids, torch.int64, device)),
                              torch.tensor(float("-inf"), device=device))
        if rows:
            self._check_processed(logits, metadata, errors)
        token_ids, host_ids = self._draw(logits, params, metadata.generators)
        host = [_to_host(host_ids)]
        ks = [params[i].logprobs for i in want_logprobs]
        if want_logprobs:
            # the logprob of each sampled token and the top-k, batched over the rows that want them
            index = host_to_device(want_logprobs, torch.int64, device)
            host += _launch_token_logprobs(raw_logprobs[index], token_ids[index], max(ks))
        return SampleLaunch(token_ids, host, _copies_done(device), errors, want_logprobs, ks)

    def _draw(self, logits: torch.Tensor, params, generators) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_ids, host_ids)`` ``[num_rows]`` int64 on the device: greedy rows' argmax and the other rows'
        draws; ``host_ids`` marks an undrawable row -1 (what ``collect`` reads)."""
        # decided on the host: no device round trip when all greedy; only the sampled rows are drawn
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(sample_rows) == len(params):
            token_ids, undrawable = draw(logits, params, generators, self.top_p_candidates)
            return token_ids, token_ids.masked_fill(undrawable, -1)
        token_ids = host_ids = argmax(logits)
        if sample_rows:
            index = host_to_device(sample_rows, torch.int64, logits.device)
            drawn, undrawable = draw(logits[index], [params[i] for i in sample_rows],
                                     [generators[i] for i in sample_rows], self.top_p_candidates)
            token_ids[index] = drawn
            host_ids = token_ids.index_put((index,), drawn.masked_fill(undrawable, -1))
        return token_ids, host_ids

    def collect(self, launch: "SampleLaunch") -> "SamplerOutput":
        """The host part of the sampling: wait for ``launch``'s copies (its event only: work enqueued
        after it, such as the next step, is not waited for) and build the ``SamplerOutput``."""
        if launch.event is not None:
            launch.event.synchronize()
        token_list = launch.host[0].tolist()
        errors = launch.errors
        if min(token_list, default=0) < 0:  # rows whose draw was undefined (launch marks them -1)
            errors = dict(errors)
            for i, token_id in enumerate(token_list):
                if token_id < 0 and i not in errors:
                    errors[i] = ValueError(UNDRAWABLE)
        for i in errors:
            token_list[i] = None
        logprobs = {}
        if launch.want_logprobs:
            token_logprobs, entry = _read_token_logprobs(launch.host[1:])
            for j, (i, k) in enumerate(zip(launch.want_logprobs, launch.ks)):
                if i not in errors:
                    logprobs[i] = (token_logprobs[j], entry(j, token_list[i], k))
        return SamplerOutput(token_list, errors, logprobs)

    def launch_prompt_logprobs(self, logits: torch.Tensor, rows: tuple[PromptLogprobRows, ...],
                               ks: list[int]) -> PromptLogprobsLaunch:
        """Enqueue the prompt logprobs of ``rows`` and their copies to the host, without waiting for the device.

        Args:
            logits: ``[num_rows, >= vocab_size]`` float32 raw logits, the rows of ``rows`` in order
                (``len(r.token_ids)`` each: ``ModelRunner.execute``'s rows after the sampled and forked ones).
            rows: the step's ``SchedulerOutput.prompt_logprob_rows``.
            ks: per entry of ``rows``, its ``SamplingParams.prompt_logprobs``.
        """
        logprobs = torch.log_softmax(logits[:, : self.vocab_size], dim=-1)  # [num_rows, vocab_size]
        scored = host_to_device([t for r in rows for t in r.token_ids], torch.int64, logits.device)
        host = _launch_token_logprobs(logprobs, scored, max(ks))
        return PromptLogprobsLaunch(rows, ks, host, _copies_done(logits.device))

    @staticmethod
    def collect_prompt_logprobs(launch: PromptLogprobsLaunch) -> dict[int, list[dict[int, float]]]:
        """Wait for ``launch``'s copies; returns seq_id -> per scored prompt token ``{token_id: logprob}`` (the token,
        then the top-k), in order."""
        if launch.event is not None:
            launch.event.synchronize()
        _, entry = _read_token_logprobs(launch.host)
        out, i = {}, 0
        for rows, k in zip(launch.rows, launch.ks):
            out[rows.seq_id] = [entry(i + j, token_id, k) for j, token_id in enumerate(rows.token_ids)]
            i += len(rows.token_ids)
        return out

    def _process_rows(self, logits: torch.Tensor, metadata: SamplingMetadata) -> dict[int, BaseException]:
        """Penalties and processors on ``metadata.host_rows`` of ``logits`` (in place), one row at a time. Returns
        row -> the exception of a processor that raised (the others keep going)."""
        errors = {}
        for i in metadata.host_rows:
            try:
                logits[i] = _process_row(logits[i], metadata.params[i], metadata.token_ids[i],
                                         metadata.num_prompt_tokens[i])
            except Exception as e:  # a user's processor; keep the other rows going
                errors[i] = e
        return errors

    @staticmethod
    def _check_processed(logits: torch.Tensor, metadata: SamplingMetadata, errors: dict) -> None:
        """A processed row with a NaN or no finite logit cannot be sampled: it fails alone (added to ``errors``),
        and every failed row is zeroed so that the batch's draw stays valid."""
        rows = metadata.host_rows
        processed = logits[torch.tensor(rows, device=logits.device)]
        num_nan = processed.isnan().sum(dim=-1).tolist()
        no_finite = (~processed.isfinite().any(dim=-1)).tolist()
        for i, nans, none_finite in zip(rows, num_nan, no_finite):
            if (nans or none_finite) and i not in errors:
                what = f"{nans} NaN logits" if nans else "no finite logit (every logit -inf or +inf)"
                errors[i] = ValueError(
                    f"the logits processors of request {metadata.request_ids[i]!r} left {what} in its scores of "
                    f"{processed.shape[-1]} tokens: {[type(p).__name__ for p in metadata.params[i].logits_processors]}"
                )
        for i in errors:
            logits[i] = 0.0


def _process_row(row: torch.Tensor, sp, token_ids: list[int], num_prompt_tokens: int) -> torch.Tensor:
    """Penalties and processors on one row ``[vocab_size]`` of a sequence whose prompt + output ids are
    ``token_ids`` (the first ``num_prompt_tokens`` the prompt)."""
    if sp.repetition_penalty != 1.0:
        # CTRL / transformers: over prompt + output, divide positive logits, multiply negative ones.
        ids = torch.tensor(sorted(set(token_ids)), dtype=torch.int64, device=row.device)
        picked = row[ids]
        row[ids] = torch.where(picked > 0, picked / sp.repetition_penalty, picked * sp.repetition_penalty)
    if sp.presence_penalty or sp.frequency_penalty:
        counts = torch.bincount(
            torch.tensor(token_ids[num_prompt_tokens:], dtype=torch.int64, device=row.device), minlength=row.numel()
        )[: row.numel()].to(row.dtype)
        row = row - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).to(row.dtype)
    if sp.logits_processors:
        input_ids = torch.tensor([token_ids], dtype=torch.int64, device=row.device)
        scores = row.unsqueeze(0)
        for proc in sp.logits_processors:
            scores = proc(input_ids, scores)
            _check_scores(scores, row.numel(), proc)
        row = scores[0]
    return row


UNDRAWABLE = (
    "cannot sample at temperature > 0: the logits (after penalties and logits processors) hold +inf or NaN, so the "
    "probabilities are undefined (stock generate() raises 'probability tensor contains either inf, nan or element < 0'"
    " here); mask tokens with -inf rather than forcing one with +inf, or decode greedily (temperature=0)"
)


def _launch_token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Start copying to the host (``_to_host``) the logprob of ``token_ids[i]`` in row ``i`` of ``logprobs``
    ``[num_rows, vocab_size]`` (float32; token_ids ``[num_rows]`` int64), then, when ``k`` > 0, the top-``k`` ids
    and values ``[num_rows, k]``: what ``_read_token_logprobs`` reads."""
    host = [_to_host(logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1))]
    if k:
        top = torch.topk(logprobs, k, dim=-1)
        host += [_to_host(top.indices), _to_host(top.values)]
    return host


def _read_token_logprobs(host: list[torch.Tensor]):
    """The copies of ``_launch_token_logprobs`` (done): the token logprobs as a list, and ``entry(row, token_id, k)``,
    that row's ``{token_id: its logprob}`` followed by its first ``k`` top entries."""
    token_logprobs = host[0].tolist()
    top_ids, top_values = (host[1].tolist(), host[2].tolist()) if len(host) > 1 else ((), ())

    def entry(row: int, token_id: int, k: int) -> dict[int, float]:
        logprobs = {token_id: token_logprobs[row]}
        if k:
            logprobs.update(zip(top_ids[row][:k], top_values[row][:k]))
        return logprobs

    return token_logprobs, entry


def _copies_done(device: torch.device) -> "torch.cuda.Event | None":
    """An event recorded after the copies enqueued on ``device`` (CUDA); None on CPU, where they are done."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Start copying ``tensor`` to the host (into pinned memory on CUDA, non-blocking); the copy is done
    once an event recorded after it has passed. On CPU: the tensor itself."""
    if tensor.device.type == "cpu":
        return tensor
    return tensor.to("cpu", non_blocking=True)


def _check_scores(scores, vocab_size: int, proc) -> None:
    """A processor's return value must be a tensor ``[1, vocab_size]``, as it was given: a 1-D ``[vocab_size]``
    row would otherwise broadcast into the logits row silently (token 0 every step).

    Raises:
        ValueError: naming the processor and what it returned.
    """
    if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (1, vocab_size):
        got = f"shape {list(scores.shape)}" if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"logits processor {proc!r} must return scores of shape [1, {vocab_size}] (as given), got {got}")

