"""The backend for every layout on every device: gather each query group's blocks (dequantized by the
layout's formats) and run torch's scaled_dot_product_attention."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention import ForwardContext, QueryGroup
from kvserve.kv.cache import KVCache


class SDPABackend:
    # Whether a step's rows never depend on each other (cpu_native's stacked layers, their kernels at every step
    # size): then, with prompt tokens attending as decode queries, a request's numbers are its own (batch_invariant).
    batch_invariant = False
    decode_rows = 0  # steps of up to this many plain decodes the backend runs whole, from tokens to logits (cpu_native)

    def __init__(self, cache: KVCache, bf16_past: int | None = None):
        self.cache = cache
        self.bf16_past = bf16_past  # steps of more than this many tokens attend their prompts in bf16 (None: never)

    def step_arguments(self, ctx: ForwardContext) -> list[tuple] | None:
        """A native kernel's arguments for a step it runs whole (cpu_native); this backend runs none."""
        return None

    def layer_arguments(self, layer: int, ctx: ForwardContext) -> tuple | None:
        return None

    def run_layers(self, x: torch.Tensor, ctx: ForwardContext, num_layers: int | None) -> torch.Tensor | None:
        """The model's layers and final norm over x in one native call, where this backend runs the step whole
        (cpu_native); else None."""
        return None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, ctx: ForwardContext, scale: float,
                value_dims: int | None = None) -> torch.Tensor:
        g, j = self.cache.slot[layer]
        self.write(j, k, v, ctx.slot_mappings[g])
        if ctx.groups[0].in_order and ctx.groups[0].score_from is None:  # one group of every token: no scatter
            return self.attend(g, j, q, ctx.groups[0], scale, value_dims)
        out = q.new_empty(*q.shape[:2], value_dims or q.shape[2])
        for i, group in enumerate(ctx.groups):
            if group.score_from is None:
                out[group.flat_index] = self.attend(g, j, q, group, scale, value_dims)
            else:
                out[group.flat_index], ctx.votes.setdefault(layer, {})[i] = self.attend_voting(g, j, q, group, scale, value_dims)
        return out

    def write(self, j: int, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor) -> None:
        """The step's new K/V [T, KVH, D] at their slots of layer j's cache (v None: a latent layer)."""
        self.cache.write(j, k, v, slots)

    def attend_voting(self, g: int, j: int, q: torch.Tensor, group: QueryGroup, scale: float,
                      value_dims: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """attend, computing the probabilities: also returns the votes [B, kv heads, keys], each key's probability
        summed over the voting queries (from group.score_from on) and the query heads of its KV head."""
        keys, values = self._keys_values(g, j, group, value_dims)  # [B, L, KVH, D]
        b, length, kv_heads = keys.shape[:3]
        queries = q[group.query_index]  # [B, Q, H, D]
        num_q = queries.shape[1]
        queries = queries.view(b, num_q, kv_heads, -1, queries.shape[-1]).permute(0, 2, 3, 1, 4)  # [B, KVH, rep, Q, D]
        logits = queries.float() @ keys.float().permute(0, 2, 3, 1)[:, :, None] * scale  # [B, KVH, rep, Q, L]
        mask = group.masks[g]
        if mask is None and group.is_causal:
            mask = torch.arange(length, device=q.device)[None, :] <= torch.arange(num_q, device=q.device)[:, None]
        if mask is not None:
            logits = logits.masked_fill(~mask.view(-1, 1, 1, num_q, length) if mask.dim() == 4 else ~mask, float("-inf"))
        probs = logits.softmax(-1)
        out = (probs @ values.float().permute(0, 2, 1, 3)[:, :, None]).permute(0, 3, 1, 2, 4).flatten(2, 3)  # [B, Q, H, Dv]
        valid = torch.zeros(b * num_q, dtype=torch.bool, device=q.device)
        valid[group.query_valid] = True
        voting = (torch.arange(num_q, device=q.device)[None, :] >= group.score_from[:, None]) & valid.view(b, num_q)
        votes = (probs * voting[:, None, None, :, None]).sum((2, 3))
        return out.flatten(0, 1)[group.query_valid].to(q.dtype), votes

    def attend(self, g: int, j: int, q: torch.Tensor, group: QueryGroup, scale: float, value_dims: int | None = None) -> torch.Tensor:
        """The group's valid queries' outputs [V, H, D], over the cache of layer j of KV group g (value_dims: the
        values are the keys' first dims, MLA)."""
        keys, values = self._keys_values(g, j, group, value_dims)
        repeat = q.shape[1] // keys.shape[2]
        if q.device.type == "cuda" and repeat > 1:  # CUDA's fused kernels take no enable_gqa; the math one is slow
            keys, values = keys.repeat_interleave(repeat, 2), values.repeat_interleave(repeat, 2)
        long_step = self.bf16_past is not None and q.shape[0] > self.bf16_past
        dtype = torch.bfloat16 if long_step and not group.is_decode else q.dtype
        queries = q[group.query_index].transpose(1, 2).to(dtype)
        o = F.scaled_dot_product_attention(
            queries, keys.transpose(1, 2).to(dtype), values.transpose(1, 2).to(dtype),
            attn_mask=group.masks[g], is_causal=group.is_causal and group.masks[g] is None, scale=scale, enable_gqa=keys.shape[2] != q.shape[1],
        )
        return o.transpose(1, 2).flatten(0, 1)[group.query_valid].to(q.dtype)

    def _keys_values(self, g: int, j: int, group: QueryGroup, value_dims: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's cached keys and values [B, L, KVH, D] (value_dims: the values are the keys' first dims, MLA)."""
        keys, values = self.cache.gather(j, group.block_tables[g])
        return keys, (values if value_dims is None else keys[..., :value_dims])
