"""Weights that stay in their GGUF file's quantized format, in memory as on disk.

A GGUF tensor arrives as its file's rows of blocks (`GGUFTensor`). Where kvserve.kernels run, a tensor of a
type they read becomes a `QuantizedWeight`: the same bits, repacked into the layout the kernels want (about
the file's size). Few-row matmuls (decode steps) multiply it directly; prefill dequantizes a tile of rows at a
time into a small buffer for the GEMM; an embedding dequantizes the rows it looks up. Elsewhere (CUDA, plain
torch, a type without a kernel) the tensor is dequantized once at load, by the gguf package.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve import hugepages
from kvserve.kernels import Activations, native_ops

# The GGUF types kvserve.kernels multiply in place (ggml type ids).
KERNEL_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
TILE_BYTES = 8 << 20  # prefill dequantizes this much of a weight at a time (into one reused buffer; L3-sized)
PANEL = 16  # packed rows lie in panels of this many (kernels/quants.h), but for a weight's last rows past them


def packed_row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of `cols` weights in the kernels' layout (kernels/quants.h: layout), without building it."""
    bits, kquant, per16, has_min = {"Q4_0": (4, 0, 0, 0), "Q4_1": (4, 0, 0, 1), "Q5_0": (5, 0, 0, 0), "Q5_1": (5, 0, 0, 1),
                                    "Q8_0": (8, 0, 0, 0), "Q4_K": (4, 1, 0, 1), "Q5_K": (5, 1, 0, 1), "Q6_K": (6, 1, 1, 0)}[qtype]
    units, groups, supers = cols // 32, -(-cols // 128), cols // 256
    high_planes = {5: 1, 6: 2}.get(bits, 0)
    scales = (2 if per16 else 1) * units + 2 * supers if kquant else 2 * units
    mins = (units + 2 * supers if kquant else 2 * units) if has_min else 0
    return (32 if bits == 8 else 16) * units + 16 * groups * high_planes + scales + mins


def resident_bytes(qtype: str, shape: tuple[int, ...]) -> int:
    """What a GGUF tensor of this type holds once loaded on a CPU with kvserve.kernels: packed if a kernel reads its
    type, else dequantized to float32."""
    rows = 1
    for n in shape[:-1]:
        rows *= n
    return rows * packed_row_bytes(qtype, shape[-1]) if qtype in KERNEL_TYPES else 4 * rows * shape[-1]


@dataclass(slots=True)
class GGUFTensor:
    """A 2-D tensor as a GGUF file stores it: `data` holds its rows of quantized blocks [rows, bytes]."""

    data: torch.Tensor
    qtype: str
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """Its values as float32, by the gguf package."""
        import gguf

        values = gguf.quants.dequantize(self.data.numpy(), gguf.GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)


class QuantizedWeight:
    """A weight [out_features, in_features] in the kernels' layout, as parts of consecutive rows, each of one
    GGUF type (a fused projection whose parts the file stores in different types keeps one part each)."""

    def __init__(self, parts: list[tuple[str, torch.Tensor]], in_features: int):
        self.parts = parts  # (type name, packed rows [rows, packed bytes])
        self.in_features = in_features
        self.out_features = sum(rows.shape[0] for _, rows in parts)

    @classmethod
    def pack(cls, tensor: GGUFTensor) -> QuantizedWeight:
        return cls([(tensor.qtype, native_ops().gguf_pack(tensor.data, KERNEL_TYPES[tensor.qtype]))], tensor.shape[1])

    @classmethod
    def cat(cls, weights: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of equal width, one after another; neighbouring parts of a type merge."""
        parts: list[tuple[str, torch.Tensor]] = []
        for qtype, rows in (part for w in weights for part in w.parts):
            if parts and parts[-1][0] == qtype and len(parts[-1][1]) % PANEL == 0:  # (else its last rows are not a panel)
                parts[-1] = (qtype, torch.cat([parts[-1][1], rows]))
            else:
                parts.append((qtype, rows))
        return cls(parts, weights[0].in_features)

    @property
    def kernel_args(self) -> tuple[list[torch.Tensor], list[int]]:
        """The packed parts and their GGUF type ids, as the fused layer ops take them."""
        return [rows for _, rows in self.parts], [KERNEL_TYPES[qtype] for qtype, _ in self.parts]

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for _, rows in self.parts)

    @property
    def types(self) -> list[str]:
        return [qtype for qtype, _ in self.parts]

    def matmul(self, x: torch.Tensor, activations: Activations) -> torch.Tensor:
        """x [M, in] fp32 @ W.T, the kernels reading the packed rows and multiplying them by `activations`."""
        outs = [native_ops().gguf_matmul(x, rows, KERNEL_TYPES[qtype], activations) for qtype, rows in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def matmul_argmax(self, x: torch.Tensor, activations: Activations) -> tuple[torch.Tensor, torch.Tensor | None]:
        """matmul, and each output row's argmax where the kernel finds it as the outputs land (a weight of one part);
        else None."""
        if len(self.parts) > 1:
            return self.matmul(x, activations), None
        (qtype, rows), = self.parts
        return native_ops().gguf_matmul_argmax(x, rows, KERNEL_TYPES[qtype], activations)

    def tiles(self, dtype: torch.dtype):
        """(first row, dequantized rows [n, in]) for all rows, a few MB at a time, in one buffer reused by every tile
        (use each before taking the next)."""
        start, count = 0, max(1, TILE_BYTES // (self.in_features * dtype.itemsize) // PANEL) * PANEL  # whole panels
        buffer = _tile_buffer(dtype, count * self.in_features)
        for qtype, rows in self.parts:
            for first in range(0, rows.shape[0], count):
                yield start + first, native_ops().gguf_dequantize(rows[first:first + count], KERNEL_TYPES[qtype], self.in_features,
                                                                  dtype, buffer)
            start += rows.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([tile.clone() for _, tile in self.tiles(dtype)])

    def select(self, ids: torch.Tensor) -> QuantizedWeight:
        """Rows `ids` (of a weight of one part), packed."""
        (qtype, rows), = self.parts
        return QuantizedWeight([(qtype, native_ops().gguf_select(rows, ids, KERNEL_TYPES[qtype], self.in_features))], self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as float32 [*ids.shape, in] (an embedding lookup)."""
        (qtype, rows), = self.parts
        return native_ops().gguf_rows(rows, ids.flatten(), KERNEL_TYPES[qtype], self.in_features).view(*ids.shape, self.in_features)


def gather_on_huge_pages(weights: list[QuantizedWeight]) -> None:
    """Every packed part moves into one buffer on huge pages, in order (a decode step streams them all), each
    starting on a cache line."""
    line = lambda n: -(-n // 64) * 64  # noqa: E731
    total = sum(line(rows.nbytes) for w in weights for _, rows in w.parts)
    arena, start = hugepages.zeros((total,), torch.uint8), 0
    for w in weights:
        moved = []
        for qtype, rows in w.parts:
            moved.append((qtype, arena[start:start + rows.nbytes].view(rows.shape).copy_(rows)))
            start += line(rows.nbytes)
        w.parts = moved


_TILE_BUFFERS: dict[torch.dtype, torch.Tensor] = {}


def _tile_buffer(dtype: torch.dtype, elements: int) -> torch.Tensor:
    """The buffer tiles are dequantized into: one per dtype, grown to the largest tile asked for (made once, it
    spares every prefill step the page faults of fresh tiles)."""
    buffer = _TILE_BUFFERS.get(dtype)
    if buffer is None or buffer.numel() < elements:
        buffer = _TILE_BUFFERS[dtype] = torch.empty(elements, dtype=dtype)
    return buffer


def load_tensor(tensor: GGUFTensor, packed: bool) -> QuantizedWeight | torch.Tensor:
    """A GGUF tensor as the engine keeps it: packed for the kernels where asked and its type has one, else
    dequantized to float32."""
    if packed and tensor.qtype in KERNEL_TYPES and native_ops() is not None:
        return QuantizedWeight.pack(tensor)
    return tensor.dequantize()
