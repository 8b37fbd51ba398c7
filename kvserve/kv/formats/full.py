"""Full-precision K/V in a float dtype: the exact cache."""
from __future__ import annotations

import torch

from kvserve.kv.formats import KVFormat, Part


class FloatFormat(KVFormat):
    def __init__(self, name: str, dtype: torch.dtype, code: int):
        self.name, self.dtype, self.code, self.bits = name, dtype, code, dtype.itemsize * 8

    def parts(self, block_size: int, heads: int, dim: int) -> dict[str, Part]:
        return {"data": Part((block_size, heads, dim), self.dtype)}

    def quantize_tokens(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"data": x.to(self.dtype)}

    def dequantize_tokens(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return parts["data"].to(dtype)


FLOAT32 = FloatFormat("float32", torch.float32, 0)
FLOAT16 = FloatFormat("float16", torch.float16, 1)
BFLOAT16 = FloatFormat("bfloat16", torch.bfloat16, 2)
