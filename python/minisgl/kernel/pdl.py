"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the
kernel before it in the stream still runs, and waits in `wait_for_previous` until that one has
finished and its writes are visible. Whatever a kernel does before that wait overlaps the
previous kernel: its launch, and reads of memory that no kernel of the step writes (the GEMV's
first weight tile; one request's decode attention, its first block of KV). In a CUDA graph the
launches become programmatic edges.

The rule every kernel launched with `launch_pdl` keeps: nothing another kernel writes is read,
and nothing at all is written, before `wait_for_previous`. The wait also lets the next kernel
launch; kernels of one wave (norms, decode attention) let it launch before they wait (EARLY),
so a GEMV after them reads its first weights while they wait and run. Safe: a kernel launches
only once every program of the one before has started, so all that it waits for holds its SMs
already. Kernels launched without PDL (torch ops, cuBLAS) keep the full stream order, so mixing
both is safe.

Why: one decode stream runs ~280 small kernels per step; each one's launch and ramp-up is time
the GPU reads no weights. MINISGL_DISABLE_PDL=1 turns it off (the ablation)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from minisgl.kernel import flags


@triton.jit
def wait_for_previous(PDL: tl.constexpr, EARLY: tl.constexpr = False):
    """With PDL: wait until the previous kernel has finished, then let the next one launch.
    EARLY (kernels of one wave: norms, attention): let the next one launch first, so that it
    reads its weights while this one waits and runs."""
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not EARLY:
            tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Launch with PDL on this device: CUDA sm_90+, not the interpreter, MINISGL_DISABLE_PDL
    unset (read at every launch, like the other flags: launches are captured once per graph)."""
    if device.type != "cuda" or flags.triton_interpret():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _supported(index) and not flags.disable_pdl()


def options(device: torch.device) -> dict[str, bool]:
    """A PDL kernel's launch keywords: its PDL constexpr (the wait) and `launch_pdl` together,
    never one without the other (a PDL launch whose kernel never waits would race)."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}
