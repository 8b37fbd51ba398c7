"""KIVI's 2-bit cache (Liu et al., 2024): keys quantized per channel across a block's tokens (key outliers
sit in fixed channels), values per token in groups of 32. A block's keys can only be packed once all its
tokens exist, so a kivi2 layout keeps each sequence's newest tokens in float blocks (the residual)."""
from __future__ import annotations

import torch

from kvserve.kv.formats import KVFormat, Part, affine_dequantize, affine_quantize, pack_bits, unpack_bits
from kvserve.kv.formats.int4 import PerTokenIntFormat


class PerChannelInt2Format(KVFormat):
    name, code, bits, per_token = "kivi2", 8, 2, False
    group = 32  # packing groups along head_dim

    def parts(self, block_size: int, heads: int, dim: int) -> dict[str, Part]:
        # meta: per block, head and channel, the scale (row 0) and minimum (row 1) over the block's tokens
        return {"data": Part((block_size, heads, dim // 4), torch.uint8),
                "meta": Part((heads, 2, dim), torch.float16)}

    def quantize_blocks(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, meta = affine_quantize(x, 2, 1)  # over the block's tokens: meta [n, 2, heads, dim]
        return {"data": pack_bits(codes, 2), "meta": meta.transpose(1, 2).contiguous()}

    def dequantize_blocks(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return affine_dequantize(unpack_bits(parts["data"], 2), parts["meta"].transpose(1, 2), 1, dtype)


KIVI2_KEYS = PerChannelInt2Format()
KIVI2_VALUES = PerTokenIntFormat("kivi2", 2, 7)
