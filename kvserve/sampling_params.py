from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

from kvserve.errors import KVServeError


INTEGERS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
OPTIONAL = ("max_tokens", "logprobs", "prompt_logprobs")  # None too
NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (SamplingParams.greedy)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, with vLLM's names and meanings."""

    n: int = 1  # completions of one prompt: they share its prefill (completion i samples with seed + i)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0  # vLLM's: drops tokens less likely than min_p times the likeliest one (0: none)
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the request's limit (the context window or the KV pool), as in vLLM
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string ends the output before this many tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to a token's logit before sampling, in [-100, 100]
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # score the prompt: each prompt token's log-probability and the top k
    # kvserve's own: with prompt_logprobs, also every prompt position's whole next-token log-distribution (fp16)
    prompt_distributions: bool = False
    cache_salt: str | None = None
    kv_policy: str | None = None  # kvserve's own: this request's KV eviction policy, e.g. "h2o:budget=0.2" ("none": none)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        for names, kind, what in ((INTEGERS, Integral, "an integer"), (NUMBERS, Real, "a number")):
            for name in names:
                value = getattr(self, name)
                if (value is not None or name not in OPTIONAL) and (isinstance(value, bool) or not isinstance(value, kind)):
                    raise KVServeError(f"{name} must be {what}, got {value!r}")
        checks = [
            (1 <= self.n <= 64, f"n must be in [1, 64], got {self.n}"),
            (self.temperature >= 0 and math.isfinite(self.temperature), f"temperature must be >= 0 and finite, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (disabled) or >= 1, got {self.top_k}"),
            (self.max_tokens is None or self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
             f"max_tokens must be >= 1 (or 0 to only score the prompt with prompt_logprobs), got {self.max_tokens}"),
            (0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens),
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
             f"stop must be a non-empty string or a list of them, got {self.stop!r}"),
            (isinstance(self.stop_token_ids, (list, tuple)) and all(type(t) is int and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}"),
            (self.cache_salt is None or isinstance(self.cache_salt, str), f"cache_salt must be a string, got {self.cache_salt!r}"),
            # completion i seeds its generator with seed + i, which torch takes as a 64-bit integer
            (self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed <= 2**63 - self.n),
             f"seed must be an integer in [-2**63, 2**63 - n], got {self.seed!r}"),
            (self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and -100 <= b <= 100 for t, b in self.logit_bias.items())),
             f"logit_bias must map token ids (ints >= 0) to biases in [-100, 100], got {self.logit_bias!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise KVServeError(message)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so low that its draw is the argmax but for near-ties (vLLM's rule); below ~1e-37,
        logits / temperature overflowed to inf and the draw took the vocabulary's last token."""
        return self.temperature < GREEDY_BELOW
