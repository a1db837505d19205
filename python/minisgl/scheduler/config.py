"""What the scheduler is asked to do: the token budgets of a step, the order of the waiting
queue, the prefix cache, the JSON grammar's whitespace and the grammar compile deadline.
Every field is an option (utils/options.py), like EngineConfig's."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from minisgl.utils.options import OptionError, check_options, int_range, number, option


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
    schedule_policy: Literal["fcfs", "priority", "lpm"] = option(
        "fcfs",
        "order of the waiting queue: fcfs (arrival), priority (the request's `priority`, lower"
        " first; a higher-priority request may preempt a lower one), lpm (longest cached prefix"
        " first, arrival order beyond 128 waiting)",
        choices=["fcfs", "priority", "lpm"],
    )
    priority_aging: int = option(
        256,
        "priority policy: a request queued this many requests later ranks one priority level"
        " lower, so no request is overtaken forever (0: no aging)",
        type=int_range(0),
    )
    speculative_algorithm: Literal["ngram", "standalone"] | None = option(
        None,
        "speculative decoding: ngram proposes the continuation of the latest earlier match of"
        " a request's last tokens in its prompt and output (prompt lookup); standalone, what a"
        " smaller draft model decodes; verified in one forward; a step that verifies proposals"
        " runs without overlap scheduling (unset: off)",
        choices=["ngram", "standalone"],
    )
    speculative_draft_model_path: str | None = option(
        None,
        "standalone: the draft model (a directory, .gguf or hub id with the target's vocabulary)",
    )
    speculative_num_draft_tokens: int = option(
        4, "tokens proposed per request and step (speculative decoding)", type=int_range(1, 16)
    )
    speculative_max_backoff: int = option(
        16,
        "speculative decoding: a request whose proposals gain nothing (none found, or none"
        " accepted) proposes only every 2nd, 4th, ... step, at most every this many; steps in"
        " which no request proposes overlap like plain decoding (0 or 1: propose at every step,"
        " and no step overlaps)",
        type=int_range(0, 1024),
    )
    speculative_ngram_min_match_window_size: int = option(
        1, "ngram: the shortest suffix of a request's tokens looked up", type=int_range(1)
    )
    speculative_ngram_max_match_window_size: int = option(
        4, "ngram: the longest suffix looked up (the longest match wins)", type=int_range(1)
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

    def __post_init__(self) -> None:
        check_options(self)
        standalone = self.speculative_algorithm == "standalone"
        if standalone != (self.speculative_draft_model_path is not None):
            raise OptionError(
                "speculative_draft_model_path",
                "is required with --speculative-algorithm standalone, and only with it",
            )
        low = self.speculative_ngram_min_match_window_size
        if low > self.speculative_ngram_max_match_window_size:
            raise OptionError(
                "speculative_ngram_min_match_window_size",
                f"must not exceed --speculative-ngram-max-match-window-size, got {low}",
            )
