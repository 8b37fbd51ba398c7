"""The CUDA backend: decode queries attend over their blocks in place (a Triton kernel), where SDPA would gather
every sequence's whole context into a new tensor each layer; in a step of decodes only, the new K/V are written
at their slots by a second kernel. At small batches long contexts are split over programs (flash-decoding). A
chain of guesses counts as decodes (the runner makes each guess a query row over its own context); prefill
chunks, votes and quantized, merged or latent layouts run as SDPA; a tree of guesses' rows attend in place too,
each skipping the keys of its tree's other branches. A decode-only step has fixed shapes
and no host syncs, so it can be captured as a CUDA graph (engine/cuda_graphs.py)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvserve.attention import ForwardContext, QueryGroup
from kvserve.attention.sdpa import SDPABackend
from kvserve.kv.cache import KVCache
from kvserve.kv.formats.full import FloatFormat

# Keys x head dims of one tile of K (and one of V) a program holds: 128 keys at head dim 64. Measured on an H200
# (a sweep of tiles of 16-128 keys and 1-8 warps, SmolLM2's 9/3 heads, 256 and 2,048 keys, batch 1 and 64): 128
# keys and 4 warps were fastest everywhere: 1.5-2.3x the speed of 32-key tiles whose products were summed without tl.dot.
TILE_ELEMENTS = 8192
# Where a step has fewer (sequence, KV head) pairs than the GPU has multiprocessors, each context is split into
# spans of SPLIT_KEYS keys, a program each, and a second kernel combines their partial softmaxes (flash-decoding):
# at batch 1 one program per KV head would read a long context alone while most of the GPU idles.
SPLIT_KEYS = 256


class CUDABackend(SDPABackend):
    def __init__(self, cache: KVCache):
        super().__init__(cache)
        self.windows = cache.layout.windows

    @staticmethod
    def supports(cache: KVCache) -> bool:
        """Whether every layer's K and V are plain floats in one tensor each (not quantized, residual, merged or latent)."""
        layout = cache.layout
        return (isinstance(layout.k_format, FloatFormat) and isinstance(layout.v_format, FloatFormat) and not layout.has_residual
                and not cache.merged and all(cache.v))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, ctx: ForwardContext, scale: float,
                value_dims: int | None = None) -> torch.Tensor:
        group = ctx.groups[0]
        if len(ctx.groups) > 1 or not group.in_order or not in_place(group):  # SDPA's writes, then attend per group
            return super().forward(layer, q, k, v, ctx, scale, value_dims)
        g, j = self.cache.slot[layer]
        keys, values = self.cache.k[j]["data"], self.cache.v[j]["data"]
        write_slots(keys, k, ctx.slot_mappings[g])
        write_slots(values, v, ctx.slot_mappings[g])
        return paged_decode(q, keys, values, group.block_tables[g], group.context_lens[g], scale, self.windows[g], hidden=group.hidden)

    def attend(self, g: int, j: int, q: torch.Tensor, group: QueryGroup, scale: float, value_dims: int | None = None) -> torch.Tensor:
        """A step's decodes beside prefill chunks attend in place too."""
        if not in_place(group):
            return super().attend(g, j, q, group, scale, value_dims)
        return paged_decode(q[group.query_index[:, 0]], self.cache.k[j]["data"], self.cache.v[j]["data"], group.block_tables[g],
                            group.context_lens[g], scale, self.windows[g], hidden=group.hidden)


def in_place(group: QueryGroup) -> bool:
    """Whether paged_decode serves this group: one query a row (a tree's guesses too), none voting."""
    return group.is_decode and group.score_from is None


def write_slots(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    """x [T, heads, dim] into cache [blocks, block size, heads, dim] at slots [T]; a negative slot writes nothing
    (a CUDA graph's padding rows)."""
    x, width = x.to(cache.dtype), x.shape[1] * x.shape[2]  # torch's rounding, as the float format's (a no-op where equal)
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2] and cache.is_contiguous()
    _write_slots[(x.shape[0],)](x, cache, slots, x.stride(0), WIDTH=width, WIDTH_P=triton.next_power_of_2(width))


def paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, window: int | None, span: int | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, q [B, heads, dim], over the first context_lens[b] keys of its blocks (the last
    `window` of them where given); keys and values [blocks, block size, kv heads, dim]. Returns [B, heads, dim].
    `span`: keys per program, 0 for one program per sequence and KV head; None: split_span's choice. `hidden` [B]
    int64: bit j set, query b skips the key j + 1 slots before its own (a tree's other branches; QueryGroup.hidden),
    and its window counts the keys it sees."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[2]
    rep = heads // kv_heads
    dim_p = max(triton.next_power_of_2(dim), 16)
    tile = max(16, min(128, TILE_ELEMENTS // dim_p))
    max_keys = block_tables.shape[1] * keys.shape[1]
    span = split_span(batch, kv_heads, max_keys, q.device) if span is None else span
    splits = -(-max_keys // span) if span else 1
    assert values.stride() == keys.stride() and span % tile == 0
    out = torch.empty_like(q)
    parts = torch.empty(batch, heads, splits, dim_p + 2, dtype=torch.float32, device=q.device) if splits > 1 else out
    hidden = _no_skips(batch, q.device) if hidden is None else hidden  # one kernel variant for all steps (see below)
    _paged_decode[(batch, kv_heads, splits)](
        q, keys, values, out, parts, block_tables, context_lens, hidden, scale, window or 0,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        REP=rep, REP_P=max(triton.next_power_of_2(rep), 16), DIM=dim, DIM_P=dim_p, BLOCK_SIZE=keys.shape[1], TILE=tile,
        SPAN=span if splits > 1 else 0, num_warps=4)
    if splits > 1:
        _combine[(batch, heads)](parts, out, splits, out.stride(0), out.stride(1), DIM=dim, DIM_P=dim_p, CHUNK=16)
    return out


_NO_SKIPS: dict[torch.device, torch.Tensor] = {}


def _no_skips(batch: int, device: torch.device) -> torch.Tensor:
    """[batch] zeros: rows that skip no keys (one buffer a device, grown as needed)."""
    zeros = _NO_SKIPS.get(device)
    if zeros is None or len(zeros) < batch:
        zeros = _NO_SKIPS[device] = torch.zeros(max(batch, 256), dtype=torch.long, device=device)
    return zeros[:batch]


def split_span(batch: int, kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Keys per program for a step of `batch` sequences whose tables hold up to max_keys keys: SPLIT_KEYS where
    one program per (sequence, KV head) would leave multiprocessors idle and a context may span more than that,
    else 0 (no split)."""
    return SPLIT_KEYS if max_keys > SPLIT_KEYS and batch * kv_heads < _multiprocessors(device) else 0


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessors; on the CPU (Triton's interpreter: tests) an H100's 132."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@triton.jit
def _write_slots(x_ptr, cache_ptr, slots_ptr, stride_x, WIDTH: tl.constexpr, WIDTH_P: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    i = tl.arange(0, WIDTH_P)
    mask = i < tl.where(slot >= 0, WIDTH, 0)
    x = tl.load(x_ptr + token * stride_x + i, mask=mask)
    tl.store(cache_ptr + slot * WIDTH + i, x, mask=mask)


# Triton compiles a variant per class of each int argument (1, a multiple of 16, other) and per constexpr: the
# tables' row stride (their width, the step's longest context) and the window would give a step's decodes beside
# prefill chunks variants of their own, each compiled mid-run (a second or so) after the graphs' one at start-up.
# So every call passes masks of skipped keys (zeros but in a tree's steps), not a switch.
@triton.jit(do_not_specialize=["window", "stride_tb"])
def _paged_decode(q_ptr, k_ptr, v_ptr, out_ptr, parts_ptr, tables_ptr, lens_ptr, hidden_ptr, scale, window,
                  stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ot, stride_oh,
                  REP: tl.constexpr, REP_P: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPAN: tl.constexpr):
    # One program per (sequence, KV head[, span of SPAN keys]): the query heads sharing that KV head (padded to the
    # 16 rows a dot needs) read each key once. Online softmax over tiles of keys, in fp32 (ieee: no tf32 rounding).
    # Split (SPAN > 0), a program leaves its unnormalized sums, running max and total to _combine. The query skips
    # the keys its mask's bits name (a tree's other branches), and its window reaches back past as many.
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(lens_ptr + b)
    mask_bits = tl.load(hidden_ptr + b)
    skipped = tl.sum((mask_bits >> tl.arange(0, 64).to(tl.int64)) & 1)
    first = tl.where(window > 0, tl.maximum(length - window - skipped, 0), 0)
    lo, hi = first // TILE * TILE, length
    if SPAN > 0:
        lo, hi = tl.maximum(lo, tl.program_id(2) * SPAN), tl.minimum(hi, (tl.program_id(2) + 1) * SPAN)
    r = tl.arange(0, REP_P)
    d = tl.arange(0, DIM_P)
    heads = h * REP + r
    head_mask = (r < REP)[:, None] & (d < DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=head_mask, other=0.0).to(tl.float32)
    best = tl.full([REP_P], float("-inf"), tl.float32)
    total = tl.zeros([REP_P], tl.float32)
    acc = tl.zeros([REP_P, DIM_P], tl.float32)
    for start in range(lo, hi, TILE):
        t = start + tl.arange(0, TILE)
        back = length - 1 - t  # the key `back` slots before the query's own: mask bit back - 1
        named = (back >= 1) & (back <= 64)
        valid = (t >= first) & (t < hi) & ~(named & (((mask_bits >> tl.where(named, back - 1, 0)) & 1) != 0))
        block = tl.load(tables_ptr + b * stride_tb + t // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        at = block * stride_kb + (t % BLOCK_SIZE) * stride_ks + h * stride_kh
        kv_mask = valid[:, None] & (d < DIM)[None, :]
        k = tl.load(k_ptr + at[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [TILE, DIM_P]
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [REP_P, TILE]
        s = tl.where(valid[None, :], s, float("-inf"))
        new_best = tl.maximum(best, tl.max(s, 1))
        p = tl.exp(s - new_best[:, None])
        shrink = tl.exp(best - new_best)
        total = total * shrink + tl.sum(p, 1)
        v = tl.load(v_ptr + at[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * shrink[:, None] + tl.dot(p, v, input_precision="ieee")
        best = new_best
    if SPAN > 0:  # parts [B, heads, splits, DIM_P + 2]: the sums, then the max and the total
        row = ((b * tl.num_programs(1) * REP + heads) * tl.num_programs(2) + tl.program_id(2)) * (DIM_P + 2)
        tl.store(parts_ptr + row[:, None] + d[None, :], acc, mask=(r < REP)[:, None] & (d < DIM_P)[None, :])
        tl.store(parts_ptr + row + DIM_P, best, mask=r < REP)
        tl.store(parts_ptr + row + DIM_P + 1, total, mask=r < REP)
    else:
        acc = acc / tl.where(total > 0, total, 1.0)[:, None]  # a padding row (no keys) gives zeros
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=head_mask)


@triton.jit(do_not_specialize=["splits"])  # the eager steps' count varies with their longest context
def _combine(parts_ptr, out_ptr, splits, stride_ot, stride_oh, DIM: tl.constexpr, DIM_P: tl.constexpr, CHUNK: tl.constexpr):
    # One program per (sequence, query head): the spans' partial softmaxes, rescaled to their common max.
    b = tl.program_id(0)
    h = tl.program_id(1)
    rows = (b * tl.num_programs(1) + h) * splits
    d = tl.arange(0, DIM_P)
    best = tl.full([CHUNK], float("-inf"), tl.float32)
    for first in range(0, splits, CHUNK):
        c = first + tl.arange(0, CHUNK)
        best = tl.maximum(best, tl.load(parts_ptr + (rows + c) * (DIM_P + 2) + DIM_P, mask=c < splits, other=float("-inf")))
    most = tl.max(best, 0)
    most = tl.where(most > float("-inf"), most, 0.0)  # no keys anywhere (a padding row): every weight 0
    acc = tl.zeros([DIM_P], tl.float32)
    total = tl.zeros([CHUNK], tl.float32)
    for first in range(0, splits, CHUNK):
        c = first + tl.arange(0, CHUNK)
        at = (rows + c) * (DIM_P + 2)
        part_best = tl.load(parts_ptr + at + DIM_P, mask=c < splits, other=float("-inf"))
        weight = tl.exp(part_best - most)  # 0 for a span with no keys
        total += weight * tl.load(parts_ptr + at + DIM_P + 1, mask=c < splits, other=0.0)
        has_keys = (part_best > float("-inf"))[:, None] & (d < DIM_P)[None, :]
        sums = tl.load(parts_ptr + at[:, None] + d[None, :], mask=has_keys, other=0.0)
        acc += tl.sum(weight[:, None] * sums, 0)
    total_all = tl.sum(total, 0)
    acc = acc / tl.where(total_all > 0, total_all, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, acc.to(out_ptr.dtype.element_ty), mask=d < DIM)
