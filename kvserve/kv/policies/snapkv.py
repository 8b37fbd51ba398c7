"""SnapKV (Li et al., 2024): once the prompt is computed, its last `window` queries vote (attention summed over
them, smoothed by average pooling over neighbouring tokens) for the prompt tokens each layer and KV head keeps,
within the budget; the window itself is kept. Generated tokens are all kept."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.errors import KVServeError
from kvserve.kv.policies import KVPolicy, SeqKV, budget_tokens, recent_and_top


@dataclass(frozen=True)
class SnapKV(KVPolicy):
    budget: float = 512  # prompt tokens kept, or a fraction of the prompt
    window: int = 32  # the observation window: the prompt's last queries
    kernel: int = 5  # the pooling kernel
    name = "snapkv"
    decode_votes = False

    def validate(self) -> None:
        if self.budget <= 0:
            raise KVServeError(f"kv_policy snapkv: budget must be > 0 (tokens, or a fraction below 1), got {self.budget}")
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise KVServeError(f"kv_policy snapkv needs window >= 1 and an odd kernel, got window={self.window}, kernel={self.kernel}")
        if self.budget >= 1 and self.budget < self.window:
            raise KVServeError(f"kv_policy snapkv: the budget ({self.budget:g}) must hold the window ({self.window})")

    def voters(self, num_prompt: int, start: int, count: int) -> int | None:
        first = num_prompt - self.window
        if start >= num_prompt or start + count <= first:
            return None
        return max(0, first - start)

    def keep(self, seq: SeqKV, votes: torch.Tensor | None) -> torch.Tensor | None:
        kept = max(budget_tokens(self.budget, seq.num_prompt), min(self.window, seq.num_prompt))
        if votes is None or seq.num_computed < seq.num_prompt or seq.slots <= kept:
            return None
        window = min(self.window, seq.slots)
        prefix = votes[..., : seq.slots - window]
        pooled = F.avg_pool1d(prefix.flatten(0, 1)[:, None], self.kernel, stride=1, padding=self.kernel // 2).view_as(prefix)
        return recent_and_top(F.pad(pooled, (0, window)), seq.slots, window, kept)

    def held(self, num_tokens: int) -> int:
        return min(num_tokens, max(budget_tokens(self.budget, num_tokens), self.window))

    def reusable_prefix(self, num_prompt: int, chunk: int, block_size: int) -> int:
        return max(0, num_prompt - self.window)  # it evicts once the prompt is computed

    def max_slots(self, num_tokens: int, chunk: int, block_size: int) -> int:
        return num_tokens  # the prompt is whole until its last chunk is computed
