"""Custom GPU kernels. Each module imports triton itself and is imported only by the code that
uses it, so this package stays importable on machines without triton."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from minisgl import env


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """The Triton fused-op module (`kernel/fused.py`) when `x` is on CUDA, triton imports and
    MINISGL_DISABLE_FUSED_OPS is unset; None means: run the torch reference."""
    if not x.is_cuda or env.disable_fused_ops():
        return None
    return _import_fused()


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _import_fused() -> ModuleType | None:
    if not triton_available():  # no triton: the torch path is the fallback, not an error
        return None
    from minisgl.kernel import fused

    return fused


MOE_BACKENDS = ("auto", "torch", "triton")


def resolve_moe_backend(name: str, device_type: str) -> str:
    """--moe-backend on a "cuda" or "cpu" engine -> "torch" or "triton". auto: triton on CUDA
    when it imports (`kernel/moe.py`), else the torch reference; ValueError for a name that is
    unknown or cannot run here."""
    if name not in MOE_BACKENDS:
        raise ValueError(
            f"invalid --moe-backend {name!r}: expected one of {', '.join(MOE_BACKENDS)}"
        )
    if name == "auto":
        return "triton" if device_type == "cuda" and triton_available() else "torch"
    if name == "triton" and device_type != "cuda":
        raise ValueError(
            f"--moe-backend triton needs a CUDA device (this engine runs on {device_type}): "
            "use --moe-backend torch or auto"
        )
    if name == "triton" and not triton_available():
        raise ValueError(
            "--moe-backend triton needs the triton package, which does not import here: "
            "use --moe-backend torch or auto"
        )
    return name
