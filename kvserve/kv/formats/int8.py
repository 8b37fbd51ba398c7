"""int8 K/V, symmetric: one fp16 scale per group of 32 values along head_dim (1.0625 bytes per value)."""
from __future__ import annotations

import torch

from kvserve.kv.formats import KVFormat, Part


class Int8Format(KVFormat):
    name, code, bits, group = "int8", 5, 8, 32

    def parts(self, block_size: int, heads: int, dim: int) -> dict[str, Part]:
        return {"data": Part((block_size, heads, dim), torch.int8),
                "scale": Part((block_size, heads, dim // self.group), torch.float16)}

    def quantize_tokens(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        g = x.float().unflatten(-1, (-1, self.group))
        scale = (g.abs().amax(-1, keepdim=True) / 127).half().float()
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        data = (g * inv).round_().clamp_(-127, 127).to(torch.int8).flatten(-2)
        return {"data": data, "scale": scale.squeeze(-1).half()}

    def dequantize_tokens(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        g = parts["data"].float().unflatten(-1, (-1, self.group))
        return (g * parts["scale"].float().unsqueeze(-1)).flatten(-2).to(dtype)


INT8 = Int8Format()
