"""Turn a step's logits into next tokens: penalties, temperature, top-k, top-p, seeded sampling."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingBatch:
    """One row per sequence that samples this step."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]


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
    logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in batch.params) else None
    logits = _apply_penalties(logits, batch)
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(batch.params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows)
        probs = _filtered_probs(logits[rows], [batch.params[i] for i in sampled_rows])
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) draws from p, one generator per request.
        noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=batch.generators[i]) for i in sampled_rows])
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return SamplerOutput(tokens.tolist(), logprobs)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    logits = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[-1] for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    if (top_k < logits.shape[-1]).any() or (top_p < 1).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1])[None, :]
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; always keep the most likely one.
        drop = (ranks >= top_k[:, None]) | (cumulative - sorted_logits.softmax(dim=-1) >= top_p[:, None])
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    rows = [i for i, p in enumerate(batch.params)
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p, row = batch.params[i], logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(batch.prompt_ids[i]) | set(batch.output_ids[i])), dtype=torch.long)
            if len(seen):
                values = row[seen]
                row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if batch.output_ids[i] and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(batch.output_ids[i]), minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits
