"""What the scheduler is asked to do: the token budget of a prefill step and the prefix cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class SchedulerConfig:
    max_prefill_tokens: int = 8192
    cache: Literal["radix", "naive"] = "radix"

    def __post_init__(self) -> None:
        if self.max_prefill_tokens < 1:
            raise ValueError(f"invalid max_prefill_tokens: {self.max_prefill_tokens}")
        if self.cache not in ("radix", "naive"):
            raise ValueError(f"invalid cache {self.cache!r}: expected radix or naive")
