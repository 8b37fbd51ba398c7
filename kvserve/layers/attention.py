"""Attention over the paged KV cache for a flattened batch of tokens from many sequences.

The model runner splits a step's sequences into groups (decodes with one query each; prefill chunks)
and pads each group to a rectangle, so one SDPA call per group covers every sequence in it. On CPU,
decode groups instead go to kvserve.kernels, which reads each sequence's blocks in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.engine.kv_cache import KVCache
from kvserve.kernels import native_ops


@dataclass(slots=True)
class AttentionGroup:
    query_index: torch.Tensor  # [B, Q] flat token index of each query (padding repeats a real one)
    query_valid: torch.Tensor  # [V] where each valid (non-padding) query sits in the flattened [B * Q]
    block_tables: torch.Tensor  # [B, N] each sequence's blocks; keys at positions 0..N*block_size-1
    mask: torch.Tensor | None  # [B, 1, Q, L] bool, True where a query may attend; None: see is_causal
    flat_index: torch.Tensor  # flat token index of each valid query, in query_valid order
    context_lens: torch.Tensor  # [B] keys each sequence has after this step
    # Every sequence starts at position 0, so query i sees keys 0..i: SDPA's own causal mask, which lets
    # it skip the blocks above the diagonal that an explicit mask would make it compute.
    is_causal: bool = False

    def to(self, device: torch.device) -> AttentionGroup:
        return AttentionGroup(*(None if t is None else t.to(device) for t in (
            self.query_index, self.query_valid, self.block_tables, self.mask, self.flat_index, self.context_lens)),
            self.is_causal)


@dataclass(slots=True)
class ForwardContext:
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    groups: list[AttentionGroup]
    kv_cache: KVCache
    decode_kernel: bool = False  # one-query groups use kvserve.kernels' paged decode attention


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: ForwardContext, scale: float
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] for the step's new tokens. Returns [T, H, D]."""
    ctx.kv_cache.write(layer, k, v, ctx.slot_mapping)
    out = torch.empty_like(q)
    for group in ctx.groups:
        if ctx.decode_kernel and group.query_index.shape[1] == 1:
            out[group.flat_index] = native_ops().paged_decode_attention(
                q[group.flat_index], ctx.kv_cache.k[layer], ctx.kv_cache.v[layer], group.block_tables, group.context_lens, scale)
            continue
        keys, values = ctx.kv_cache.read(layer, group.block_tables)
        repeat = q.shape[1] // keys.shape[2]
        if q.device.type == "cuda" and repeat > 1:  # CUDA's fused kernels take no enable_gqa; the math one is slow
            keys, values = keys.repeat_interleave(repeat, 2), values.repeat_interleave(repeat, 2)
        queries = q[group.query_index].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            queries, keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=group.mask, is_causal=group.is_causal, scale=scale, enable_gqa=keys.shape[2] != q.shape[1],
        )
        out[group.flat_index] = o.transpose(1, 2).flatten(0, 1)[group.query_valid]
    return out
