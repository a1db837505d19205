"""What every parser shares: tool-call ids, the OpenAI-shaped results and stream pieces, and
`ToolStream`, the incremental machinery of tool-call parsing that each format specialises.

Non-streamed parsing is streamed parsing fed the whole text at once, so both always agree.
Every decision of a stream depends only on the text, never on how it was split: a state that
cannot decide yet waits for more text (or for the end) without consuming anything.
"""

from __future__ import annotations

import itertools
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minisgl.ext.structured.parsers.json_scan import WHITESPACE, CallObject, Scan
from minisgl.tokenizer.detokenize import partial_suffix  # the stop strings' withholding, too

IdFactory = Callable[[], str]
_ALPHANUMERIC = string.ascii_letters + string.digits


def random_call_id() -> str:
    """An OpenAI-style tool call id: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


def counter_ids(prefix: str = "call_") -> IdFactory:
    """Deterministic ids (prefix0, prefix1, ...), for tests."""
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter)}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the model's JSON text of the arguments

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class ToolCallDelta:
    """One call's piece of a stream chunk: id and name come once, first; then arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, str] = {}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            function["name"] = self.name
        if self.arguments or self.name is not None:
            function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass
class StreamDelta:
    """What one piece of model text adds to the response (any part may be empty)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def add_call(self, index: int, id: str | None = None, name: str | None = None) -> None:
        self.tool_calls.append(ToolCallDelta(index, id, name))

    def extend(self, other: StreamDelta) -> None:
        """Append `other`, a later piece of the same response."""
        self.content += other.content
        self.reasoning += other.reasoning
        for call in other.tool_calls:
            if call.id is not None or call.name is not None:
                self.tool_calls.append(call)
            else:
                self.add_arguments(call.index, call.arguments)

    def add_arguments(self, index: int, text: str) -> None:
        if self.tool_calls and self.tool_calls[-1].index == index:
            self.tool_calls[-1].arguments += text
        else:
            self.tool_calls.append(ToolCallDelta(index, arguments=text))


@dataclass
class ParsedOutput:
    """A whole response: `content` None when empty (as OpenAI sends it beside tool calls)."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def find_first(text: str, start: int, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest occurrence of any of `tags` at or after `start`."""
    hits = [(i, tag) for tag in tags if (i := text.find(tag, start)) >= 0]
    return min(hits) if hits else None


class ToolStream:
    """One response's tool-call parser, fed text deltas as the detokenizer produces them.

        Outside calls the stream is in the content state: `openers` start a format's call region
        (`open_region`); text that could still become an opener, and whitespace that could precede
        one, is withheld. Whitespace next to a call (before its opener, after its end) frames it and
        is not content. A call is committed (id and name sent) once its name is read; before that,
        a malformed region is reverted: its text is content and scanning resumes after its opener.
        After the commit, malformed text ends the call (its arguments as far as they went) and is
        content. At the end, withheld text is released and an open call ends as it stands: cut
    (`finish(cut=True)`: the response ran out of tokens) its arguments stay as far as they went,
    never completed by the parser."""

    openers: tuple[str, ...] = ()

    def __init__(self, new_id: IdFactory) -> None:
        self.new_id = new_id
        self.text = ""
        self.pos = 0  # first character not consumed
        self.final = False
        self.cut = False  # the response ended before the model did (max_tokens): see finish
        # the request's functions' parameter schemas by name (a format whose arguments are not
        # JSON reads them by these)
        self.schemas: dict[str, dict[str, Any]] = {}
        self.state: Callable[[], bool] = self.content_state
        self.after_call = False  # whitespace right after a call is dropped
        self.region_start = self.region_skip = 0  # revert: content to `skip`, rescan from there
        self.ids: list[str] = []
        self.names: list[str] = []
        self.arguments: list[str] = []
        self.call: CallObject | None = None
        self.committed = False  # the current call's id and name have been sent
        self.out = StreamDelta()

    # ---- public -------------------------------------------------------------------------
    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        self._run()
        return self._take()

    def finish(self, cut: bool = False) -> StreamDelta:
        """The end of the text; `cut`: the response was cut (finish_reason other than "stop"),
        so an open call is not complete and keeps its arguments as they are."""
        self.final, self.cut = True, cut
        self._run()
        self.end_call()
        return self._take()

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(*call) for call in zip(self.ids, self.names, self.arguments)]

    # ---- machinery ----------------------------------------------------------------------
    def _run(self) -> None:
        while self.state():
            pass
        keep = min(self.pos, self.region_start)
        if keep > 4096:  # the text before `keep` is never read again
            self.text = self.text[keep:]
            self.pos -= keep
            self.region_start -= keep
            self.region_skip -= keep

    def _take(self) -> StreamDelta:
        out, self.out = self.out, StreamDelta()
        return out

    def content_state(self) -> bool:
        text, pos = self.text, self.pos
        if self.after_call:
            while pos < len(text) and text[pos] in WHITESPACE:
                pos += 1
            self.pos = pos
            if pos == len(text):
                return False
            self.after_call = False
        hit = find_first(text, pos, self.openers)
        if hit is not None:
            index, opener = hit
            self.out.content += text[pos:index].rstrip(WHITESPACE)
            self.region_start, self.pos = index, index + len(opener)
            self.region_skip = self.pos
            self.open_region(opener)
            return True
        end = len(text) if self.final else len(text) - partial_suffix(text[pos:], self.openers)
        body = text[pos:end] if self.final else text[pos:end].rstrip(WHITESPACE)
        self.out.content += body
        self.pos = pos + len(body)
        return False

    def open_region(self, opener: str) -> None:
        """Enter the format's call region right after `opener` (self.pos is past it)."""
        raise NotImplementedError

    def to_content(self, after_call: bool = False) -> bool:
        self.state, self.after_call = self.content_state, after_call
        self.region_start = self.region_skip = self.pos
        return True

    def revert(self) -> bool:
        """The region since the last committed point is not a call: it is content."""
        self.out.content += self.text[self.region_start : self.region_skip]
        self.pos = self.region_skip
        return self.to_content()

    def skip_whitespace(self) -> bool:
        """Consume whitespace; True when a non-whitespace character is at `pos`."""
        text, pos = self.text, self.pos
        while pos < len(text) and text[pos] in WHITESPACE:
            pos += 1
        self.pos = pos
        return pos < len(text)

    def literal(self, tag: str) -> bool | None:
        """Whether `tag` is at `pos` (not consumed); None while the text is too short to say."""
        rest = self.text[self.pos : self.pos + len(tag)]
        if rest == tag:
            return True
        if not self.final and tag.startswith(rest):
            return None
        return False

    def commit(self, name: str) -> None:
        index = len(self.ids)
        self.ids.append(self.new_id())
        self.names.append(name)
        self.arguments.append("")
        self.committed = True
        self.out.add_call(index, self.ids[-1], name)

    def send_arguments(self, full: str) -> None:
        """Send what `full` (the current call's arguments so far) adds to what was sent."""
        new = full[len(self.arguments[-1]) :]
        if new:
            self.arguments[-1] = full
            self.out.add_arguments(len(self.ids) - 1, new)

    def end_call(self) -> None:
        """The current call is over: a complete call without any argument text gets "{}"; one
        cut by the end of the response keeps what it has (a stand-in would look complete)."""
        if self.committed and not self.arguments[-1] and not (self.final and self.cut):
            self.send_arguments("{}")
        self.call, self.committed = None, False
        self.region_start = self.region_skip = self.pos

    def feed_call(self) -> Scan | None:
        """Feed the current call object from `pos`: DONE or ERROR once it ends, None while it
        needs more text (or the text ended: the caller decides at the end)."""
        call, text, pos = self.call, self.text, self.pos
        assert call is not None
        result: Scan | None = None
        while pos < len(text):
            step = call.feed(text[pos])
            if step == Scan.ERROR:
                result = step
                break
            pos += 1
            if step == Scan.DONE:
                result = step
                break
        self.pos = pos
        if call.name is not None and not self.committed:
            self.commit(call.name)
        if self.committed:
            self.send_arguments(call.arguments)
        return result

    def call_state(self, after: Callable[[], bool]) -> bool:
        """Read a call object at `pos`, then go to `after`; malformed text reverts (before the
        commit) or ends the call (after)."""
        if self.call is None:
            if not self.skip_whitespace():
                return self.final and self.revert()
            self.call = CallObject()
        result = self.feed_call()
        if result == Scan.DONE:
            self.end_call()
            self.state = after
            return True
        if result == Scan.ERROR or self.final:
            return self.fail()
        return False

    def closing_tag(self, tag: str) -> bool:
        """After a call: `tag` (optional: a missing one leaves what follows as content)."""
        if not self.skip_whitespace() and not self.final:
            return False
        found = self.literal(tag)
        if found is None:
            return False
        if found:
            self.pos += len(tag)
        return self.to_content(after_call=True)

    def fail(self) -> bool:
        """Malformed or truncated text in a region."""
        if not self.committed:
            self.call = None
            return self.revert()
        self.end_call()
        return self.to_content()
