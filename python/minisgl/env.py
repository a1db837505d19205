"""The core's MINISGL_* environment flags, typed, in one place (an extension reads its own with
`flag`). Each is read when asked for (not at import), so a test or an ablation can set it in the
process before the code that reads it runs."""

from __future__ import annotations

import os


def flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1/0, true/false, yes/no or on/off")


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 (Triton's own flag): kernels run in Triton's CPU interpreter, which has
    no approximate math, no PDL and multiplies bf16 dot tiles as raw bits."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def disable_extensions() -> bool:
    """MINISGL_DISABLE_EXTENSIONS: run the core alone, as if `minisgl/ext` were not installed."""
    return flag("MINISGL_DISABLE_EXTENSIONS")


def disable_fused_ops() -> bool:
    """MINISGL_DISABLE_FUSED_OPS: the torch reference instead of every Triton kernel of
    `kernel/` (RMSNorm, RoPE, SiLU-and-mul, KV store, sampling, logprobs, logit adjustments)."""
    return flag("MINISGL_DISABLE_FUSED_OPS")


def disable_gemv() -> bool:
    """MINISGL_DISABLE_GEMV: F.linear (cuBLAS) instead of the small-batch GEMV kernels."""
    return flag("MINISGL_DISABLE_GEMV")


def gemv_max_m() -> int | None:
    """MINISGL_GEMV_MAX_M: the largest decode batch (rows) the GEMV kernels take (default 8, at
    most 64); unset: the default."""
    value = os.environ.get("MINISGL_GEMV_MAX_M", "").strip()
    if value and (not value.isdigit() or int(value) < 1):
        raise ValueError(f"MINISGL_GEMV_MAX_M={value!r}: expected a whole number of rows >= 1")
    return int(value) if value else None


def disable_decode_rope() -> bool:
    """MINISGL_DISABLE_DECODE_ROPE: apply RoPE and store the new K/V with the rotary kernel
    before decode attention, instead of inside the Triton decode kernel."""
    return flag("MINISGL_DISABLE_DECODE_ROPE")


def disable_pdl() -> bool:
    """MINISGL_DISABLE_PDL: launch the Triton kernels without programmatic dependent launch."""
    return flag("MINISGL_DISABLE_PDL")


def disable_overlap_scheduling() -> bool:
    """MINISGL_DISABLE_OVERLAP_SCHEDULING: build the next batch only after the current one ends."""
    return flag("MINISGL_DISABLE_OVERLAP_SCHEDULING")
