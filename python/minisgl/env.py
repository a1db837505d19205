"""Every MINISGL_* environment flag, read at call time so tests can flip them."""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() not in ("", "0", "false", "no", "off")


def disable_overlap_scheduling() -> bool:
    """MINISGL_DISABLE_OVERLAP_SCHEDULING=1: process each step's tokens before building the next."""
    return _flag("MINISGL_DISABLE_OVERLAP_SCHEDULING")


def disable_fused_ops() -> bool:
    """MINISGL_DISABLE_FUSED_OPS=1: torch reference ops instead of the Triton kernels on GPU."""
    return _flag("MINISGL_DISABLE_FUSED_OPS")
