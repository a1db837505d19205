"""The structured extension's scheduler options (the `scheduler_options` point): flags of
`python -m minisgl` listed under "structured extension", keywords of `LLM(...)`, and
`SchedulerConfig.extras["structured"]` in every scheduler process."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from minisgl.utils.options import number, option


def positive_seconds(value: str) -> float:
    x = number(value, float, "seconds")
    if not 0 < x < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return x


@dataclass
class StructuredOptions:
    json_any_whitespace: bool = option(
        False,
        "JSON-constrained output (response_format, json_schema) may put any whitespace between"
        " elements; off: compact JSON, so a model cannot pad with whitespace up to max_tokens",
    )
    grammar_compile_timeout: float = option(
        30.0,
        "seconds a constrained request's grammar may take to compile (counted from its arrival,"
        " or from its compile's start when it waited for a free compiler process); past it the"
        " compile is stopped and the request ends with an error, while the others go on",
        type=positive_seconds,
    )


def structured_options(config: Any) -> StructuredOptions:
    """A SchedulerConfig's structured options (the defaults when unset)."""
    options = config.extras.get("structured")
    return options if isinstance(options, StructuredOptions) else StructuredOptions()
