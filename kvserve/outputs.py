from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SchedulerStats:
    """The engine's counters since it started (the scheduler counts them)."""

    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed and verified...
    num_accepted_tokens: int = 0  # ...and kept
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens served from it
    num_evicted_tokens: int = 0  # KV policies: tokens whose K/V was evicted
    tier_loaded_blocks: int = 0  # KV tiers: blocks of cached prefixes loaded into the pool instead of computed...
    tier_saved_blocks: int = 0  # ...and blocks saved to them


@dataclass(slots=True)
class RequestMetrics:
    """Timings (seconds, time.perf_counter clock) and KV figures of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    tier_tokens: int = 0  # of those, tokens the pool no longer held, loaded from a KV tier
    forked_blocks: int = 0  # n > 1: blocks of the prompt the other completions share instead of computing again
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed...
    num_accepted_tokens: int = 0  # ...and kept
    kv_bytes: int = 0
    kv_policy: str | None = None  # the KV policy the request ran with (kvserve.kv.policies)
    num_evicted_tokens: int = 0  # tokens whose K/V the policy evicted

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first, over the time since the first: the steady decode rate."""
        if self.num_output_tokens < 2 or self.last_token_time == self.first_token_time:
            return None
        return (self.num_output_tokens - 1) / (self.last_token_time - self.first_token_time)

    @property
    def acceptance_rate(self) -> float | None:
        """Speculative decoding: the share of proposed tokens the model confirmed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n completions, in vLLM's shape; new_text and new_token_ids are what the step that made
    this output added (a stream shows those)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # with SamplingParams.logprobs
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None: EOS, length)
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """What a request has produced so far, in vLLM's shape: `outputs` holds its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprob | None] | None = None  # SamplingParams.prompt_logprobs: None for the first token
    # SamplingParams.prompt_distributions, once finished: [prompt tokens - 1, vocab] fp16 log-probs, row i predicting token i + 1
    prompt_distributions: Any = None

    def after(self, earlier: RequestOutput) -> RequestOutput:
        """This output, carrying what `earlier` (the request's output before it, not read) added too: a reader that
        falls behind gets one output for the steps it missed, not one each, each holding its text and ids so far."""
        for now, before in zip(self.outputs, earlier.outputs):
            before.new_token_ids.extend(now.new_token_ids)
            now.new_text, now.new_token_ids = before.new_text + now.new_text, before.new_token_ids
        return self
