from __future__ import annotations

import torch

from kvserve.config import ModelConfig


class KVCache:
    """Every layer's K and V for a pool of `num_blocks` blocks of `block_size` token slots.

    A token's slot is block_id * block_size + offset; the model writes new K/V at their slots and reads
    a sequence's K/V a whole block at a time through its block table. Keys are stored after RoPE.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._k_slots, self._v_slots = self.k.flatten(1, 2), self.v.flatten(1, 2)  # [layers, slots, heads, dim] views

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self._k_slots[layer].index_copy_(0, slots, k.to(self.dtype))
        self._v_slots[layer].index_copy_(0, slots, v.to(self.dtype))

    def read(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks in `block_tables` ([batch, blocks]) as [batch, blocks * block_size, kv_heads, head_dim]."""
        flat = block_tables.reshape(-1)
        shape = (block_tables.shape[0], -1, *self.k.shape[3:])
        return self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(shape)

    def copy_out(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks' K/V copied to CPU memory (swap-out for preemption)."""
        ids = torch.tensor(block_ids, device=self.k.device)
        return self.k[:, ids].to("cpu", copy=True), self.v[:, ids].to("cpu", copy=True)

    def copy_in(self, block_ids: list[int], kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        ids = torch.tensor(block_ids, device=self.k.device)
        self.k[:, ids] = kv[0].to(self.k.device)
        self.v[:, ids] = kv[1].to(self.v.device)
