"""KV eviction policies: which cached tokens a request keeps, as kvpress's presses decide it, but in the paged pool.

A sequence's cache holds `slots` tokens (slot i at block i // block_size of its table); a policy evicts by
naming the slots each layer and KV head keeps (as many for every layer and head, so one block table serves
them all), and the engine moves those tokens' K/V to the front and gives back the blocks left empty.

Policies that weigh tokens by attention ask for votes: from a step's queries at index `voters` on, the
attention probabilities each cached token received, summed over those queries and each KV head's query
heads. The attention backend computes them in the pass that computes the outputs.

A policy string is `NAME:key=value,...`, e.g. `streaming:sinks=4,window=1024`, `h2o:budget=0.2`,
`snapkv:budget=512`, `minicache:start=15` (which merges layers instead: a layout, see minicache.py). Budgets are tokens, or a fraction (< 1) of the sequence (snapkv: of the prompt).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from kvserve.config import parse_named
from kvserve.errors import KVServeError

UNBOUNDED = 1 << 62  # a request's token limit where a policy places tokens at cache slots (streaming)


@dataclass(frozen=True, slots=True)
class SeqKV:
    """What a policy sees of a sequence after a step."""

    num_prompt: int
    num_computed: int  # tokens the model has seen
    slots: int  # of them, tokens the cache holds
    block_size: int


@dataclass(frozen=True)
class KVPolicy:
    name = ""
    reposition = False  # RoPE positions are cache slots (StreamingLLM): moved keys are rotated to their new slot
    decode_votes = True  # False: votes only from the prompt, dropped once it is computed
    merges_layers = False  # True: the policy is a KV layout the engine builds (MiniCache), not an eviction

    def validate(self) -> None:
        """Raise a clear error for parameters that make no sense."""

    def check(self, block_size: int) -> None:
        """Raise a clear error for parameters this engine's block size cannot serve."""

    def voters(self, num_prompt: int, start: int, count: int) -> int | None:
        """Of a step computing tokens [start, start + count), the index of the first whose query votes (None: no votes)."""
        return None

    def keep(self, seq: SeqKV, votes: torch.Tensor | None) -> torch.Tensor | None:
        """After a step: the slots kept ([layers or 1, kv heads or 1, kept], ascending), or None to keep all. `votes`
        [layers, kv heads, slots] are the accumulated votes of a voting policy."""
        raise NotImplementedError

    def held(self, num_tokens: int) -> int:
        """Tokens a request of `num_tokens` tokens (all prompt, for a policy that compresses prompts) keeps cached."""
        return num_tokens

    def reusable_prefix(self, num_prompt: int, chunk: int, block_size: int) -> int:
        """The most leading tokens of a prompt a cached prefix may stand for: fewer than the request computes before
        it can first evict (an eviction follows a step that computes; whatever policy, if any, cached the others,
        their K/V are the same), none from its first voting query on (a cached token casts no vote). Evictions come
        where the prompt's `chunk`-token chunks end (Scheduler._chunk)."""
        return 0

    def max_slots(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """The most slots a request of `num_tokens` tokens holds at once: what it keeps, up to a block more (evictions
        come a block at a time), and a step's `chunk` of new tokens before it evicts."""
        return min(num_tokens, self.held(num_tokens) + block_size - 1 + chunk)

    def __str__(self) -> str:
        return f"{self.name}:" + ",".join(f"{f.name}={getattr(self, f.name):g}" for f in fields(self))


def budget_tokens(budget: float, total: int) -> int:
    """A budget of tokens, or a fraction of `total` when below 1."""
    return max(1, math.ceil(budget * total)) if budget < 1 else int(budget)


def recent_and_top(votes: torch.Tensor, slots: int, recent: int, kept: int) -> torch.Tensor:
    """The last `recent` slots and, of the others, the `kept - recent` with the most votes, per layer and head."""
    recent = min(recent, kept)
    old = votes[..., : slots - recent]
    top = old.topk(kept - recent, dim=-1).indices
    tail = torch.arange(slots - recent, slots).expand(*votes.shape[:-1], recent)
    return torch.cat([top, tail], -1).sort(-1).values


def add_votes(votes: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Accumulated votes plus a step's, which also cover the slots it added."""
    return new.clone() if votes is None else F.pad(votes, (0, new.shape[-1] - votes.shape[-1])) + new


def parse_policy(text: str | None) -> KVPolicy | None:
    """`NAME:key=value,...` -> a policy; None or "none" -> None."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    name, given = parse_named(text, "kv_policy")
    if name not in POLICIES:
        raise KVServeError(f"unknown kv_policy {name!r}; choose from none, {', '.join(POLICIES)}")
    cls = POLICIES[name]
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in given.items():
        if key not in known:
            raise KVServeError(f"kv_policy {name} takes {', '.join(f'{k}=' for k in known)}; got {key}={value}")
        try:
            values[key] = float(value) if known[key].type in (float, "float") else int(value)
        except ValueError:
            raise KVServeError(f"kv_policy {name}: {key} must be a number, got {value!r}") from None
    policy = cls(**values)
    policy.validate()
    return policy


from kvserve.kv.policies.h2o import H2O  # noqa: E402
from kvserve.kv.policies.minicache import MiniCache  # noqa: E402
from kvserve.kv.policies.snapkv import SnapKV  # noqa: E402
from kvserve.kv.policies.streaming import Streaming  # noqa: E402

POLICIES: dict[str, type[KVPolicy]] = {"streaming": Streaming, "h2o": H2O, "snapkv": SnapKV, "minicache": MiniCache}
