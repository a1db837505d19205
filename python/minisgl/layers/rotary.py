"""Rotary position embedding (neox layout: rotate halves), with llama3 scaling (Llama 3.1+)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from minisgl.layers.base import Module


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int
    base: float = 10000.0
    max_position: int = 4096
    scaling: dict = field(default_factory=dict)  # HF rope_scaling / rope_parameters


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
        self.register_buffer(
            "cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False
        )
        # the torch path's table: built here on CPU, on first use elsewhere (the fused kernels
        # read cos_sin; a long context's table is MBs a GPU need not hold)
        cpu = self.cos_sin.device.type == "cpu"
        self._table: torch.Tensor | None = rope_table(self.cos_sin) if cpu else None
        # this forward's rows: every layer rotates at the same positions (one lookup a step)
        self._rows: tuple[torch.Tensor, torch.dtype, torch.Tensor] | None = None

    def new_forward(self) -> None:
        """Forget the rows (each forward first): a CUDA graph's static buffer holds new
        positions under the same tensor, and a graph must capture the lookup."""
        self._rows = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] -> rotated copies (the fused ops rotate in the kernel)."""
        if self._table is None or self._table.device != self.cos_sin.device:  # module moved
            self._table = rope_table(self.cos_sin)
        last = self._rows
        if last is None or last[0] is not positions or last[1] != q.dtype:
            rows = self._table[positions].to(q.dtype).unsqueeze(2)  # [T, 2, 1, D]
            last = self._rows = (positions, q.dtype, rows)
        if (qk := _adjacent(q, k)) is not None:  # QKV output: one rotation for both
            q_rot, k_rot = rotate(qk, last[2]).split_with_sizes([q.shape[1], k.shape[1]], 1)
            return q_rot, k_rot
        return rotate(q, last[2]), rotate(k, last[2])


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, Hq + Hk, D] view when k directly follows q in one storage (the QKV
    projection's output without q/k norm), else None."""
    d = q.shape[2]
    adjacent = (
        not torch.compiler.is_compiling()  # no storage pointers in a graph; it fuses both anyway
        and q.stride()[1:] == (d, 1) == k.stride()[1:]
        and (q.shape[0] <= 1 or q.stride(0) == k.stride(0))  # one row: its stride is arbitrary
        and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
        and k.storage_offset() == q.storage_offset() + q.shape[1] * d
    )
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], d), q.stride()) if adjacent else None


def rope_table(cos_sin: torch.Tensor) -> torch.Tensor:
    """[max_position, 2, head_dim]: (cos, cos) and (-sin, sin) per position."""
    # a rotation is then x * cos + roll(x) * sin, four ops (transformers' rotate_half form)
    cos, sin = cos_sin.chunk(2, dim=-1)
    return torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)


def rotate(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by `rope_table` rows [T, 2, 1, D], bit for bit the two-halves form."""
    # first half x1 cos - x2 sin, second x2 cos + x1 sin; the halves swap in one flip
    swapped = x.view(*x.shape[:-1], 2, -1).flip(-2).view(x.shape)
    return x * rows[:, 0] + swapped * rows[:, 1]
