"""fp8 K/V with a per-tensor scale of 1 (vLLM's default without calibration): values past the format's
range saturate at its largest finite value instead of becoming NaN. Stored as raw bytes (uint8): torch's
CPU copy and gather ops do not take float8 tensors."""
from __future__ import annotations

import torch

from kvserve.kv.formats import KVFormat, Part


class FP8Format(KVFormat):
    bits = 8

    def __init__(self, name: str, dtype: torch.dtype, code: int):
        self.name, self.dtype, self.code = name, dtype, code
        self.max = torch.finfo(dtype).max

    def parts(self, block_size: int, heads: int, dim: int) -> dict[str, Part]:
        return {"data": Part((block_size, heads, dim), torch.uint8)}

    def quantize_tokens(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"data": x.float().clamp(-self.max, self.max).to(self.dtype).view(torch.uint8)}

    def dequantize_tokens(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return parts["data"].view(self.dtype).to(dtype)


FP8_E4M3 = FP8Format("fp8_e4m3", torch.float8_e4m3fn, 3)
FP8_E5M2 = FP8Format("fp8_e5m2", torch.float8_e5m2, 4)
