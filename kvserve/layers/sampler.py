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


def sample(logits: torch.Tensor, batch: SamplingBatch, argmax: torch.Tensor | None = None) -> SamplerOutput:
    """Greedy rows take their argmax; sampling rows draw together (_sample_rows). Logits on a GPU stay there unless a
    row asks for logprobs or logit adjustments: only the tokens come back. `argmax`: each row's, where the LM head's
    kernel found it (on the CPU)."""
    on_cpu = not logits.is_cuda
    if not on_cpu and any(p.logprobs is not None or _adjusts(p) for p in batch.params):
        logits, on_cpu = logits.cpu(), True
    logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in batch.params) else None
    adjusted = _adjust_logits(logits, batch)
    rows = [i for i, p in enumerate(batch.params) if not p.greedy]
    if rows and len(rows) == len(logits):
        return SamplerOutput(_sample_rows(adjusted, batch.params, batch.generators).tolist(), logprobs)
    if argmax is not None and adjusted is logits:  # the head's own: no pass over the logits (cold after the step)
        tokens = argmax.numpy()
    else:  # NumPy's argmax is vectorized: 4 us a 49k-token row, torch's 43 (2-core Zen 5)
        tokens = adjusted.numpy().argmax(-1) if on_cpu else adjusted.argmax(-1)
    if rows:
        drawn = _sample_rows(adjusted[rows], [batch.params[i] for i in rows], [batch.generators[i] for i in rows])
        tokens[rows] = drawn.numpy() if on_cpu else drawn
    return SamplerOutput(tokens.tolist(), logprobs)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """A token for each row [R, V], drawn from softmax(logits / temperature) without the tokens less likely than
    min_p times the likeliest, restricted to the top_k likeliest tokens and to the smallest set of them whose
    probability reaches top_p (the likeliest one always kept). One uniform number a row, from its own generator,
    on the CPU: a seeded row's draws do not depend on the batch or the device. The rows go in one batch on the
    logits' device (one at a time, 32 rows of SmolLM2 cost a CPU step 11-19 ms; together, 6-9)."""
    device, vocab = logits.device, logits.shape[-1]
    scaled = logits / _per_row([p.temperature for p in params], logits)
    if any(p.min_p > 0 for p in params):  # p(x) < min_p * p(best): a logit below the best one's plus log(min_p)
        floor = _per_row([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], logits)
        scaled = scaled.masked_fill(scaled < scaled.amax(-1, keepdim=True) + floor, -math.inf)
    u = torch.tensor([float(torch.rand((), generator=g, dtype=torch.float64)) for g in generators], dtype=torch.float64, device=device)
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    is_filtered = [k < vocab or p < 1 for k, p in zip(top_k, top_p)]
    filtered = [i for i, f in enumerate(is_filtered) if f]
    if not filtered:  # the whole distribution, in vocabulary order: no sort
        return _draw(scaled.softmax(-1), u)
    if len(filtered) == len(params):
        return _among_likeliest(scaled, top_k, top_p, u)
    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    plain = [i for i, f in enumerate(is_filtered) if not f]
    tokens[plain] = _draw(scaled[plain].softmax(-1), u[plain])
    tokens[filtered] = _among_likeliest(scaled[filtered], [top_k[i] for i in filtered], [top_p[i] for i in filtered], u[filtered])
    return tokens


# A top-p filter alone first looks for its tokens among this many of the likeliest: sorting a whole 50-250k
# vocabulary costs milliseconds a row, more than a decode step.
TOP_P_CANDIDATES = (64, 1024)


def _among_likeliest(scaled: torch.Tensor, top_k: list[int], top_p: list[float], u: torch.Tensor, level: int = 0,
                     total: torch.Tensor | None = None) -> torch.Tensor:
    """_sample_rows' draw for rows [R, V] with a top-k or top-p filter, among the likeliest TOP_P_CANDIDATES[level]
    tokens (no more than the rows' top_k); rows whose tokens these may not hold all (short of top_p's mass, a
    top_k beyond them) draw again among more. total: each row's logsumexp (computed at the first level)."""
    total = torch.logsumexp(scaled, -1, keepdim=True) if total is None else total
    size = min((*TOP_P_CANDIDATES, scaled.shape[-1])[level], max(top_k))
    values, ids = scaled.topk(size)  # sorted, likeliest first
    probs = (values - total).exp()
    mass = _per_row(top_p, probs)
    wide = [j for j, k in enumerate(top_k) if k > size]  # rows whose top_k reaches past these tokens
    short: list[int] = []  # those of them short of their top_p mass here
    if wide:
        rows = slice(None) if len(wide) == len(top_k) else wide
        enough = (probs[rows].sum(-1) >= (mass if isinstance(mass, float) else mass[rows, 0])).tolist()
        short = [j for j, ok in zip(wide, enough) if not ok]
        if len(short) == len(top_k):
            return _among_likeliest(scaled, top_k, top_p, u, level + 1, total)
    keep = (probs.cumsum(-1) - probs) < mass  # drop a token once the mass before it reaches top_p
    if min(top_k) < size:
        keep &= torch.arange(size, device=probs.device) < _per_row(top_k, probs, torch.long)
    keep[:, 0] = True  # a prefix of each row
    tokens = ids.gather(1, _draw(probs * keep, u, keep.sum(-1))[:, None])[:, 0]
    if short:
        tokens[short] = _among_likeliest(scaled[short], [top_k[j] for j in short], [top_p[j] for j in short], u[short], level + 1,
                                         total[short])
    return tokens


def _draw(probs: torch.Tensor, u: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """For each row of probs [R, N] (zeros past its first lengths[r] entries; default all N), index i with
    probability probs[i] / their sum: its uniform number u [R] against the cumulative sums, in float64."""
    cdf = probs.double().cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return picked.clamp_(max=probs.shape[-1] - 1) if lengths is None else torch.minimum(picked, lengths - 1)


def _per_row(values: list, like: torch.Tensor, dtype: torch.dtype | None = None) -> float | torch.Tensor:
    """Per-row values as a column [R, 1] to broadcast over rows like `like`, or the one value they all share."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=dtype or like.dtype, device=like.device)[:, None]


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
                big = torch.finfo(row.dtype).max  # a tiny penalty must not make inf, whose softmax is NaN
                row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty).clamp_(-big, big)
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
