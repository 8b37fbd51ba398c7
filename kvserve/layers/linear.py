"""A linear layer that can also hold its weight as the GGUF file's own blocks.

Decoding reads every weight once per step, so it is memory-bound: a step of a few tokens multiplies
against the 4/8-bit blocks (kvserve.kernels), while prefill, compute-bound, uses the fp32 copy.
Both hold the same values, so the outputs agree to float rounding. With bf16 matmuls the weight itself
is kept in bf16, which CPUs with AVX512-BF16 or AMX multiply ~4x faster than fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import native_ops

MAX_BLOCK_ROWS = 12  # up to here the blocks beat the fp32 GEMM below (1.2x at 8 rows, 0.87x at 16 on a 2-core Zen 1)
# Against a bf16 weight (AVX512-BF16): blocks 1.7x at 1 row, even at 2-4, 0.6x at 8 on a Zen 5; on a 2-core Zen 4,
# since every row count has its own kernel pass, 2.3x at 1, 1.5x at 4, 1.25x at 5, 0.86x at 8 (one layer, warm cache).
MAX_BLOCK_ROWS_BF16 = 6
# For a few rows against a wide weight, MKL's x @ W^T takes a slow path (4 rows x the 49152-wide head: 42 ms),
# while W @ x^T, the same numbers, is fast (9 ms); past this many rows x @ W^T catches up.
MAX_TRANSPOSED_ROWS = 256


class Linear(nn.Linear):
    blocks: torch.Tensor | None = None  # [out_features, bytes per row] Q4_0/Q4_1/Q8_0 blocks of `weight`
    int8_activations = False  # the blocks multiply activations quantized to int8 per 32 values (llama.cpp's way)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        bf16 = self.weight.dtype == torch.bfloat16
        if self.blocks is not None and x.shape[0] <= (MAX_BLOCK_ROWS_BF16 if bf16 else MAX_BLOCK_ROWS):
            return native_ops().gguf_matmul(x, self.blocks, self.int8_activations)
        if bf16:  # matmul_dtype: activations stay fp32 outside the matmul
            return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        if x.dim() != 2 or x.shape[0] > MAX_TRANSPOSED_ROWS:
            return F.linear(x, self.weight)
        return torch.mm(self.weight, x.t()).t().contiguous()
