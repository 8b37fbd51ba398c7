"""MiniCache (Liu et al., 2024): from layer `start` on, each pair of adjacent layers caches one direction per token
and KV head, the SLERP of the two layers' directions (weight `t` on the deeper one), and each layer's own
magnitudes; a token whose two vectors lie further apart than `threshold` (angular distance over pi) keeps both
unmerged, up to `retain` such tokens per block and head (first come; the rest merge). KV bytes of the merged
layers roughly halve. It changes the KV layout, so it is chosen per engine, not per request.

The first layer of a pair writes its own direction (its queries attend to it exactly in that step); the second
merges the pair's directions at the same slots when it writes. A retained token keeps the first layer's direction
and stores the second layer's vector in the block's retention slots."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.errors import KVServeError
from kvserve.kv.formats import KVFormat
from kvserve.kv.policies import KVPolicy


def norm_dtype(fmt: KVFormat) -> torch.dtype:
    """Magnitudes: exact beside float32 K/V, half precision beside anything smaller."""
    return torch.float32 if fmt.bits >= 32 else torch.float16


@dataclass(frozen=True)
class MiniCache(KVPolicy):
    start: int = -1  # the first merged layer; -1: the middle one
    t: float = 0.6  # SLERP weight of the pair's second layer
    threshold: float = 0.25  # angular distance / pi above which a token is retained unmerged
    retain: int = 2  # retained tokens per block and KV head
    name = "minicache"
    merges_layers = True

    def validate(self) -> None:
        if not 0 <= self.t <= 1:
            raise KVServeError(f"kv_policy minicache: t is a SLERP weight in [0, 1], got {self.t}")
        if not 0 <= self.threshold <= 1:
            raise KVServeError(f"kv_policy minicache: threshold is an angular distance over pi in [0, 1], got {self.threshold}")
        if self.retain < 0:
            raise KVServeError(f"kv_policy minicache: retain must be >= 0 tokens per block, got {self.retain}")

    def check(self, block_size: int) -> None:
        if self.retain > block_size:
            raise KVServeError(f"kv_policy minicache: retain ({self.retain}) is more than a block's {block_size} tokens")

    def at(self, num_layers: int) -> MiniCache:
        """This policy with its start layer resolved and checked for a model of `num_layers` layers."""
        start = num_layers // 2 if self.start == -1 else self.start
        if num_layers < 2:
            raise KVServeError(f"kv_policy minicache merges pairs of layers; this model has {num_layers}")
        if not 0 <= start <= num_layers - 2:
            given = self.start if self.start != -1 else f"the default, the middle layer ({start})"
            raise KVServeError(f"kv_policy minicache: start must be a layer in [0, {num_layers - 2}] (a pair must follow it), "
                               f"got {given}")
        return MiniCache(start, self.t, self.threshold, self.retain)

    def pairs(self, num_layers: int) -> list[tuple[int, int]]:
        return [(a, a + 1) for a in range(self.start, num_layers - 1, 2)]

    def pair_bytes(self, fmt: KVFormat, block_size: int, heads: int, dim: int) -> int:
        """Bytes of one block of a pair's K or V: directions, both layers' magnitudes, the retained vectors and their offsets."""
        return (fmt.block_bytes(block_size, heads, dim) + block_size * 2 * heads * norm_dtype(fmt).itemsize
                + fmt.block_bytes(self.retain, heads, dim) + self.retain * heads * 2)


def slerp(u: torch.Tensor, w: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation of unit vectors along the last dim (linear where they are nearly parallel)."""
    omega = torch.arccos((u * w).sum(-1, keepdim=True).clamp(-1, 1))
    sin = omega.sin()
    near = sin < 1e-4
    a = torch.where(near, 1 - t, ((1 - t) * omega).sin() / sin.clamp(min=1e-4))
    b = torch.where(near, t, (t * omega).sin() / sin.clamp(min=1e-4))
    e = a * u + b * w
    return e / e.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def unit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., dim] as directions and magnitudes."""
    norm = x.norm(dim=-1)
    return x / norm.clamp(min=1e-12)[..., None], norm


class MergedStore:
    """K or V of one merged layer pair: [num_blocks, ...] tensors, so swaps and block copies treat them like any
    other cache tensor."""

    def __init__(self, policy: MiniCache, fmt: KVFormat, num_blocks: int, block_size: int, heads: int, dim: int, device):
        self.policy, self.fmt, self.block_size = policy, fmt, block_size
        self.direction = fmt.allocate(num_blocks, block_size, heads, dim, device)
        self.norm = torch.zeros((num_blocks, block_size, 2, heads), dtype=norm_dtype(fmt), device=device)
        self.kept = fmt.allocate(num_blocks, policy.retain, heads, dim, device)
        self.kept_at = torch.full((num_blocks, policy.retain, heads), -1, dtype=torch.int16, device=device)  # offset in block; -1: none
        self._direction_flat = {n: t.flatten(0, 1) for n, t in self.direction.items()}
        self._norm_flat = self.norm.flatten(0, 1)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.direction.values(), self.norm, *self.kept.values(), self.kept_at]

    def write(self, which: int, x: torch.Tensor, slots: torch.Tensor) -> None:
        """x [T, heads, dim] of layer `which` (0: the pair's first, 1: its second) at their slots."""
        direction, norm = unit(x.float())
        self._norm_flat[slots, which] = norm.to(self.norm.dtype)
        if which == 1:
            first = self.fmt.dequantize_tokens({n: t.index_select(0, slots) for n, t in self._direction_flat.items()}, torch.float32)
            far = torch.arccos((first * direction).sum(-1).clamp(-1, 1)) / math.pi > self.policy.threshold
            retained = self._retain(far, x, slots)
            direction = torch.where(retained[..., None], first, slerp(first, direction, self.policy.t))
        for n, part in self.fmt.quantize_tokens(direction).items():
            self._direction_flat[n].index_copy_(0, slots, part)

    def _retain(self, far: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Store the far tokens that fit their block's retention slots (in order of offset); returns which were [T, heads].
        Entries at or past the first offset this step writes in a block are stale (the block was given back and
        reused, or tokens rolled back), so they are dropped first."""
        bs, retain = self.block_size, self.policy.retain
        if retain == 0:
            return torch.zeros_like(far)
        slots, order = slots.sort()
        far, blocks, offsets = far[order], slots // bs, slots % bs
        touched, group = torch.unique_consecutive(blocks, return_inverse=True)
        first = torch.full_like(touched, bs).scatter_reduce_(0, group, offsets, "amin")
        at = self.kept_at[touched]
        at = torch.where(at >= first[:, None, None], -1, at)
        self.kept_at[touched] = at
        before = far.long().cumsum(0) - far.long()  # far tokens earlier in the step, per head
        starts = torch.ones_like(group, dtype=torch.bool)
        starts[1:] = group[1:] != group[:-1]
        position = (at >= 0).sum(1)[group] + before - before[starts][group]  # [T, heads]
        retained = far & (position < retain)
        t, h = retained.nonzero(as_tuple=True)
        self.kept_at[blocks[t], position[t, h], h] = offsets[t].to(torch.int16)
        for n, part in self.fmt.quantize_tokens(x[order][t, h][:, None]).items():
            self.kept[n][blocks[t], position[t, h], h] = part[:, 0]
        unsorted = torch.empty_like(retained)
        unsorted[order] = retained
        return unsorted

    def gather(self, which: int, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Layer `which`'s values of the blocks `ids` [n], as [n, block_size, heads, dim]."""
        x = self.fmt.dequantize_blocks({n: t.index_select(0, ids) for n, t in self.direction.items()}, torch.float32)
        x = x * self.norm.index_select(0, ids)[:, :, which, :, None].float()
        if which == 0 or self.policy.retain == 0:
            return x.to(dtype)
        kept = self.fmt.dequantize_blocks({n: t.index_select(0, ids) for n, t in self.kept.items()}, torch.float32)
        at = self.kept_at.index_select(0, ids).long()  # [n, retain, heads]
        at = torch.where(at >= 0, at, self.block_size)[..., None].expand_as(kept)  # empty entries land in a spare row
        x = torch.cat([x, x[:, :1]], 1).scatter_(1, at, kept)[:, :self.block_size]
        return x.to(dtype)
