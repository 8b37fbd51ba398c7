"""StreamingLLM (Xiao et al., 2023): the first `sinks` tokens, which draw attention whatever they say, and the most
recent `window`. Positions are slots in the cache, so a request generates past the model's context window with
a fixed number of blocks; sinks=0 is plain window attention, the baseline the paper shows collapsing."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.errors import KVServeError
from kvserve.kv.policies import KVPolicy, SeqKV


@dataclass(frozen=True)
class Streaming(KVPolicy):
    sinks: int = 4
    window: int = 1024
    name = "streaming"
    reposition = True

    def validate(self) -> None:
        if self.sinks < 0 or self.window < 1:
            raise KVServeError(f"kv_policy streaming needs sinks >= 0 and window >= 1, got sinks={self.sinks}, window={self.window}")
        if self.sinks > self.window:
            raise KVServeError(f"kv_policy streaming: sinks ({self.sinks}) must not be larger than the window ({self.window})")

    def check(self, block_size: int) -> None:
        if self.window < block_size:
            raise KVServeError(f"kv_policy streaming: the window ({self.window}) is smaller than a block ({block_size} tokens)")

    def keep(self, seq: SeqKV, votes: torch.Tensor | None) -> torch.Tensor | None:
        if seq.slots < self.sinks + self.window + seq.block_size:  # evict a block's worth at a time
            return None
        return torch.cat([torch.arange(self.sinks), torch.arange(seq.slots - self.window, seq.slots)])[None, None]

    def held(self, num_tokens: int) -> int:
        return min(num_tokens, self.sinks + self.window)

    def reusable_prefix(self, num_prompt: int, chunk: int, block_size: int) -> int:
        first = self.sinks + self.window + block_size  # the fewest slots `keep` evicts from
        return -(-first // chunk) * chunk - 1  # the step that ends at the first eviction is computed
