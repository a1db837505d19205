"""The sampler's arguments for a list of requests, as the engine builds them from a step's
inputs (tests call `minisgl.engine.sample.sample` directly)."""

from __future__ import annotations

from typing import Any

import torch

from minisgl.core import Req
from minisgl.engine.sample import Filters, any_filter


def sampling_args(reqs: list[Req], vocab: int, device: torch.device) -> tuple[Any, ...]:
    """(temperature, seed, step, filters) of `sample`, each request sampling at its end."""
    temperature = torch.tensor([r.params.sampling_temperature for r in reqs], device=device)
    seed = torch.tensor([r.seed for r in reqs], device=device)
    step = torch.tensor([len(r.tokens) for r in reqs], device=device)
    filters = Filters.of(reqs, vocab, device) if any_filter(reqs, vocab) else None
    return temperature, seed, step, filters
