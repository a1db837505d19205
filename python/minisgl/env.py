"""Every MINISGL_* environment flag, typed, in one place. Each is read when asked for (not at
import), so a test or an ablation can set it in the process before the code that reads it runs."""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1/0, true/false, yes/no or on/off")


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 (Triton's own flag): kernels run in Triton's CPU interpreter, which has
    no approximate math, no PDL and multiplies bf16 dot tiles as raw bits."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def disable_extensions() -> bool:
    """MINISGL_DISABLE_EXTENSIONS: run the core alone, as if `minisgl/ext` were not installed
    (every extension point keeps its default; features of an extension are refused)."""
    return _flag("MINISGL_DISABLE_EXTENSIONS")


def disable_fused_ops() -> bool:
    """MINISGL_DISABLE_FUSED_OPS: run the torch reference of RMSNorm, RoPE, SiLU-and-mul, the
    KV-cache store, sampling, log-probability rows and logit adjustments on CUDA too, instead of
    the Triton kernels in `kernel/fused.py`, `sampling.py`, `logprobs.py` and `adjust.py`."""
    return _flag("MINISGL_DISABLE_FUSED_OPS")


def disable_gemv() -> bool:
    """MINISGL_DISABLE_GEMV: run every linear layer through F.linear (cuBLAS) on CUDA too, instead
    of the small-batch GEMV kernels in `kernel/gemv.py` (MINISGL_DISABLE_FUSED_OPS also does)."""
    return _flag("MINISGL_DISABLE_GEMV")


def gemv_max_m() -> int | None:
    """MINISGL_GEMV_MAX_M: decode batches of up to this many rows take the GEMV kernels
    (`kernel.gemv_max_m`: default 8, at most 64); unset: the default. For measuring the
    tensor-core GEMV against cuBLAS at larger batches."""
    name = "MINISGL_GEMV_MAX_M"
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r}: expected a whole number of rows >= 1")
    return int(value)


def disable_decode_rope() -> bool:
    """MINISGL_DISABLE_DECODE_ROPE: apply RoPE and store the new K/V with the rotary kernel
    before decode attention (`kernel/fused.py`), instead of inside the Triton decode kernel."""
    return _flag("MINISGL_DISABLE_DECODE_ROPE")


def disable_pdl() -> bool:
    """MINISGL_DISABLE_PDL: launch the Triton kernels without programmatic dependent launch
    (`kernel/pdl.py`; sm_90+ GPUs use it by default)."""
    return _flag("MINISGL_DISABLE_PDL")


def disable_overlap_scheduling() -> bool:
    """MINISGL_DISABLE_OVERLAP_SCHEDULING: build the next batch only after the current one ends."""
    return _flag("MINISGL_DISABLE_OVERLAP_SCHEDULING")


def disable_gc_freeze() -> bool:
    """MINISGL_DISABLE_GC_FREEZE: leave the start-up heap of the server's processes to Python's
    cyclic garbage collector (`utils.procs.freeze_startup_heap` freezes it once they are ready)."""
    return _flag("MINISGL_DISABLE_GC_FREEZE")


def gc_warning_threshold_s() -> float:
    """MINISGL_GC_WARNING_THRESHOLD_SECS (`--gc-warning-threshold-secs` sets it for the server's
    processes): a ready process logs a warning for every garbage collection longer than this
    many seconds (`utils.procs.watch_gc`); unset or 0: none."""
    name = "MINISGL_GC_WARNING_THRESHOLD_SECS"
    value = os.environ.get(name, "").strip()
    try:
        seconds = float(value or 0)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number of seconds") from None
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{name}={value!r}: expected a finite number of seconds >= 0")
    return seconds


def gc_threshold() -> tuple[int, ...] | None:
    """MINISGL_GC_THRESHOLD (`--gc-threshold` sets it for the server's processes): one to three
    integers >= 0, comma-separated, that a ready process gives `gc.set_threshold` (the
    allocations before a generation-0 collection, then how many collections of each generation
    before one of the next); unset or empty: Python's own."""
    name = "MINISGL_GC_THRESHOLD"
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        counts = tuple(int(x) for x in value.split(","))
    except ValueError:
        counts = ()
    if not 1 <= len(counts) <= 3 or min(counts) < 0:
        raise ValueError(f"{name}={value!r}: expected one to three integers >= 0, e.g. 700,10,100")
    return counts


def api_key() -> str | None:
    """MINISGL_API_KEY: the server's API key when `--api-key` is not given (an environment
    variable is private to its user, a command line is not: /proc/PID/cmdline). Empty: none."""
    return os.environ.get("MINISGL_API_KEY") or None


def cpu_float32() -> bool:
    """MINISGL_CPU_FLOAT32: `--dtype auto` on CPU stays float32 even where the CPU computes bf16
    natively (the exact path; the tests set it)."""
    return _flag("MINISGL_CPU_FLOAT32")
