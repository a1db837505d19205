"""The structured extension's flags of `python -m minisgl`, listed under "structured extension":
its scheduler options (the `scheduler_options` point: also keywords of `LLM(...)`, and
`SchedulerConfig.extras["structured"]` in every scheduler process) and its server's (the
`options` point: `ServerArgs.extras["structured"]`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl.ext.serving.options import positive_seconds
from minisgl.ext.structured.detect import AUTO, NONE
from minisgl.ext.structured.parsers import REASONING_PARSERS, TOOL_PARSERS
from minisgl.utils.options import OptionError, option

# the options naming a format, and the formats they may name
FORMATS: dict[str, dict[str, Any]] = {
    "tool_call_parser": TOOL_PARSERS,
    "reasoning_parser": REASONING_PARSERS,
}


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


@dataclass
class ChatOptions:
    """The formats of the model's tool calls and reasoning, for the server and the shell (the
    launcher resolves `auto`, `resolve_parsers`; `none` is None)."""

    tool_call_parser: str | None = option(
        AUTO,
        "format of the model's tool calls (vLLM's names, e.g. hermes); auto: the chat "
        "template's, none: off",
    )
    reasoning_parser: str | None = option(
        AUTO,
        "format of the model's reasoning, returned as reasoning_content (vLLM's names, e.g. "
        "qwen3); auto: the chat template's, none: off",
    )
    shell_hide_reasoning: bool = option(
        False, "with --shell and --reasoning-parser: leave the reasoning out of the answers"
    )

    def check(self, args: Any) -> None:
        """Each format a known one (argparse's words: the flags used to declare choices)."""
        for name, known in FORMATS.items():
            value = getattr(self, name)
            if value == NONE:
                setattr(self, name, None)
            elif value is not None and value != AUTO and value not in known:
                names = ", ".join([AUTO, NONE, *sorted(known)])
                raise OptionError(name, f"invalid choice: {value!r} (choose from {names})")
        if self.shell_hide_reasoning and not (args.shell and self.reasoning_parser):
            raise OptionError("shell_hide_reasoning", "needs --shell and --reasoning-parser")


def chat_options(args: Any) -> ChatOptions:
    """A ServerArgs' chat options (the defaults when unset)."""
    options = args.extras.get("structured")
    return options if isinstance(options, ChatOptions) else ChatOptions()
