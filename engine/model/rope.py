"""Rotary position embeddings, with Llama-3, linear and YaRN frequency scaling.

Maths (per head, pairs (i, i + d/2)): with inverse frequencies
``inv_freq[j] = theta ** (-2j / d)`` and angle ``a = pos * inv_freq[j]``,
``q'[i] = q[i] cos a - q[i + d/2] sin a`` and ``q'[i + d/2] = q[i + d/2] cos a + q[i] sin a``.
The angles are computed in float32 in the same order as transformers' Llama so
that logits match it bit for bit on the CPU. YaRN also scales cos and sin by its
attention factor (``0.1 ln(factor) + 1`` unless the config sets it).
"""

from __future__ import annotations

import math

import torch

from loramux.engine.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    return rope_parameters(config)[0]


def rope_parameters(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in float32, the factor on cos and sin)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(config.rope_theta**exponents, dim, config.rope_theta, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3, yarn)")


def _yarn(powers: torch.Tensor, dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): frequencies that turn fewer than ``beta_slow`` times over
    the original context are divided by ``factor`` (interpolated), those that turn more
    than ``beta_fast`` times kept (extrapolated), a linear ramp over the dimensions
    between; cos and sin scaled by the attention factor."""
    factor = float(scaling["factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor, 1.0)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dimension_of(rotations: float) -> float:  # the dimension turning this many times
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width: a step
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: extrapolated (kept), 0: interpolated (divided by factor)
    interpolated = 1.0 / (factor * powers)
    extrapolated = 1.0 / powers
    return interpolated * (1 - kept) + extrapolated * kept, float(attention)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the
    # band between is interpolated smoothly.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Holds the inverse frequencies; gives cos/sin for any positions."""

    def __init__(self, config: ModelConfig, device: torch.device):
        inv_freq, self.attention_factor = rope_parameters(config)
        self.inv_freq = inv_freq.to(device)  # [head_dim / 2], float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions: [T] int64 -> cos, sin: [T, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # YaRN's, in float32 before the cast
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos/sin: [T, head_dim]
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
