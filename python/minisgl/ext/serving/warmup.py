"""The server's start-up warm-up (the `warm_up` point): a few synthetic requests so that the
kernels compile before the first user's request, not in it."""

from __future__ import annotations

import random
from typing import Any

from minisgl.core import SamplingParams

# the warm-up's prompt lengths: short and long, off and on multiples of 16 (Triton specializes
# integer arguments on divisibility by 16), over a page or several
WARMUP_PROMPT_LENS = (5, 16, 33, 64, 130, 250, 513, 1000)


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
    scheduler.planner.reset_counters()
    if scheduler.spec is not None:
        scheduler.spec.reset_counts()
