"""`LLM`'s speed settings. Its token budgets on a big GPU (the `llm_defaults` point): offline on
a GPU of >= 70 GiB, prompt chunks (and a step's tokens) of 32k rather than the server's 8192,
whose decodes wait for each chunk (vLLM's rule, 16k there; 32k measured faster on an H200: long
prompts +11 %, bench.py's default workload +3.7 %, docs/benchmarks.md). And no automatic garbage
collection while `generate` steps (the `offline_run` point): each full collection would walk
every output gathered so far (0.55 s -> 0.10 s for half of bench.py's logprob entries on CPU).
Without this package: 8192 unless given, and Python's collector as it is."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from minisgl.utils.device import device_type, resolve_device

OFFLINE_BIG_GPU_CHUNK = 32768
CHUNK_OPTIONS = ("max_prefill_tokens", "max_num_batched_tokens")


def big_gpu(device: str) -> bool:
    """Whether `device` is a CUDA GPU of at least 70 GiB (an H100, H200, B200...)."""
    import torch

    if device_type(device) != "cuda" or not torch.cuda.is_available():
        return False  # (no CUDA: the engine says so)
    return torch.cuda.get_device_properties(resolve_device(device)).total_memory >= 70 << 30


def offline_defaults(config: Any, options: dict[str, Any]) -> dict[str, Any]:
    """`LLM`'s scheduler `options` with 32k-token budgets on a big GPU, unless one is given."""
    if options.keys() & set(CHUNK_OPTIONS) or not big_gpu(config.device):
        return options
    return options | dict.fromkeys(CHUNK_OPTIONS, OFFLINE_BIG_GPU_CHUNK)


@contextmanager
def no_collection() -> Iterator[None]:
    """Automatic garbage collection off inside (back on after, if it was on)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()
