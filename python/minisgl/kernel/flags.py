"""The kernels' switches (MINISGL_* environment flags, and Triton's interpreter), read when
asked for: a test or an ablation sets one before the kernel that reads it."""

from __future__ import annotations

import os

from minisgl.env import flag


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 (Triton's own flag): kernels run in Triton's CPU interpreter, which has
    no approximate math, no PDL and multiplies bf16 dot tiles as raw bits."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def disable_fused_ops() -> bool:
    """MINISGL_DISABLE_FUSED_OPS: the torch reference instead of every Triton kernel of
    `kernel/` (RMSNorm, RoPE, SiLU-and-mul, KV store, sampling, logprobs, logit adjustments)."""
    return flag("MINISGL_DISABLE_FUSED_OPS")


def disable_gemv() -> bool:
    """MINISGL_DISABLE_GEMV: F.linear (cuBLAS) instead of the small-batch GEMV kernels."""
    return flag("MINISGL_DISABLE_GEMV")


def gemv_max_m() -> int | None:
    """MINISGL_GEMV_MAX_M: the most decode rows the GEMV kernels take (at most 64); unset: 8."""
    value = os.environ.get("MINISGL_GEMV_MAX_M", "").strip()
    if value and (not value.isdigit() or int(value) < 1):
        raise ValueError(f"MINISGL_GEMV_MAX_M={value!r}: expected a whole number of rows >= 1")
    return int(value) if value else None


def disable_pdl() -> bool:
    """MINISGL_DISABLE_PDL: launch the Triton kernels without programmatic dependent launch."""
    return flag("MINISGL_DISABLE_PDL")
