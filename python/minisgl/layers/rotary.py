"""Rotary position embedding (neox layout: rotate halves), with llama3 scaling (Llama 3.1+)."""

from __future__ import annotations

import math

import torch

from minisgl.layers.base import Module
from minisgl.layers.config import RopeConfig


def inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """The rotation frequencies, with HF's llama3 scaling (the only one the families use)."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
    freqs = 1.0 / (cfg.base**exponents)
    s = cfg.scaling
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return freqs
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, llama3)")
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > old_len / low, freqs / factor, freqs)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(Module):
    cos_sin: torch.Tensor  # [max_position, head_dim]: cos in the first half, sin in the second

    def __init__(self, cfg: RopeConfig) -> None:
        super().__init__()
        positions = torch.arange(cfg.max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq(cfg)[None, :]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] -> rotated copies (the fused ops rotate in the kernel)."""
        cos, sin = self.cos_sin[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        return rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos, sin [T, 1, D / 2]: (x1 cos - x2 sin, x2 cos + x1 sin) of its
    halves (x1, x2), as transformers' rotate_half."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
