"""The core's MINISGL_* environment flags, typed, in one place (the kernels' are in
kernel/flags.py; an extension reads its own with `flag`), each read when asked for: a test or an
ablation sets it before the code that reads it."""

from __future__ import annotations

import os


def flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1/0, true/false, yes/no or on/off")


def disable_extensions() -> bool:
    """MINISGL_DISABLE_EXTENSIONS: run the core alone, as if `minisgl/ext` were not installed."""
    return flag("MINISGL_DISABLE_EXTENSIONS")


def disable_decode_rope() -> bool:
    """MINISGL_DISABLE_DECODE_ROPE: apply RoPE and store the new K/V with the rotary kernel
    before decode attention, instead of inside the Triton decode kernel."""
    return flag("MINISGL_DISABLE_DECODE_ROPE")


def disable_overlap_scheduling() -> bool:
    """MINISGL_DISABLE_OVERLAP_SCHEDULING: build the next batch only after the current one ends."""
    return flag("MINISGL_DISABLE_OVERLAP_SCHEDULING")
