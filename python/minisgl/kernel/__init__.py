"""Custom GPU kernels. Each module imports triton itself and is imported only by the code that
uses it, so this package stays importable on machines without triton."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

from minisgl.kernel import flags

if TYPE_CHECKING:  # torch where used: EngineConfig reads MOE_BACKENDS in processes without it
    import torch


class DecodeRope(NamedTuple):
    """What `triton_attention.decode_attention` needs to apply RoPE itself (q given unrotated):
    this step's k and v [B, Hkv, D] before RoPE, the rotary table, positions [B], the new
    tokens' pool slots [B] and Qwen3's (q weight, k weight, eps) per-head norm. It replaces
    `fused.rotary_store_kv`: each program rotates its query heads, and the program whose split
    reads the new token first writes that token's rotated k and its v to the pool (one launch
    fewer a layer)."""

    k: torch.Tensor
    v: torch.Tensor
    cos_sin: torch.Tensor
    positions: torch.Tensor
    out_loc: torch.Tensor
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None


# CPU modules that extensions register under `fused_ops`' names, with the same functions (ext/cpu:
# "sampling", its C++ Gumbel-max sampler)
CPU_OPS: dict[str, ModuleType] = {}


def fused_ops(x: torch.Tensor, module: str = "fused") -> ModuleType | None:
    """The Triton module `kernel/<module>.py` (the fused ops; "sampling": the Gumbel-max
    sampler), or an extension's kernel module by its dotted name, when `x` is on CUDA, triton
    imports and MINISGL_DISABLE_FUSED_OPS is unset; for a CPU `x` the module registered in
    CPU_OPS, if any. None means: run the torch reference."""
    if flags.disable_fused_ops():
        return None
    if not x.is_cuda:
        return CPU_OPS.get(module) if x.device.type == "cpu" else None
    return _import(module)


# Decode batches up to this many rows make a linear layer a pure weight read: kernel/gemv.py
# streams the weight faster than cuBLAS there. MINISGL_GEMV_MAX_M moves the bound up to
# GEMV_KERNEL_MAX_M, the most rows gemv.py takes (tensor-core tiles of up to 64 rows).
GEMV_MAX_M = 8
GEMV_KERNEL_MAX_M = 64


@functools.cache
def gemv_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes the GEMV takes."""
    import torch

    return (torch.bfloat16, torch.float16, torch.float32)


def gemv_max_m() -> int:
    """The most rows of x that take the GEMV: MINISGL_GEMV_MAX_M, else GEMV_MAX_M."""
    rows = flags.gemv_max_m()
    if rows is None:
        return GEMV_MAX_M
    if rows > GEMV_KERNEL_MAX_M:
        raise ValueError(
            f"MINISGL_GEMV_MAX_M={rows}: the GEMV kernels take at most {GEMV_KERNEL_MAX_M} rows"
        )
    return rows


def gemv_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The device-independent half of `gemv_ops`: x [..., K] has at most `gemv_max_m()` rows,
    weight is a contiguous [N, K] of x's dtype (a supported one) on x's device, and neither
    MINISGL_DISABLE_GEMV nor MINISGL_DISABLE_FUSED_OPS is set. Anything else (bad shapes too)
    goes to F.linear."""
    k = x.shape[-1]
    return (
        0 < k
        # the constant bound first: prefill-sized x never reads the environment
        and x.numel() <= GEMV_KERNEL_MAX_M * k
        and x.numel() <= gemv_max_m() * k
        and weight.dim() == 2
        and weight.shape[1] == k
        and weight.device == x.device
        and x.dtype == weight.dtype
        and x.dtype in gemv_dtypes()
        and weight.is_contiguous()
        and not flags.disable_gemv()
        and not flags.disable_fused_ops()
    )


def gemv_ops(x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
    """The GEMV module (`kernel/gemv.py`) when x is on CUDA, `gemv_eligible(x, weight)` and
    triton imports; None means: F.linear."""
    if not x.is_cuda or not gemv_eligible(x, weight):
        return None
    return _import("gemv")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _import(name: str) -> ModuleType | None:
    """minisgl.kernel.<name> (or the module `name` when dotted), or None without triton (the
    torch path is then the fallback)."""
    if not triton_available():
        return None
    return importlib.import_module(name if "." in name else f"minisgl.kernel.{name}")


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
