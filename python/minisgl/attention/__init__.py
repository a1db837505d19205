"""Attention backends. `create_attention_backend("auto" | NAME | "PREFILL,DECODE", ...)`."""

from __future__ import annotations

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.torch_backend import TorchAttnBackend

BACKENDS = ("torch",)


def create_attention_backend(
    name: str, device: torch.device, sliding_window: int | None = None
) -> BaseAttnBackend:
    if name == "auto":
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    return TorchAttnBackend(sliding_window)


__all__ = ["BACKENDS", "BaseAttnBackend", "create_attention_backend"]
