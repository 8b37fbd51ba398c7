"""int4 K/V, asymmetric: fp16 scale and minimum per group of 32 values along head_dim (0.625 bytes per value)."""
from __future__ import annotations

import torch

from kvserve.kv.formats import KVFormat, Part, affine_dequantize, affine_quantize, pack_bits, unpack_bits


class PerTokenIntFormat(KVFormat):
    """`bits`-bit codes per token, asymmetric, in groups of 32 along head_dim."""

    group = 32

    def __init__(self, name: str, bits: int, code: int):
        self.name, self.bits, self.code = name, bits, code

    def parts(self, block_size: int, heads: int, dim: int) -> dict[str, Part]:
        return {"data": Part((block_size, heads, dim * self.bits // 8), torch.uint8),
                "meta": Part((block_size, heads, dim // self.group, 2), torch.float16)}

    def quantize_tokens(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, meta = affine_quantize(x.unflatten(-1, (-1, self.group)), self.bits, -1)
        return {"data": pack_bits(codes.flatten(-2), self.bits), "meta": meta}

    def dequantize_tokens(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_bits(parts["data"], self.bits).unflatten(-1, (-1, self.group))
        return affine_dequantize(codes, parts["meta"], -1, dtype).flatten(-2)


INT4 = PerTokenIntFormat("int4", 4, 6)
