"""What the scheduler is asked to do: the token budget of a prefill step, the prefix cache and
the JSON grammar's whitespace.
Every field is an option (utils/options.py), like EngineConfig's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from minisgl.utils.options import check_options, int_range, option


@dataclass
class SchedulerConfig:
    max_prefill_tokens: int = option(
        8192,
        "max prompt tokens computed in one prefill step (longer prompts are chunked)",
        type=int_range(1),
        aliases=["--max-prefill-length"],  # its name before it took SGLang's
    )
    cache: Literal["radix", "naive"] = option(
        "radix", "prefix cache (naive: no prefix sharing)", choices=["radix", "naive"]
    )
    json_any_whitespace: bool = option(
        False,
        "JSON-constrained output (response_format, json_schema) may put any whitespace between"
        " elements; off: compact JSON, so a model cannot pad with whitespace up to max_tokens",
    )

    def __post_init__(self) -> None:
        check_options(self)
