"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama), with linear and llama3 scaling."""

from __future__ import annotations

import math

import torch

from services.config.engine import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "llama3":
        inv = _llama3_scale(inv, rope)
    elif rope.kind == "linear":
        inv = inv / rope.factor
    return inv


def _llama3_scale(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by factor, smooth in between."""
    low_wavelen = rope.original_max_positions / rope.low_freq_factor
    high_wavelen = rope.original_max_positions / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables for every position; apply() rotates q and k in place of a copy."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_frequencies(rope, head_dim)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the batch's positions, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
