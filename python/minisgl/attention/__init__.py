"""Attention backends. `create_attention_backend("auto" | NAME | "PREFILL,DECODE", ...)`."""

from __future__ import annotations

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.torch_backend import TorchAttnBackend

BACKENDS = ("torch", "triton")


def create_attention_backend(
    name: str, device: torch.device, sliding_window: int | None = None
) -> BaseAttnBackend:
    if name == "auto":
        # triton has no sliding window yet: such models keep the reference backend
        name = "triton" if device.type == "cuda" and sliding_window is None else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    if name == "triton":
        from minisgl.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(sliding_window)
    return TorchAttnBackend(sliding_window)


__all__ = ["BACKENDS", "BaseAttnBackend", "create_attention_backend"]
