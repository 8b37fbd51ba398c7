"""The backend for every layout on every device: gather each query group's blocks (dequantized by the
layout's formats) and run torch's scaled_dot_product_attention."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention import ForwardContext, QueryGroup
from kvserve.kv.cache import KVCache


class SDPABackend:
    def __init__(self, cache: KVCache):
        self.cache = cache

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, ctx: ForwardContext, scale: float,
                value_dims: int | None = None) -> torch.Tensor:
        g, j = self.cache.slot[layer]
        self.cache.write(j, k, v, ctx.slot_mappings[g])
        out = q.new_empty(*q.shape[:2], value_dims or q.shape[2])
        for group in ctx.groups:
            out[group.flat_index] = self.attend(g, j, q, group, scale, value_dims)
        return out

    def attend(self, g: int, j: int, q: torch.Tensor, group: QueryGroup, scale: float, value_dims: int | None = None) -> torch.Tensor:
        """The group's valid queries' outputs [V, H, D], over the cache of layer j of KV group g (value_dims: the
        values are the keys' first dims, MLA)."""
        keys, values = self.cache.gather(j, group.block_tables[g])
        if value_dims is not None:
            values = keys[..., :value_dims]
        repeat = q.shape[1] // keys.shape[2]
        if q.device.type == "cuda" and repeat > 1:  # CUDA's fused kernels take no enable_gqa; the math one is slow
            keys, values = keys.repeat_interleave(repeat, 2), values.repeat_interleave(repeat, 2)
        queries = q[group.query_index].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            queries, keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=group.masks[g], is_causal=group.is_causal and group.masks[g] is None, scale=scale, enable_gqa=keys.shape[2] != q.shape[1],
        )
        return o.transpose(1, 2).flatten(0, 1)[group.query_valid]
