"""Rotary position embedding (rotate-half layout, as HF), with optional llama3, linear or longrope
(Phi-3) frequency scaling.

LongRoPE has two sets of per-frequency factors: HF picks the long set while the sequence in the
forward pass is longer than ``original_max_position_embeddings``, switching mid-sequence (its cached
keys keep the short set). A paged cache shares keys across steps, so here the set is chosen once per
engine, from the longest sequence it accepts (``max_model_len``): the short set when that fits the
original length (then equal to HF for every sequence), else the long set (equal to HF's forward
over a sequence longer than the original length). ``docs/models.md`` says so.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from steerable.layers import cpu_kernels


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Stretch low frequencies by ``factor`` and blend the middle band (Llama 3.1 long context)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _longrope_inv_freq(theta: float, head_dim: int, scaling: dict, max_positions: int) -> torch.Tensor:
    """HF's longrope frequencies, ``1 / (factor_i * theta^(2i/d))``, with the set ``max_positions`` needs."""
    long = max_positions > scaling["original_max_position_embeddings"]
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (factors * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin per position, indexed by absolute position each step (longrope's
    attention factor is folded into both tables, as HF scales them)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = scaling["rope_type"] if scaling is not None else "default"
        if rope_type == "linear":  # positions / factor (Gemma 3 global layers)
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "longrope":
            inv_freq = _longrope_inv_freq(theta, head_dim, scaling, max_positions)
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if rope_type == "longrope":
            cos, sin = cos * scaling["attention_factor"], sin * scaling["attention_factor"]
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu_kernels.applies(q, k) and positions.dtype == torch.int64 and q.stride(-1) == k.stride(-1) == 1:
            ops = cpu_kernels.kernels()
            q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
            ops.rope(q, q_out, positions, self.cos, self.sin)
            ops.rope(k, k_out, positions, self.cos, self.sin)
            return q_out, k_out
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
