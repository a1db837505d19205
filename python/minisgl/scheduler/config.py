"""What the scheduler is asked to do: the token budgets of a step, the order of the waiting
queue, the prefix cache, the JSON grammar's whitespace and the grammar compile deadline.
Every field is an option (utils/options.py), like EngineConfig's."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from minisgl.extension import ExtensionMissing, check_extension_options, extensions
from minisgl.utils.options import (
    OptionError,
    check_options,
    int_range,
    number,
    option,
    split_options,
)


def positive_seconds(value: str) -> float:
    x = number(value, float, "seconds")
    if not 0 < x < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return x


@dataclass
class SchedulerConfig:
    max_prefill_tokens: int = option(
        8192,
        "max prompt tokens computed in one prefill step (longer prompts are chunked)",
        type=int_range(1),
        aliases=["--max-prefill-length", "--chunked-prefill-size"],  # older name, SGLang's
    )
    max_num_batched_tokens: int = option(
        8192,
        "token budget of a step that mixes running decodes (one token each, always all of them)"
        " with prompt chunks, which fill what the decodes leave (up to --max-prefill-tokens)",
        type=int_range(1),
    )
    disable_mixed_steps: bool = option(
        False,
        "steps compute either prompt chunks or decodes, never both (running streams then pause"
        " during prefills: the ablation of mixed steps)",
    )
    schedule_policy: str = option(
        "fcfs",
        "order of the waiting queue: fcfs (arrival); the serving extension's priority (the"
        " request's `priority`, lower first; a higher-priority request may preempt a lower one)"
        " and lpm (longest cached prefix first, arrival order beyond 128 waiting)",
    )
    priority_aging: int = option(
        256,
        "priority policy: a request queued this many requests later ranks one priority level"
        " lower, so no request is overtaken forever (0: no aging)",
        type=int_range(0),
    )
    cache: Literal["radix", "naive"] = option(
        "radix",
        "prefix cache (naive: no prefix sharing)",
        choices=["radix", "naive"],
        switches={  # SGLang's, vLLM's
            "--disable-radix-cache": "naive",
            "--no-enable-prefix-caching": "naive",
            "--enable-prefix-caching": "radix",
        },
    )
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
    # the extensions' options for the schedulers (`Extensions.scheduler_options`) by extension,
    # each its dataclass: every scheduler process gets them (speculative decoding's...)
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_options(self)
        self._check_policy()
        for name, options in extensions().scheduler_options.items():
            self.extras.setdefault(name, options())  # the defaults of those not given

    @staticmethod
    def from_options(options: Mapping[str, Any]) -> SchedulerConfig:
        """From option values (`LLM(...)`'s keywords): its fields and the extensions' scheduler
        options, which go into `extras`. TypeError naming an unknown option; ExtensionMissing
        for one of an extension missing here."""
        own = extensions().scheduler_options
        configs = (SchedulerConfig, *own.values())
        known = {f.name for config in configs for f in fields(config)}
        check_extension_options([name for name in options if name not in known])
        mine, *theirs = split_options(options, *configs)
        extras = {name: cls(**o) for (name, cls), o in zip(own.items(), theirs)}
        return SchedulerConfig(**mine, extras=extras)

    def _check_policy(self) -> None:
        """fcfs is the core's order; the others are the extensions' (`admission_policies`)."""
        name, names = self.schedule_policy, ["fcfs", *extensions().admission_policies]
        if name not in names:
            known = f"invalid schedule_policy {name!r}: expected one of {', '.join(names)}"
            missing = ExtensionMissing(f"--schedule-policy {name}", "serving")
            raise OptionError("schedule_policy", known if len(names) > 1 else str(missing))
