"""The server's start-up warm-up (the `warm_up` point, `warm_up_when_needed`): a few synthetic
requests so that the kernels compile before the first user's request, not in it."""

from __future__ import annotations

import random
from typing import Any

from minisgl.core import SamplingParams

# the warm-up's prompt lengths: short and long, off and on multiples of 16 (Triton specializes
# integer arguments on divisibility by 16), over a page or several
WARMUP_PROMPT_LENS = (5, 16, 33, 64, 130, 250, 513, 1000)


def needs_warm_up(engine: Any) -> bool:
    """Kernels compile at first use: on CUDA, or in a compiled decoder that says so
    (--enable-torch-compile's; one compiled ahead of time does not)."""
    compiled = engine.compiled_decoder
    warm = compiled is not None and getattr(compiled, "needs_warm_up", True)
    return engine.device.type == "cuda" or warm


def warm_up_when_needed(scheduler: Any) -> None:
    """The `warm_up` point: `warm_up` where the engine's kernels compile at first use."""
    if needs_warm_up(scheduler.engine):
        warm_up(scheduler)


def warm_up(scheduler: Any) -> None:
    """Serve synthetic requests of varied lengths (greedy and sampled; prefill, mixed and
    decode steps); then flush the prefix cache and zero the counters."""
    engine = scheduler.engine
    vocab, room = engine.model_config.vocab_size, engine.max_seq_len - 8
    rng = random.Random(0)
    for group in (WARMUP_PROMPT_LENS[::2], WARMUP_PROMPT_LENS[1::2]):
        for i, length in enumerate(group):
            ids = [rng.randrange(vocab) for _ in range(max(1, min(length, room)))]
            params = SamplingParams(temperature=0.6 * (i % 2), max_tokens=4, ignore_eos=True)
            scheduler.add_request(scheduler.make_request(ids, params))
        for _ in range(2):
            scheduler.step()
    if engine.compiled_decoder is not None:  # a lone decode: its compile happens now
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        ids = [rng.randrange(vocab) for _ in range(4)]
        scheduler.add_request(scheduler.make_request(ids, params))
    while scheduler.has_work:
        scheduler.step()
    scheduler.flush_cache()
    planner = scheduler.planner
    planner.num_preemptions = planner.num_prefill_tokens = planner.num_cached_tokens = 0
    if scheduler.spec is not None:
        scheduler.spec.reset_counts()
