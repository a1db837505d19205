"""Attention backends (`fi`: flashinfer, `triton`, `torch`: the reference, any device), made by
`create_attention_backend("auto" | NAME | "PREFILL,DECODE", ...)` (a pair: ext/perf's)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from minisgl.extension import extensions, require

if TYPE_CHECKING:  # the backends (torch) are imported where made: EngineConfig checks names only
    import torch

    from minisgl.attention.base import BaseAttnBackend

BACKENDS = ("fi", "triton", "torch")


def parse_attn(value: str) -> tuple[str, str]:
    """ "auto" | NAME | "PREFILL,DECODE" -> (prefill, decode) names; ValueError otherwise."""
    names = [n.strip().lower() for n in value.split(",")]
    if names == ["auto"]:
        return ("auto", "auto")
    if len(names) > 2 or any(n not in BACKENDS for n in names):
        raise ValueError(
            f"unknown attention backend {value!r}: expected 'auto', one of "
            f"{', '.join(BACKENDS)}, or PREFILL,DECODE (e.g. 'fi,triton')"
        )
    if names[0] != names[-1]:  # a pair of two backends: ext/perf's
        require(extensions().hybrid_attention, f"the attention backend pair {value!r}", "perf")
    return (names[0], names[-1])


@functools.cache
def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # not installed, or built for another CUDA / torch
        return False
    return True


def auto_backend(
    device: torch.device, kv_dtype: torch.dtype | None, sliding_window: int | None
) -> str:
    """--attn auto: triton on CUDA, torch elsewhere; for a sliding window fi or torch."""
    # triton: measured faster than fi on the H100 (docs/benchmarks.md, session 11); it has no
    # sliding windows: fi then, when flashinfer imports and the KV cache is 16-bit (None:
    # unknown, taken as 16-bit); ext/perf may pair fi's prefill with triton's decode
    if device.type != "cuda":
        return "torch"
    if sliding_window is None:
        return "triton"
    sixteen_bit = kv_dtype is None or kv_dtype.itemsize == 2
    return "fi" if sixteen_bit and flashinfer_available() else "torch"


def create_attention_backend(
    name: str | tuple[str, str],  # as --attn reads, or (prefill, decode) already parsed
    device: torch.device,
    sliding_window: int | None = None,
    dtype: torch.dtype | None = None,  # the model's; None: unknown (auto assumes 16-bit)
    num_qo_heads: int | None = None,  # query heads on this rank; fi needs it to plan
    kv_dtype: torch.dtype | None = None,  # the KV pool's, when it differs from dtype
) -> BaseAttnBackend:
    prefill, decode = parse_attn(name) if isinstance(name, str) else name
    if prefill == "auto":
        prefill = decode = auto_backend(device, kv_dtype or dtype, sliding_window)
        if decode == "triton" and (pick := extensions().auto_prefill) is not None:
            prefill = pick(device, kv_dtype or dtype)  # ext/perf's: fi on Hopper

    def make(one: str) -> BaseAttnBackend:
        if one == "fi":
            from minisgl.attention.fi_backend import FlashInferAttnBackend

            return FlashInferAttnBackend(device, num_qo_heads, kv_dtype or dtype, sliding_window)
        if one == "triton":
            from minisgl.attention.triton_backend import TritonAttnBackend

            return TritonAttnBackend(sliding_window)
        from minisgl.attention.torch_backend import TorchAttnBackend

        return TorchAttnBackend(sliding_window)

    # fi made first: its refusals (dtypes, CUDA) name the fix whatever the other backend is
    made = {one: make(one) for one in sorted({prefill, decode}, key=lambda one: one != "fi")}
    if prefill == decode:
        return made[prefill]
    hybrid = require(extensions().hybrid_attention, f"--attn {prefill},{decode}", "perf")
    return hybrid(made[prefill], made[decode])
