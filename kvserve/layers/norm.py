from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn



class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension (Gemma's 1 + weight is folded into the weight at load)."""

    ops = None  # fused ops (kvserve.kernels: ~10x less overhead per call on a decode step's few rows); None: torch's

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)  # bf16 autocast (training a draft)
        return F.rms_norm(x, weight.shape, weight, self.eps)
