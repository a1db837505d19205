"""The last program of a launch (or of a group of its programs) finishes the work: each program
counts itself in on a zeroed counter, and the one that arrives last reads what the others wrote
and applies the epilogue, in the same kernel instead of a second launch after it. Used by the
split-KV decode attention (the merge of a request's splits) and the GEMV (residual add and
RMSNorm of the whole output row).

One buffer of counters per device serves every such kernel: each counting launch leaves its
counters at zero, and launches never count at the same time (a kernel counts only after its PDL
wait, when the kernel before it has finished)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def last_to_arrive(counter, arrivals, FENCE: tl.constexpr):
    """Count this program in on `counter`; True in the one program that arrives last, which
    zeroes the counter again. Every program's writes before the call are visible to that one
    (a GPU-scope fence per thread, then one acq_rel atomic); it should read them past L1
    (cache_modifier=".cg"). FENCE False: the interpreter, which runs one program at a time."""
    if FENCE:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu; // dummy $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel") == arrivals - 1
    if last:
        tl.store(counter, 0)
    return last


def fence_needed(device: torch.device) -> bool:
    """FENCE for tensors on `device`: on a GPU (the interpreter's are CPU tensors)."""
    return device.type == "cuda"


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 0
    )
    return torch.zeros(max(1024, 4 * sms), dtype=torch.int32, device=device)


def counters(device: torch.device, needed: int) -> torch.Tensor:
    """At least `needed` zeroed int32 counters on `device`. Allocated at the first call, which
    must not be inside a CUDA-graph capture: the graph runner runs each batch size eagerly
    before it captures it."""
    buf = _counters(device)
    assert needed <= buf.numel(), f"{needed} counters wanted, {buf.numel()} allocated"
    return buf
