"""The pointwise ops of kvserve.kernels (pointwise.cpp: rms_norm, rope_, silu_and_mul; the same names and
arguments) for CUDA, as Triton kernels of any float dtype, computing in fp32. A decode step is hundreds of small
kernels, most of them launched for a few rows: RoPE as torch ops is five kernels a call, SiLU-and-mul two."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)  # already one kernel in torch's CUDA build


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [T, heads, D] (rows and heads strided, D contiguous: views of the fused q/k/v projection) rotated in place
    by cos/sin [T, 1, D]: rotate-half RoPE."""
    tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and cos.shape == sin.shape == (tokens, 1, dim) and dim % 2 == 0
    cos, sin = cos.contiguous(), sin.contiguous()
    if tokens:
        _rope[(tokens,)](x, cos, sin, x.stride(0), x.stride(1), heads, HEADS_P=triton.next_power_of_2(heads), HALF=dim // 2,
                         HALF_P=triton.next_power_of_2(dim // 2))


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, heads, HEADS_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_P)[:, None]
    i = tl.arange(0, HALF_P)[None, :]
    mask, in_half = (h < heads) & (i < HALF), i < HALF
    first = x_ptr + t * stride_t + h * stride_h + i
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    table = t * 2 * HALF + i
    cos1, cos2 = tl.load(cos_ptr + table, mask=in_half).to(tl.float32), tl.load(cos_ptr + table + HALF, mask=in_half).to(tl.float32)
    sin1, sin2 = tl.load(sin_ptr + table, mask=in_half).to(tl.float32), tl.load(sin_ptr + table + HALF, mask=in_half).to(tl.float32)
    tl.store(first, (x1 * cos1 - x2 * sin1).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos2 + x1 * sin2).to(x_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:], [T, I]."""
    tokens, half = x.shape[0], x.shape[1] // 2
    assert x.dim() == 2 and x.stride(1) == 1
    out = torch.empty((tokens, half), dtype=x.dtype, device=x.device)
    if tokens:
        _silu_and_mul[(tokens, triton.cdiv(half, SILU_BLOCK))](x, out, x.stride(0), half, BLOCK=SILU_BLOCK)
    return out


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, stride_x, half, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < half
    gate = tl.load(x_ptr + t * stride_x + i, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + half + i, mask=mask).to(tl.float32)
    tl.store(out_ptr + t * half + i, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)
