"""Rotary position embeddings, with Llama-3 and linear frequency scaling.

Maths (per head, pairs (i, i + d/2)): with inverse frequencies
``inv_freq[j] = theta ** (-2j / d)`` and angle ``a = pos * inv_freq[j]``,
``q'[i] = q[i] cos a - q[i + d/2] sin a`` and ``q'[i + d/2] = q[i + d/2] cos a + q[i] sin a``.
The angles are computed in float32 in the same order as transformers' Llama so
that logits match it bit for bit on the CPU.
"""

from __future__ import annotations

import math

import torch

from loramux.engine.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")


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
        self.inv_freq = inverse_frequencies(config).to(device)  # [head_dim / 2], float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions: [T] int64 -> cos, sin: [T, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos/sin: [T, head_dim]
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
