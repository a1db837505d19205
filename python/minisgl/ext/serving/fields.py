"""The serving extension's request fields: what a body's undeclared fields mean here (the
`unknown_fields` point: OpenAI's fields that change nothing or that this server cannot honour,
SGLang's /generate fields, others ignored with a warning as vLLM does), a request's `priority`
(the `request_fields` point), and the bounds on the work one request asks for before it is
admitted (the `request_checks` point): the tokenizer worker and the detokenizer serve every
request in turn, so one huge request would hold up all the others. The prompt's own size is
bounded by the tokenizer worker (`worker.check_prompt_size`), the body's by
--max-request-bytes, a grammar's by the structured extension. docs/features.md ("Limits")."""

from __future__ import annotations

import logging
from typing import Any

from minisgl.ext.serving.options import serving_options
from minisgl.ext.serving.sglang import check_generate_extras
from minisgl.server.protocol import APIError, ExtensionFields, Int64

logger = logging.getLogger(__name__)
MAX_STOP_STRINGS = 128  # each is searched for in every new piece of text (detokenizer)
MAX_STOP_CHARS = 4096  # per stop string
MAX_MESSAGES = 4096  # chat messages rendered by the template in one request

# OpenAI fields minisgl cannot honour yet: a 400 naming the field unless given an "off" value
NOT_SUPPORTED = {
    "/v1/chat/completions": {
        "audio": "audio output",
        "modalities": "output modalities other than text",
        "prediction": "predicted outputs",
        "web_search_options": "web search",
    },
    "/v1/completions": {"suffix": "suffixes (insertion)", "best_of": "best_of"},
}
# values that ask for nothing (compared by identity first: 0 is not False)
OFF_VALUES: tuple[Any, ...] = ("", [], {})
OFF_PAIRS = (("best_of", 1),)
# OpenAI fields that change nothing in what this server computes: accepted without a warning
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier"})


class PriorityFields(ExtensionFields):
    priority: Int64 = 0  # --schedule-policy priority: lower first (vLLM's direction)

    def params(self, req: Any) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)


class DataParallelFields(ExtensionFields):
    data_parallel_rank: Int64 | None = None  # SGLang's: the --dp replica to run on

    def apply(self, msgs: list[Any], args: Any) -> None:
        rank = self.data_parallel_rank
        if rank is None:
            return
        if not 0 <= rank < (dp := serving_options(args).dp):
            message = f"data_parallel_rank must be in [0, {dp}) (--dp {dp})"
            raise APIError(400, message, "data_parallel_rank")
        for msg in msgs:
            msg.dp_rank = rank


def check_limits(msg: Any) -> None:
    """Refuse a request (its first TokenizeMsg) over one of the limits above."""
    stop = msg.params.stop
    if len(stop) > MAX_STOP_STRINGS:
        message = f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}"
        raise APIError(400, message, "stop", "limit_exceeded")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        message = f"stop: a stop string has at most {MAX_STOP_CHARS} characters, got {longest}"
        raise APIError(400, message, "stop", "limit_exceeded")
    if msg.chat is not None and len(msg.chat) > MAX_MESSAGES:
        message = f"messages: at most {MAX_MESSAGES} messages, got {len(msg.chat)}"
        raise APIError(400, message, "messages", "limit_exceeded")


class UnknownFields:
    """Warns about request fields this server ignores, once per name and then at 10, 100, ...
    uses (a client may send thousands of distinct names: at most MAX_NAMES are remembered,
    the rest counted together), so that no request can fill the log."""

    MAX_NAMES = 256
    SHOWN = 5  # names shown in one warning

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.others = 0  # uses of names beyond MAX_NAMES

    def __call__(self, path: str, extra: dict[str, Any]) -> None:
        """A body's fields that no one declares: SGLang's on /generate (at their defaults), the
        unsupported ones refused unless off, those of no effect accepted, the others warned."""
        if path == "/generate":
            return check_generate_extras(extra)
        not_supported = NOT_SUPPORTED.get(path, {})
        for name, value in extra.items():
            off = value is None or value is False or value in OFF_VALUES
            if name in not_supported and not off and (name, value) not in OFF_PAIRS:
                what = not_supported[name]
                message = f"{name}: {what} is not supported"
                raise APIError(400, message, name, "unsupported_parameter")
        self.seen(path, [n for n in extra if n not in not_supported and n not in NO_EFFECT])

    def seen(self, path: str, names: list[str]) -> None:
        new, again = [], []
        for name in names:
            if name not in self.counts and len(self.counts) >= self.MAX_NAMES:
                self.others += 1
                if _power_of_ten(self.others):
                    again.append(f"{self.others} of other names")
                continue
            count = self.counts[name] = self.counts.get(name, 0) + 1
            if count == 1:
                new.append(name)
            elif _power_of_ten(count):
                again.append(f"{_shown(name)} {count} times")
        if new:
            shown = ", ".join(map(_shown, new[: self.SHOWN]))
            more = f" and {len(new) - self.SHOWN} more" if len(new) > self.SHOWN else ""
            logger.warning("%s: ignoring unknown fields %s%s", path, shown, more)
        if again:
            logger.warning("%s: unknown fields ignored so far: %s", path, ", ".join(again))


def _power_of_ten(n: int) -> bool:
    return n >= 10 and str(n).rstrip("0") == "1"


def _shown(name: str) -> str:
    return repr(name if len(name) <= 64 else name[:61] + "...")
