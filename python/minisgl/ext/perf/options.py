"""The perf extension's options (the `scheduler_options` point): `python -m minisgl --help`
lists them under "perf extension"; keywords of `LLM(...)`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl.utils.options import option


@dataclass
class PerfOptions:
    disable_prefill_graphs: bool = option(
        False,
        "run every prefill step eagerly: by default a prefill or mixed step of at most "
        "--cuda-graph-max-bs tokens (and no proposals, logprobs, grammar or logit "
        "adjustments) replays the decode graphs with one row per position instead, saving "
        "the eager step's ~300 launches (an idle H100's time to first token)",
    )


def perf_options(config: Any) -> PerfOptions:
    """A SchedulerConfig's perf options (the defaults when unset)."""
    options = config.extras.get("perf")
    return options if isinstance(options, PerfOptions) else PerfOptions()
