"""Attention over the paged KV cache for a flattened batch of tokens from many sequences.

The model runner splits a step's sequences into query groups (decodes with one query each; prefill
chunks) and pads each group to a rectangle, so one call per group covers every sequence in it. A layer
hands its new q/k/v to the step's backend, which writes K/V at their slots and attends over the cache:
layers never touch cache tensors, and a new KV layout or kernel is a backend, not a model change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvserve.attention.sdpa import SDPABackend


@dataclass(slots=True)
class QueryGroup:
    query_index: torch.Tensor  # [B, Q] flat token index of each query (padding repeats a real one)
    query_valid: torch.Tensor  # [V] where each valid (non-padding) query sits in the flattened [B * Q]
    # per KV layer group: [B, N] each sequence's blocks; keys at positions 0..N*block_size-1 (a sliding group's
    # tables may start at a later block: the first its queries' windows reach, the same for the whole group)
    block_tables: list[torch.Tensor]
    # per KV layer group: [B, 1, Q, L] bool, True where a query may attend (a sliding group: only its window); None: see is_causal
    masks: list[torch.Tensor | None]
    flat_index: torch.Tensor  # flat token index of each valid query, in query_valid order
    context_lens: list[torch.Tensor]  # per KV layer group: [B] keys each sequence has after this step, from its first block
    # Where a group's mask is None, every sequence starts at position 0, so query i sees keys 0..i: SDPA's own
    # causal mask, which lets it skip the blocks above the diagonal that an explicit mask would make it compute
    # (or, if False, every query sees every key).
    is_causal: bool = False
    # [B] the first query of each sequence whose attention probabilities vote for cached tokens (a KV policy's
    # votes; Q or more: none); None: no sequence of the group votes
    score_from: torch.Tensor | None = None
    in_order: bool = False  # the group's valid queries are all of the step's tokens, in order (flat_index = arange)
    # [B] int64 of a decode group: bit j set, query b skips the key j + 1 slots before its own (a tree of guesses'
    # other branches; the masks have them too); None: none
    hidden: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.query_index.shape[1] == 1

    def to(self, device: torch.device) -> QueryGroup:
        if device.type == "cpu":  # built there
            return self
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QueryGroup(move(self.query_index), move(self.query_valid), [move(t) for t in self.block_tables],
                          [move(m) for m in self.masks], move(self.flat_index), [move(t) for t in self.context_lens], self.is_causal,
                          move(self.score_from), self.in_order, move(self.hidden))


@dataclass(slots=True)
class ForwardContext:
    positions: torch.Tensor  # [T]
    slot_mappings: list[torch.Tensor]  # per KV layer group: [T] where each token's K/V is written
    groups: list[QueryGroup]
    backend: SDPABackend
    votes: dict[int, dict[int, torch.Tensor]] | None = None  # layer -> query group -> [B, kv heads, keys] (see score_from)
    step_arguments: list[tuple] | None = None  # per KV group, where the backend's native kernel runs the step whole

    def __post_init__(self):
        self.step_arguments = self.backend.step_arguments(self)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float,
                  value_dims: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the step's new tokens. Returns [T, H, D]. A latent layer (MLA) caches
        k only and passes v=None: its values are the first `value_dims` of each cached key, and it returns [T, H, value_dims]."""
        return self.backend.forward(layer, q, k, v, self, scale, value_dims)

    def kernel_arguments(self, layer: int) -> tuple | None:
        """Where the backend lets a fused layer op write this layer's new K/V and attend itself: the native decode
        kernel's arguments (the layer's stores and formats, then the step's block tables, context lengths, window,
        slots and the keys each query skips); else None, and the layer calls `attention`."""
        return self.backend.layer_arguments(layer, self)
