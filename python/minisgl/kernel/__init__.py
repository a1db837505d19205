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
def _import_fused() -> ModuleType | None:
    try:
        import triton  # noqa: F401
    except ImportError:  # no triton: the torch path is the fallback, not an error
        return None
    from minisgl.kernel import fused

    return fused
