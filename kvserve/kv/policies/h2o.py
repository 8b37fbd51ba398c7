"""H2O (Zhang et al., 2023): keep the heavy hitters, the tokens with the largest attention accumulated over every
query so far (per layer and KV head), and the most recent tokens; evict the rest as decoding goes."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.errors import KVServeError
from kvserve.kv.policies import KVPolicy, SeqKV, budget_tokens, recent_and_top


@dataclass(frozen=True)
class H2O(KVPolicy):
    budget: float = 0.2  # tokens kept, or a fraction of the sequence
    recent: float = 0.5  # the budget's share of recent tokens (the rest: heavy hitters)
    name = "h2o"

    def validate(self) -> None:
        if self.budget <= 0:
            raise KVServeError(f"kv_policy h2o: budget must be > 0 (tokens, or a fraction below 1), got {self.budget}")
        if not 0 <= self.recent <= 1:
            raise KVServeError(f"kv_policy h2o: recent is a share of the budget in [0, 1], got {self.recent}")

    def voters(self, num_prompt: int, start: int, count: int) -> int | None:
        return 0

    def keep(self, seq: SeqKV, votes: torch.Tensor | None) -> torch.Tensor | None:
        kept = budget_tokens(self.budget, seq.num_computed)
        if seq.slots < kept + seq.block_size:  # evict a block's worth at a time
            return None
        return recent_and_top(votes, seq.slots, math.ceil(self.recent * kept), kept)

    def held(self, num_tokens: int) -> int:
        return min(num_tokens, budget_tokens(self.budget, num_tokens))
