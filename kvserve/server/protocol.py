"""OpenAI request bodies (pydantic) and the JSON shapes of responses and stream chunks."""
from __future__ import annotations

import codecs
import math
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.errors import KVServeError
from kvserve.outputs import RequestOutput, TokenLogprob
from kvserve.sampling_params import SamplingParams


# Request bodies are strict, as OpenAI's API is: "stream": "yes" or "temperature": "0.5" is a 400, not a guess.
STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions, with vLLM's extras."""

    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings
    cache_salt: str | None = None
    kv_policy: str | None = None  # kvserve's own, like vLLM's extra fields: this request's KV eviction policy

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        """Completion i of n samples with seed + i, so n > 1 with a seed gives n different but reproducible answers."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, min_tokens=self.min_tokens, seed=self.seed, max_tokens=max_tokens, stop=stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, cache_salt=self.cache_salt, kv_policy=self.kv_policy, logit_bias=self.token_biases(),
        )

    def token_biases(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise KVServeError(f"logit_bias keys must be token ids, got {list(self.logit_bias)!r}") from None

    def check_supported(self) -> None:
        """OpenAI fields this server parses only to refuse: ignored, they would change the answer silently."""


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt before the completion; with logprobs, the prompt's too (max_tokens 0: only those)
    suffix: str | None = None  # refused (check_supported)
    best_of: int | None = None  # refused unless it equals n

    def check_supported(self) -> None:
        if self.suffix:
            raise KVServeError("suffix is not supported: this server completes after the prompt only")
        if self.best_of is not None and self.best_of != self.n:
            raise KVServeError(f"best_of is not supported (best_of={self.best_of}, n={self.n}): ask for n completions instead")

    @property
    def prompt_logprobs(self) -> int | None:
        """What the engine scores of the prompt: its logprobs when echoed with logprobs (or scored alone)."""
        if not self.echo or (self.logprobs is None and self.max_tokens != 0):
            return None
        return self.logprobs or 0


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict | None = None  # refused unless {"type": "text"} (check_supported)
    tools: list | None = None  # refused, as are functions and a tool_choice that needs tools
    functions: list | None = None
    tool_choice: str | dict | None = None

    def check_supported(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise KVServeError("top_logprobs needs logprobs: true")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise KVServeError(f"response_format {kind!r} is not supported (no constrained decoding): only 'text'")
        if self.tools or self.functions or self.tool_choice not in (None, "none", "auto"):
            raise KVServeError("tools and functions are not supported: this server does not call tools")


class TokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    tokens: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, outputs: list[RequestOutput]) -> dict:
    """OpenAI's usage, plus kvserve's forked_blocks (prompt blocks n > 1 completions shared instead of computing),
    the KV bytes the request held at its end, the cached tokens a KV tier gave (kv_tier_tokens), with a KV policy its
    name and the tokens it evicted, and, with speculative decoding, the tokens proposed and accepted."""
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = max((o.metrics.cached_tokens for o in outputs), default=0)
    from_tiers = max((o.metrics.tier_tokens for o in outputs), default=0)
    details = {"cached_tokens": cached, **({"kv_tier_tokens": from_tiers} if from_tiers else {})}
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": details, "forked_blocks": sum(o.metrics.forked_blocks for o in outputs),
            "kv_bytes": sum(o.metrics.kv_bytes for o in outputs), **_kv_policy(outputs), **_speculative(outputs)}


def _kv_policy(outputs: list[RequestOutput]) -> dict:
    policy = next((o.metrics.kv_policy for o in outputs if o.metrics.kv_policy), None)
    return {"kv_policy": {"name": policy, "evicted_tokens": sum(o.metrics.num_evicted_tokens for o in outputs)}} if policy else {}


def _speculative(outputs: list[RequestOutput]) -> dict:
    proposed = sum(o.metrics.num_draft_tokens for o in outputs)
    if not proposed:
        return {}
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    return {"speculative": {"draft_tokens": proposed, "accepted_tokens": accepted, "acceptance_rate": accepted / proposed}}


def _finite(logprob: float) -> float:
    """JSON has no NaN or -inf (a model whose logits overflow): the server's answer was a 500, its stream invalid
    JSON. -9999.0 is vLLM's floor for -inf."""
    return logprob if math.isfinite(logprob) else -9999.0


def chat_logprobs(logprobs: list[TokenLogprob], decode, raw) -> dict:
    """`decode` gives a token's text for logprobs, `raw` its own bytes (part of a character, maybe)."""
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": decode(token_id), "logprob": _finite(logprob), "bytes": list(raw(token_id))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top.items()]}
                        for lp in logprobs]}


def completion_logprobs(logprobs: list[TokenLogprob | None], token_ids: list[int], decode, raw, start_offset: int) -> dict:
    """The legacy completions shape; None entries (an echoed prompt's first token) have null logprobs. A token's
    text_offset counts the whole characters before it (one it completes began before it)."""
    offsets, chars, utf8 = [], start_offset, codecs.getincrementaldecoder("utf-8")(errors="ignore")
    for t in token_ids:
        offsets.append(chars)
        chars += len(utf8.decode(raw(t)))
    return {"tokens": [decode(t) for t in token_ids], "token_logprobs": [lp and _finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [lp and {decode(t): _finite(v) for t, v in lp.top.items()} for lp in logprobs], "text_offset": offsets}


def envelope(kind: str, request_id: str, model: str, choices: list[dict], created: int | None = None, **extra) -> dict:
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model,
            "choices": choices, **extra}
