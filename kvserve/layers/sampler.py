"""Turn a step's logits into next tokens: logit biases, penalties, temperature, min-p, top-k, top-p, seeded sampling."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingBatch:
    """One row per sequence that samples this step. A row's history (for penalties) is its sequence's token ids, of
    which the first num_prompt are the prompt, then the guesses before its row: held, not copied, as few rows read them."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    token_ids: list[list[int]]
    num_prompt: list[int]
    guesses: list[list[int]]
    early_stops: list[list[int]] | None = None  # per row, the tokens it may not sample before its min_tokens

    def output_ids(self, i: int) -> list[int]:
        return self.token_ids[i][self.num_prompt[i]:] + self.guesses[i]


@dataclass(slots=True)
class PromptLogprobs:
    """Log-probabilities of the prompt tokens one sequence scored this step."""

    logprobs: torch.Tensor  # [n] of each scored prompt token
    top_ids: torch.Tensor  # [n, k]
    top_logprobs: torch.Tensor  # [n, k]
    distributions: torch.Tensor | None = None  # [n, vocab] fp16, when asked for


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: torch.Tensor | None  # [B, V] raw model log-probabilities, when any row asked for logprobs
    prompt: dict = field(default_factory=dict)  # Sequence -> PromptLogprobs, for those scoring their prompt


def score_prompt(logits: torch.Tensor, targets: torch.Tensor, params: SamplingParams) -> PromptLogprobs:
    """Each row's log-probability of its target token, its top tokens, and (if asked) its whole distribution."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(params.prompt_logprobs, dim=-1)
    return PromptLogprobs(logprobs.gather(1, targets[:, None]).squeeze(1), ids, values,
                          logprobs.half() if params.prompt_distributions else None)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Logits on a GPU stay there where every row is plain greedy (only the tokens come back); else they come to
    the CPU, where seeded draws are the same on every device."""
    if logits.device.type != "cpu":
        if all(p.greedy and p.logprobs is None and not _adjusts(p) for p in batch.params):
            return SamplerOutput(logits.argmax(-1).tolist(), None)
        logits = logits.cpu()
    logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in batch.params) else None
    logits = _adjust_logits(logits, batch)
    tokens = logits.numpy().argmax(-1).tolist()  # NumPy's is vectorized: 4 us a 49k-token row, torch's 43 (2-core Zen 5)
    for i, p in enumerate(batch.params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, batch.generators[i])
    return SamplerOutput(tokens, logprobs)


# A top-p filter alone first looks for its tokens among this many of the likeliest: sorting a whole 50-250k
# vocabulary costs milliseconds a row, more than a decode step.
TOP_P_CANDIDATES = (64, 1024)


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One token drawn from softmax(logits / temperature) without the tokens less likely than min_p times the
    likeliest, restricted to the top_k likeliest tokens and to the smallest set of them whose probability reaches
    top_p (the likeliest one always kept)."""
    scaled = logits / p.temperature
    if p.min_p > 0:  # p(x) < min_p * p(best): a logit below the best one's plus log(min_p)
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(p.min_p), -math.inf)
    vocab = scaled.shape[0]
    top_k = min(p.top_k, vocab) if p.top_k > 0 else vocab
    if top_k == vocab and p.top_p >= 1:
        return _draw(scaled.softmax(-1), generator)
    total = torch.logsumexp(scaled, -1)
    for size in [n for n in TOP_P_CANDIDATES if n < top_k] + [top_k]:
        values, ids = scaled.topk(size)  # sorted, likeliest first
        probs = (values - total).exp()
        if size == top_k or float(probs.sum()) >= p.top_p:  # every token the filters keep is among these
            break
    keep = (probs.cumsum(-1) - probs) < p.top_p  # drop a token once the mass before it reaches top_p
    keep[0] = True
    return int(ids[keep][_draw(probs[keep], generator)])


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Index i with probability probs[i] / sum(probs): one uniform number against the cumulative sums (in float64)."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), len(cdf) - 1)


def _adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Each row's logit biases, then its penalties (vLLM's order), and its stop tokens banned while its output is
    shorter than min_tokens, on a copy where any row has any of them."""
    rows = [i for i, p in enumerate(batch.params) if _adjusts(p)]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p, row = batch.params[i], logits[i]
        if p.logit_bias:
            row[torch.tensor(list(p.logit_bias))] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(batch.token_ids[i]) | set(batch.guesses[i])), dtype=torch.long)  # prompt and output
            if len(seen):
                values = row[seen]
                row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        output_ids = batch.output_ids(i) if p.presence_penalty or p.frequency_penalty else []
        if output_ids:
            counts = torch.bincount(torch.tensor(output_ids), minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.min_tokens and batch.early_stops and len(batch.token_ids[i]) - batch.num_prompt[i] + len(batch.guesses[i]) < p.min_tokens:
            row[batch.early_stops[i]] = -torch.inf
    return logits


def _adjusts(p: SamplingParams) -> bool:
    """Whether _adjust_logits changes this row's logits."""
    return bool(p.logit_bias or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.min_tokens)
