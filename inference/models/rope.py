"""Rotary position embeddings as Hugging Face transformers computes them, for every family the engine loads.

One float32 cos/sin table per position is built once (:class:`RotaryEmbedding`) and indexed by each token's
position. The inverse frequencies follow transformers exactly for ``default``, ``linear``, ``llama3`` and
``yarn`` (YaRN's NTK-by-parts ramp, with its cos/sin scale folded into the table). Two layouts rotate the
head dimensions: halves (``rotate_half``; Llama) and interleaved pairs (DeepSeek's ``rope_interleave``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from inference.models.config import ModelConfig, RopeScaling


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 [head_dim // 2], exactly as transformers computes them (default, linear, llama3, yarn)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(config.rope_theta, dim, scaling)
    return _llama3_frequencies(inv_freq, scaling)


def _llama3_frequencies(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_frequencies(base: float, dim: int, s: RopeScaling) -> torch.Tensor:
    """Interpolated frequencies for the long wavelengths, the original ones for the short, a ramp between."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


class RotaryEmbedding(nn.Module):
    """A cos/sin table per position, computed once in float32 and indexed by each token's position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_cache(self.cos.device)

    def reset_cache(self, device: torch.device) -> None:
        """(Re)compute the table on ``device``; needed after building the module on ``meta``."""
        if device.type == "meta":
            return
        positions = torch.arange(self.max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * rope_inverse_frequencies(self.config)[None, :]
        scale = 1.0 if self.config.rope_scaling is None else self.config.rope_scaling.cos_sin_scale
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.cos, self.sin = cos.to(device), sin.to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, head_dim // 2] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` on half-width tables; x: [T, heads, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs ``(x0, x1), (x2, x3), ...`` rotated, written out as halves (transformers' layout)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
