"""The `device` option ("auto" | "cuda" | "cpu" | "cuda:N"), resolved once at start. torch is
imported only where a question needs it: the API process checks the option without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def resolve_device(name: str) -> torch.device:
    import torch

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
    if name != "auto":
        return "cuda" if name == "cuda" else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gpus_short(name: str, need: int) -> int | None:
    """The GPUs this machine has when the device `name` runs on CUDA and they are fewer than
    `need`, else None; torch only where it may be (the API process starts without it, issue 47):
    "auto" with `need` <= 1 picks CUDA only where a GPU is."""
    if (name == "auto" and need <= 1) or device_type(name) != "cuda":
        return None
    import torch

    found = torch.cuda.device_count()
    return found if found < need else None
