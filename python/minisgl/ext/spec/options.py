"""The speculative-decoding extension's options (the `scheduler_options` point): flags of
`python -m minisgl` listed under "spec extension", keywords of `LLM(...)`, parsed into
`SchedulerConfig.extras["spec"]`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from minisgl.utils.options import OptionError, check_options, int_range, option

DRAFT_OPTION = "speculative_draft_model_path"


@dataclass
class SpecOptions:
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

    def __post_init__(self) -> None:
        check_options(self)
        standalone = self.speculative_algorithm == "standalone"
        if standalone != (self.speculative_draft_model_path is not None):
            raise OptionError(
                DRAFT_OPTION,
                "is required with --speculative-algorithm standalone, and only with it",
            )
        low = self.speculative_ngram_min_match_window_size
        if low > self.speculative_ngram_max_match_window_size:
            raise OptionError(
                "speculative_ngram_min_match_window_size",
                f"must not exceed --speculative-ngram-max-match-window-size, got {low}",
            )

    def resolve_models(self) -> Any:
        """The options with the draft model downloaded (the launcher, once, before any
        scheduler process starts: a bad path fails naming its flag)."""
        from minisgl.models.weight import resolve_model_path

        if self.speculative_draft_model_path is None:
            return self
        path = resolve_model_path(self.speculative_draft_model_path, DRAFT_OPTION)
        return dataclasses.replace(self, speculative_draft_model_path=path)


def spec_options(config: Any) -> SpecOptions:
    """A SchedulerConfig's speculative-decoding options (the defaults, off, when unset)."""
    options = config.extras.get("spec")
    return options if isinstance(options, SpecOptions) else SpecOptions()
