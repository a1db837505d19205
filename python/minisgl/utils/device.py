"""The `device` option ("auto" | "cuda" | "cpu" | "cuda:N"), resolved once at start."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_type(name: str) -> str:
    """ "cuda" or "cpu", without initialising CUDA (the caller may be a launcher)."""
    name = name.split(":")[0]
    return "cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu"
