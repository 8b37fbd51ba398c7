from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None, freq_factors: list[float] | None = None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    if freq_factors is not None:  # a GGUF file's rope_freqs (Llama 3.1's scaling, precomputed per frequency)
        return inv_freq / torch.tensor(freq_factors, dtype=torch.float32, device="cpu")
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_scaling(inv_freq, scaling)


def _llama3_scaling(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Rotate-half RoPE with cos/sin tables precomputed for every position up to `max_positions`.

    The tables are built on the CPU even when the model is constructed on the meta device.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, freq_factors: list[float] | None = None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling, freq_factors)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, shaped [tokens, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


    def shift(self, x: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
        """Keys x [tokens, heads, head_dim] already rotated for their positions, rotated `by` [tokens, heads] positions
        more (negative: back), as if computed at the new positions."""
        angles = by[..., None].to(self.inv_freq.dtype) * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return apply_rotary(x.float(), angles.cos(), angles.sin()).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
