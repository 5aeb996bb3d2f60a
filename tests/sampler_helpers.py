"""Driving the engine's sampler on fixed logits, without an engine: the rows' state goes through the product's
``SamplingBatch`` (registered, then prepared from a one-step plan), and the sampler's ``launch`` / ``collect``."""

from dataclasses import dataclass

import torch

from paged_transformers.core.messages import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from paged_transformers.core.sampling import Sampler, SamplerOutput
from paged_transformers.core.sampling_batch import SamplingBatch


@dataclass(slots=True)
class SampleResult:
    """One row's result: its token, or the error that failed it, and its logprobs when asked."""

    token_id: int | None
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    error: BaseException | None = None


class Rows:
    """A fixed set of rows to sample again and again: each ``sample`` is one step of every row.

    Args:
        params: each row's ``SamplingParams``.
        generators: each row's random stream (None: unseeded); default all None.
        prompts: each row's prompt token ids (what penalties and processors read); default ``[1]``.
        min_tokens_ids: ids masked while a row is under its ``min_tokens``.
    """

    def __init__(self, params, generators=None, prompts=None, min_tokens_ids=()):
        self.batch = SamplingBatch()
        generators = generators or [None] * len(params)
        prompts = prompts or [[1]] * len(params)
        for i, (sp, generator, prompt) in enumerate(zip(params, generators, prompts, strict=True)):
            self.batch.add(i, str(i), sp, generator, prompt, tuple(min_tokens_ids) if sp.min_tokens else ())
        self.num_rows, self.step_id = len(params), 0

    def sample_tokens(self, sampler: Sampler, logits: torch.Tensor, num_rows: int | None = None) -> SamplerOutput:
        """One step of the first ``num_rows`` rows (default all) on ``logits [num_rows, vocab]``."""
        n = self.num_rows if num_rows is None else num_rows
        self.step_id += 1
        plan = SchedulerOutput(self.step_id, tuple(ScheduledSeq(i, str(i), 0, 1, (1,), (), False, True) for i in range(n)))
        out = sampler.collect(sampler.launch(logits, self.batch.prepare(plan)))
        self.batch.record(ModelRunnerOutput({i: t for i, t in enumerate(out.token_ids) if t is not None}, {}, {}))
        return out


def sample_tokens(logits: torch.Tensor, params, generators=None, prompts=None, vocab_size=None, **kwargs) -> SamplerOutput:
    """One step of fresh rows of ``params`` on ``logits`` (``Rows``); ``kwargs`` go to ``Sampler``."""
    sampler = Sampler(vocab_size or logits.shape[-1], **kwargs)
    return Rows(params, generators, prompts).sample_tokens(sampler, logits)


def sample(logits: torch.Tensor, params, generators=None, prompts=None, vocab_size=None, **kwargs) -> list[SampleResult]:
    """``sample_tokens`` as one ``SampleResult`` per row."""
    out = sample_tokens(logits, params, generators, prompts, vocab_size, **kwargs)
    results = []
    for i, token_id in enumerate(out.token_ids):
        if i in out.errors:
            results.append(SampleResult(None, error=out.errors[i]))
        elif i in out.logprobs:
            results.append(SampleResult(token_id, *out.logprobs[i]))
        else:
            results.append(SampleResult(token_id))
    return results
