"""The scheduler's options (utils/options.py): a step's token budgets, the queue, the cache."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from minisgl.extension import ExtensionMissing, check_extension_options, extensions
from minisgl.utils.options import OptionError, check_options, int_range, option, split_options


@dataclass
class SchedulerConfig:
    # None: an extension's budget for the model and GPU (`Extensions.scheduler_config`), else
    # the planner's STEP_TOKENS
    max_prefill_tokens: int | None = option(
        None,
        "max prompt tokens in one step (longer prompts are chunked); unset: 8192 or ext/perf's",
        type=int_range(1),
        aliases=["--max-prefill-length", "--chunked-prefill-size"],  # older name, SGLang's
    )
    max_num_batched_tokens: int | None = option(
        None,
        "a step's tokens: every running decode (one each), then prompt chunks; unset: as above",
        type=int_range(1),
    )
    disable_mixed_steps: bool = option(
        False,
        "steps compute either prompt chunks or decodes, never both (the ablation of mixed steps)",
    )
    schedule_policy: str = option(
        "fcfs",
        "order of the waiting queue: fcfs (arrival); the serving extension's priority and lpm",
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
    # the extensions' options for the schedulers (`Extensions.scheduler_options`) by extension,
    # each its dataclass: every scheduler process gets them (speculative decoding's...)
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_options(self)
        policies = ["fcfs", *extensions().admission_policies]  # fcfs is the core's
        if self.schedule_policy not in policies:
            missing = ExtensionMissing(f"--schedule-policy {self.schedule_policy}", "serving")
            known = f"invalid schedule_policy {self.schedule_policy!r}: expected one of "
            message = known + ", ".join(policies) if len(policies) > 1 else str(missing)
            raise OptionError("schedule_policy", message)
        for name, options in extensions().scheduler_options.items():
            self.extras.setdefault(name, options())  # the defaults of those not given

    @staticmethod
    def from_options(options: Mapping[str, Any]) -> SchedulerConfig:
        """From `LLM(...)`'s keywords, the extensions' into `extras` (TypeError: an unknown one)."""
        own = extensions().scheduler_options
        configs = (SchedulerConfig, *own.values())
        known = {f.name for config in configs for f in fields(config)}
        check_extension_options([name for name in options if name not in known])
        mine, *theirs = split_options(options, *configs)
        extras = {name: cls(**o) for (name, cls), o in zip(own.items(), theirs)}
        return SchedulerConfig(**mine, extras=extras)
