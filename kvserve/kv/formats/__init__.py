"""How K or V values are stored in a block: full precision, fp8, or integers with scales.

A format names the tensors ("parts") one block holds, turns float K/V into them and back. Per-token
formats quantize each token on its own (written at its slot as it is computed); a per-channel format
(KIVI's keys) quantizes a whole block at once, so its layout keeps the newest tokens in float blocks
until a block is full and old enough to pack.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve import hugepages
from kvserve.config import KV_CACHE_DTYPES
from kvserve.errors import KVServeError


@dataclass(frozen=True, slots=True)
class Part:
    shape: tuple[int, ...]  # per block
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class KVFormat:
    name: str
    code: int  # the format's number in kvserve.kernels
    bits: int  # per value, scales not counted
    per_token = True  # False: quantize_blocks only (the layout keeps a float residual)
    group = 0  # values per scale along head_dim; 0: none

    def parts(self, block_size: int, heads: int, dim: int) -> dict[str, Part]:
        raise NotImplementedError

    def quantize_tokens(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [T, heads, dim] -> parts with leading dim T (per-token formats)."""
        raise NotImplementedError

    def dequantize_tokens(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def quantize_blocks(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [n, block_size, heads, dim] -> parts with leading dim n."""
        n, bs = x.shape[:2]
        return {k: v.view(n, bs, *v.shape[1:]) for k, v in self.quantize_tokens(x.flatten(0, 1)).items()}

    def dequantize_blocks(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """parts with leading dims [n, block_size] -> [n, block_size, heads, dim]."""
        n, bs = next(iter(parts.values())).shape[:2]
        x = self.dequantize_tokens({k: v.flatten(0, 1) for k, v in parts.items()}, dtype)
        return x.view(n, bs, *x.shape[1:])

    def allocate(self, num_blocks: int, block_size: int, heads: int, dim: int, device) -> dict[str, torch.Tensor]:
        """Zeroed parts for `num_blocks` blocks of `block_size` tokens: each [num_blocks, *part shape], on huge pages."""
        return {name: hugepages.zeros((num_blocks, *part.shape), part.dtype, device)
                for name, part in self.parts(block_size, heads, dim).items()}

    def block_bytes(self, block_size: int, heads: int, dim: int) -> int:
        return sum(p.nbytes for p in self.parts(block_size, heads, dim).values())

    def check(self, dim: int) -> None:
        if self.group and dim % self.group:
            raise KVServeError(f"KV dtype {self.name} quantizes groups of {self.group} values along head_dim, "
                               f"but head_dim is {dim}")


def affine_quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric quantization along `dim`: integer codes in [0, 2^bits) and fp16 (scale, min) stacked last.
    Codes are computed with the fp16-rounded scale and min, so dequantizing reproduces them exactly."""
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).half().float()
    lo = lo.half().float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = ((x - lo) * inv).round_().clamp_(0, 2**bits - 1).to(torch.uint8)
    return codes, torch.cat([scale, lo], dim).half()


def affine_dequantize(codes: torch.Tensor, meta: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    scale, lo = meta.float().split(1, dim)
    return (codes.float() * scale + lo).to(dtype)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., 32*k] codes of `bits` bits -> [..., 32*k*bits/8] bytes. In each group of 32 values, byte j holds
    values j, j+n, j+2n, ... (n = 32*bits/8) from its low bits up: the kernels unpack a group with shifts."""
    per_byte = 8 // bits
    g = codes.unflatten(-1, (-1, per_byte, 32 // per_byte)).to(torch.uint8)
    out = torch.zeros(g.shape[:-2] + g.shape[-1:], dtype=torch.uint8, device=codes.device)
    for s in range(per_byte):
        out |= g[..., s, :] << (bits * s)
    return out.flatten(-2)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    g = packed.unflatten(-1, (-1, 32 // per_byte))
    mask = 2**bits - 1
    return torch.stack([(g >> (bits * s)) & mask for s in range(per_byte)], -2).flatten(-3)


from kvserve.kv.formats.fp8 import FP8_E4M3, FP8_E5M2  # noqa: E402
from kvserve.kv.formats.full import BFLOAT16, FLOAT16, FLOAT32  # noqa: E402
from kvserve.kv.formats.int4 import INT4  # noqa: E402
from kvserve.kv.formats.int8 import INT8  # noqa: E402
from kvserve.kv.formats.kivi2 import KIVI2_KEYS, KIVI2_VALUES  # noqa: E402

# name (config.KV_CACHE_DTYPES') -> (format for keys, format for values)
FORMATS: dict[str, tuple[KVFormat, KVFormat]] = {
    "float32": (FLOAT32, FLOAT32), "bfloat16": (BFLOAT16, BFLOAT16), "float16": (FLOAT16, FLOAT16),
    "fp8_e4m3": (FP8_E4M3, FP8_E4M3), "fp8_e5m2": (FP8_E5M2, FP8_E5M2),
    "int8": (INT8, INT8), "int4": (INT4, INT4), "kivi2": (KIVI2_KEYS, KIVI2_VALUES),
}


def get_format(name: str, role: str) -> KVFormat:
    """The format that stores keys (role "k") or values ("v") for a KV dtype name."""
    if name not in FORMATS:
        raise KVServeError(f"unknown KV cache dtype {name!r}; choose from {', '.join(KV_CACHE_DTYPES)}")
    return FORMATS[name][0 if role == "k" else 1]
