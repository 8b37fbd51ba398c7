"""A linear layer whose weight is dense, or kept in its GGUF file's quantized format (layers/quantized.py).

The kernels (kvserve.kernels) multiply the 4/5/6/8-bit weights in place: decode steps, memory-bound, and with
int8 activations (the default) every step, prefill included, where integer dot products outrun a float GEMM.
Past `kernel_rows` a step runs a GEMM over tiles of the weight dequantized a few MB at a time. With bf16
matmuls a dense weight is kept in bf16 and tiles are dequantized to bf16, which CPUs with AVX512-BF16 or AMX
multiply ~4x faster than fp32.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import Activations, native_ops
from kvserve.layers.quantized import QuantizedWeight

# Up to this many rows the fp32-activation kernels beat dequantizing the weight for a GEMM of fp32 tiles. Measured
# on a 2-core Zen 5 (AVX-512 VNNI and BF16), all of SmolLM2's layers: kernel 28 ms / tiles 31 ms at 16 rows, 46 / 38 at 24.
MAX_KERNEL_ROWS = 16
# The int8-activation kernels beat fp32 and bf16 tiles at every row count measured: on a 2-core AMD EPYC with
# AVX-512 VNNI and BF16, all of SmolLM2's linears took 0.60-0.65 ms a row at 64 to 1,024 rows, bf16 tiles 0.86-1.28,
# fp32 tiles 1.7-2.3, and the kernels forced to AVX2 1.3-1.4. So every step uses them. Where the CPU has AMX they
# multiply steps of 32 rows or more in bf16 on its tiles themselves (quant_matmul.cpp), a panel of weights
# dequantized at a time: on a 2-core Xeon 0.29 ms a row at 384 rows and 0.27 at 512, where dequantizing the whole
# weight for oneDNN's bf16 GEMM took 0.37 and 0.33.
# kernel_rows where every step multiplies in place (so, but on AMX, a row's numbers never depend on its step)
ANY_ROWS = sys.maxsize
# For a few rows against a wide weight, MKL's x @ W^T takes a slow path (4 rows x the 49152-wide head: 42 ms),
# while W @ x^T, the same numbers, is fast (9 ms); past this many rows x @ W^T catches up. Not on CUDA, where
# W @ x^T cost a copy kernel per linear for its transpose (an H200's graphed SmolLM2-shape decode step: 2.08 ms
# at 2 rows against 1.05 at one, where bf16's F.linear took 1.08 and 1.08).
MAX_TRANSPOSED_ROWS = 256


class Linear(nn.Linear):
    qweight: QuantizedWeight | None = None  # set at load: then `weight` is None
    int8_activations = False  # the kernels multiply activations quantized to int8 per 32 values (llama.cpp's way)
    bf16_tiles = True  # ...and, where the CPU has AMX, a step of 32 rows or more in bf16 on its tiles (False: batch_invariant)
    gemm_dtype = torch.float32  # what a quantized weight's tiles are dequantized to for many-row steps

    def reset_parameters(self) -> None:
        """A model is built on the meta device and takes its checkpoint's weights: random init there would only cost
        time (and import torch._dynamo)."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias

    def forward_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward, and each output row's argmax where the kernel finds it as it multiplies (a quantized weight, no
        bias, within kernel_rows: an LM head's greedy tokens); else None."""
        if self.qweight is None or self.bias is not None or x.shape[0] > self.kernel_rows:
            return self(x), None
        return self.qweight.matmul_argmax(x, self.activations)

    @property
    def row_invariant(self) -> bool:
        """Whether a row's numbers never depend on the rows beside it: a quantized weight multiplied by int8 rows at every
        step size (without AMX, or its tiles turned off)."""
        return self.qweight is not None and self.int8_activations and (not self.bf16_tiles or native_ops().kernel_isa() != "amx")

    @property
    def activations(self) -> Activations:
        """What the kernels multiply a quantized weight by."""
        if not self.int8_activations:
            return Activations.FP32
        return Activations.INT8 if self.bf16_tiles else Activations.INT8_ONLY

    @property
    def kernel_rows(self) -> int:
        """Up to this many rows a quantized weight multiplies in place; more run a GEMM over dequantized tiles."""
        return ANY_ROWS if self.int8_activations else MAX_KERNEL_ROWS

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.matmul(x, self.activations) if x.shape[0] <= self.kernel_rows else self._tiled(x)
        if self.weight.dtype == torch.bfloat16:  # matmul_dtype: activations stay fp32 outside the matmul
            return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        if x.is_cuda or x.dim() != 2 or x.shape[0] > MAX_TRANSPOSED_ROWS:
            return F.linear(x, self.weight)
        return torch.mm(self.weight, x.t()).t().contiguous()

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        xc, out = x.to(self.gemm_dtype), None
        for first, tile in self.qweight.tiles(self.gemm_dtype):
            y = F.linear(xc, tile)
            if tile.shape[0] == self.out_features:  # the whole weight in one tile: its product is the output
                return y.to(x.dtype)
            out = x.new_empty(x.shape[0], self.out_features) if out is None else out
            out[:, first:first + tile.shape[0]] = y
        return out

    def use_quantized(self, weight: QuantizedWeight) -> None:
        assert (weight.out_features, weight.in_features) == (self.out_features, self.in_features)
        self.qweight = weight
        self.weight = None


class VocabSubset(nn.Module):
    """An LM head over some token ids only, every other logit -inf: a draft that proposes only likely tokens
    (FR-Spec's frequency-ranked head) reads a fraction of the full head's bytes."""

    def __init__(self, head: Linear, ids: torch.Tensor):
        super().__init__()
        self.vocab_size = head.out_features
        self.head = Linear(head.in_features, len(ids), bias=False, device="meta")
        self.head.int8_activations, self.head.bf16_tiles, self.head.gemm_dtype = head.int8_activations, head.bf16_tiles, head.gemm_dtype
        if head.qweight is not None:
            self.head.use_quantized(head.qweight.select(ids))
        else:
            ids = ids.to(head.weight.device)
            self.head.weight = nn.Parameter(head.weight.detach().index_select(0, ids), requires_grad=False)
        self.register_buffer("ids", ids, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        return logits.new_full((x.shape[0], self.vocab_size), float("-inf")).index_copy_(1, self.ids, logits)


class Embedding(nn.Embedding):
    """Token embeddings, dense or quantized (only the rows looked up are dequantized)."""

    qweight: QuantizedWeight | None = None

    def reset_parameters(self) -> None:
        """As Linear's: no random init on the meta device."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids) if self.qweight is not None else super().forward(ids)

    def use_quantized(self, weight: QuantizedWeight) -> None:
        assert (weight.out_features, weight.in_features) == (self.num_embeddings, self.embedding_dim)
        self.qweight = weight
        self.weight = None
