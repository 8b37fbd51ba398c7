"""The KV tensors, shaped by the layout.

For the i-th layer of every layer group (groups share tensors), K and V each have one tensor per part of
their format, [num_blocks, *part shape]. A kivi2 layout adds float tensors for the residual pool, whose
block ids follow the main pool's. A token's slot is block_id * block_size + offset. Every write, read,
pack and swap of cached values goes through this class.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kvserve.config import EngineConfig, memory_share, parse_size
from kvserve.errors import KVServeError
from kvserve.kv.formats import KVFormat
from kvserve.kv.policies.minicache import MergedStore
from kvserve.kv.spec import KVLayout

Store = dict[str, torch.Tensor]  # a format's parts for one layer's K or V
# How read_blocks lays out a block's bytes. A disk or Redis tier outlives the process and checks only an entry's
# length and tokens, so a change to that layout must change this number (it is in every prefix hash).
BLOCK_BYTES_VERSION = 1


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, num_residual: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.layout, self.num_blocks, self.num_residual, self.dtype = layout, num_blocks, num_residual, dtype
        self.block_size = layout.block_size
        self.slot = {layer: (g, j) for g, group in enumerate(layout.groups) for j, layer in enumerate(group.layers)}
        spec, n, bs = layout.groups[0].spec, layout.layers_per_group, layout.block_size
        heads = spec.num_heads
        # MiniCache: a merged layer pair's K and V stores, and which of the pair each layer is (one group: j is the layer)
        self.merged: dict[int, tuple[MergedStore, MergedStore, int]] = {}
        for a, b in layout.merge.pairs(n) if layout.merge else ():
            stores = tuple(MergedStore(layout.merge, fmt, num_blocks, bs, heads, spec.k_dim, device)
                           for fmt in (layout.k_format, layout.v_format))
            self.merged[a], self.merged[b] = (*stores, 0), (*stores, 1)
        self.k = [{} if j in self.merged else layout.k_format.allocate(num_blocks, bs, heads, spec.k_dim, device) for j in range(n)]
        self.v = [layout.v_format.allocate(num_blocks, bs, heads, spec.v_dim, device) if spec.v_dim and j not in self.merged else {}
                  for j in range(n)]
        self.residual_k = self.residual_v = None
        if layout.has_residual:
            self.residual_k = [layout.residual_format.allocate(num_residual, bs, heads, spec.k_dim, device) for _ in range(n)]
            self.residual_v = [layout.residual_format.allocate(num_residual, bs, heads, spec.v_dim, device) for _ in range(n)]
        self._main = [t for stores in (self.k, self.v) for store in stores for t in store.values()]
        self._main += [t for j, (k, v, which) in self.merged.items() if which == 0 for store in (k, v) for t in store.tensors]
        # what writes go to, per layer of a group: (format, {part: [slots, ...] view}) for K and for V
        write_k, write_v = (self.residual_k, self.residual_v) if layout.has_residual else (self.k, self.v)
        formats = (layout.residual_format,) * 2 if layout.has_residual else (layout.k_format, layout.v_format)
        self._writes = [[(fmt, {name: t.flatten(0, 1) for name, t in store.items()}) for fmt, store in zip(formats, stores)]
                        for stores in zip(write_k, write_v)]
        self._residual = [t for stores in (self.residual_k or [], self.residual_v or []) for store in stores for t in store.values()]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._main + self._residual)

    @property
    def device(self) -> torch.device:
        return self._main[0].device

    def write(self, j: int, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor) -> None:
        """K/V [T, heads, dim] of new tokens at their slots, in the j-th layer of a group (v None: a latent layer)."""
        if j in self.merged:
            k_store, v_store, which = self.merged[j]
            k_store.write(which, k, slots)
            v_store.write(which, v, slots)
            return
        if self.residual_k is not None:  # new tokens always land in residual blocks
            slots = slots - self.num_blocks * self.block_size
        for (fmt, views), x in zip(self._writes[j], (k, v) if v is not None else (k,)):
            for name, part in fmt.quantize_tokens(x).items():
                views[name].index_copy_(0, slots, part)

    def gather(self, j: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks in `block_tables` ([batch, blocks]), dequantized, as [batch, blocks * block_size, heads, dim]."""
        flat = block_tables.reshape(-1)
        if j in self.merged:
            k_store, v_store, which = self.merged[j]
            return tuple(store.gather(which, flat, self.dtype).flatten(0, 1).unflatten(0, (block_tables.shape[0], -1))
                         for store in (k_store, v_store))
        keys = self._gather(self.k[j], self.layout.k_format, self.residual_k, j, flat)
        if not self.v[j]:  # a latent layer: its values are part of its keys
            keys = keys.unflatten(0, (block_tables.shape[0], -1))
            return keys, keys
        values = self._gather(self.v[j], self.layout.v_format, self.residual_v, j, flat)
        return keys.unflatten(0, (block_tables.shape[0], -1)), values.unflatten(0, (block_tables.shape[0], -1))

    def _gather(self, store: Store, fmt: KVFormat, residual: list[Store] | None, j: int, ids: torch.Tensor) -> torch.Tensor:
        if residual is None:
            return fmt.dequantize_blocks({name: t.index_select(0, ids) for name, t in store.items()}, self.dtype).flatten(0, 1)
        in_residual = ids >= self.num_blocks
        main = fmt.dequantize_blocks({name: t.index_select(0, ids.clamp(max=self.num_blocks - 1)) for name, t in store.items()}, self.dtype)
        floats = residual[j]["data"].index_select(0, (ids - self.num_blocks).clamp(min=0)).to(self.dtype)
        return torch.where(in_residual[:, None, None, None], floats, main).flatten(0, 1)

    def compact(self, sources: list[list[int]], dests: list[list[int]], keep: torch.Tensor, shift=None) -> None:
        """Move each layer's kept tokens to the front of a sequence's cache: `keep` [layers or 1, heads or 1, n] are
        slots of the blocks in `sources` (per group); they go to slots 0..n-1 of the blocks in `dests`. shift(k, by)
        re-positions moved keys by `by` [n, heads] positions (RoPE), for a policy whose positions are slots."""
        n, heads, bs, dev = keep.shape[-1], self.layout.groups[0].spec.num_heads, self.block_size, self.device
        keep = keep.to(dev)
        new = torch.arange(n, device=dev)
        for g, group in enumerate(self.layout.groups):
            src = torch.tensor(sources[g], device=dev)[None]
            dst = torch.tensor(dests[g], device=dev)
            slots = dst[new // bs] * bs + new % bs
            for j, layer in enumerate(group.layers):
                index = keep[min(layer, keep.shape[0] - 1)].expand(heads, n).T  # [n, heads]
                keys, values = self.gather(j, src)
                k = keys[0].gather(0, index[..., None].expand(-1, -1, keys.shape[-1]))
                if shift is not None:
                    k = shift(k, new[:, None] - index)
                v = values[0].gather(0, index[..., None].expand(-1, -1, values.shape[-1])) if self.v[j] else None
                self.write(j, k, v, slots)

    def move(self, sources: list[torch.Tensor], dests: list[torch.Tensor]) -> None:
        """Copy tokens' K/V as stored (every part of the format new tokens are written in) from slots to slots,
        per layer group (a tree of guesses' kept branch, to the slots after the newest token's)."""
        offset = self.num_blocks * self.block_size if self.residual_k is not None else 0  # written slots lie in the residual pool
        for src, dst in zip(sources, dests):
            src, dst = src - offset, dst - offset
            for j in range(self.layout.layers_per_group):
                for _, views in self._writes[j]:
                    for view in views.values():
                        view.index_copy_(0, dst, view.index_select(0, src))

    def pack(self, pairs: list[tuple[int, int]]) -> None:
        """Quantize residual blocks into main blocks: (residual id, main id) pairs."""
        src = torch.tensor([s - self.num_blocks for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        layout = self.layout
        for j in range(layout.layers_per_group):
            for store, fmt, residual in ((self.k[j], layout.k_format, self.residual_k[j]), (self.v[j], layout.v_format, self.residual_v[j])):
                for name, part in fmt.quantize_blocks(residual["data"].index_select(0, src)).items():
                    store[name].index_copy_(0, dst, part)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks within their pool: (source, destination) pairs (a forked completion's last block)."""
        src, dst = (self._split([p[i] for p in pairs]) for i in (0, 1))
        for tensors, s, d in ((self._main, src[0], dst[0]), (self._residual, src[1], dst[1])):
            if len(s):
                for t in tensors:
                    t.index_copy_(0, d, t.index_select(0, s))

    def copy_out(self, block_ids: list[int]) -> list[torch.Tensor]:
        """The blocks' values copied to CPU memory (swap-out for preemption)."""
        main, residual = self._split(block_ids)
        return [t[main].to("cpu", copy=True) for t in self._main] + [t[residual].to("cpu", copy=True) for t in self._residual]

    def copy_in(self, block_ids: list[int], saved: list[torch.Tensor]) -> None:
        """Values saved by copy_out into blocks of the same pools, in the same order."""
        main, residual = self._split(block_ids)
        targets = [(t, main) for t in self._main] + [(t, residual) for t in self._residual]
        for (t, ids), values in zip(targets, saved):
            t[ids] = values.to(t.device)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one main-pool block's values, every layer's: what a KV tier holds per block."""
        return sum(t[0].nbytes for t in self._main)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Main-pool blocks' values as bytes, one string per block (for a KV tier)."""
        ids = torch.tensor(block_ids, device=self.device, dtype=torch.long)
        rows = torch.cat([_rows(t).index_select(0, ids).view(torch.uint8) for t in self._main], 1)
        return [row.tobytes() for row in rows.cpu().numpy()]

    def write_blocks(self, blocks: list[tuple[int, bytes]]) -> None:
        """read_blocks' bytes back into main-pool blocks: (block id, bytes) pairs, in order (a later pair wins)."""
        latest = dict(blocks)
        ids = torch.tensor(list(latest), device=self.device, dtype=torch.long)
        rows = torch.frombuffer(bytearray().join(latest.values()), dtype=torch.uint8).view(len(latest), -1).to(self.device)
        for t, part in zip(self._main, rows.split([t[0].nbytes for t in self._main], 1)):
            target = _rows(t)
            target.index_copy_(0, ids, part.contiguous().view(target.dtype))

    def _split(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(block_ids, device=self.device, dtype=torch.long)
        return ids[ids < self.num_blocks], ids[ids >= self.num_blocks] - self.num_blocks


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A cache tensor's blocks as rows of their bytes, the same memory, 8 to an element where they divide: index_copy_
    copies element by element (140 blocks of SmolLM2's fp16 cache: 8.7 ms as int64, 22-36 ms as bytes)."""
    rows = t.view(t.shape[0], -1).view(torch.uint8)
    return rows.view(torch.int64) if rows.shape[1] % 8 == 0 else rows


def pool_sizes(layout: KVLayout, config: EngineConfig, max_model_len: int) -> tuple[int, int]:
    """Main and residual blocks from kv_cache_memory, once the weights are loaded. A share of free memory gives
    no more blocks than max_num_seqs requests of max_model_len tokens fill. A kivi2 layout sets aside float blocks
    for its requests' newest tokens (a step's new tokens are all residual until the step ends): enough for
    max_num_seqs requests, but at most half the budget (a lack of residual blocks then preempts, like a lack of
    main ones), and never less than one request needs."""
    if config.num_blocks and not layout.has_residual:  # no budget to read (nor free memory to measure)
        return config.num_blocks, 0
    share, num_residual = memory_share(config.kv_cache_memory), 0
    budget = int(share * free_memory(config.torch_device)) if share else parse_size(config.kv_cache_memory)
    if layout.has_residual:
        bs, groups, res_bytes = layout.block_size, len(layout.groups), layout.block_bytes(residual=True)
        one = (layout.residual_tokens // bs + 2) * groups  # the window and a partial block at each end
        step = -(-config.max_num_batched_tokens // bs) * groups
        num_residual = max(one + step, min(config.max_num_seqs * one + step, budget // 2 // res_bytes))
    if config.num_blocks:
        return config.num_blocks, num_residual
    num_blocks = (budget - num_residual * layout.block_bytes(residual=True)) // layout.block_bytes()
    if share:
        num_blocks = min(num_blocks, config.max_num_seqs * -(-max_model_len // layout.block_size) * len(layout.groups))
    if num_blocks < len(layout.groups):
        raise KVServeError(f"kv_cache_memory {config.kv_cache_memory} ({budget} bytes) is smaller than one block per layer group "
                           f"({layout.block_bytes()} bytes)" + (f" after the kivi2 residual's {num_residual} float blocks "
                           f"({num_residual * layout.block_bytes(residual=True)} bytes)" if num_residual else ""))
    return int(num_blocks), num_residual


def check_pool_fits(layout: KVLayout, num_blocks: int, num_residual: int, device: torch.device) -> None:
    """Refuse a pool larger than the device's free memory before mapping it: on CPU the map failed with ENOMEM, or
    succeeded and the kernel killed the process once the pool's pages filled."""
    need = num_blocks * layout.block_bytes() + num_residual * layout.block_bytes(residual=True)
    if device.type == "cpu" and not Path("/proc/meminfo").is_file():
        return
    if need > (free := free_memory(device)):
        raise KVServeError(f"a KV pool of {num_blocks} blocks needs {need / 2**30:.2f} GiB, but {free / 2**30:.2f} GiB of "
                           f"{device.type} memory is free: lower num_blocks or kv_cache_memory")


def free_memory(device: torch.device) -> int:
    """Bytes a new allocation can take on the device: on CUDA the driver's free memory plus what torch's
    caching allocator holds unused; on CPU the kernel's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KVServeError("kv_cache_memory as a share needs /proc/meminfo's MemAvailable on CPU; give a size such as 2GiB")
