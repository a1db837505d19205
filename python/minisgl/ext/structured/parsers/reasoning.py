"""Reasoning parsers: the thinking between `<think>` and `</think>` goes to
`reasoning_content`, the rest to `content`.

A response is in reasoning from its start when its opening tag comes first (after whitespace),
when the prompt already ended with the opening tag (templates that open the thinking for the
model: `prompt_opens_reasoning`), or always for formats that say so (`starts_in_reasoning`:
DeepSeek-R1). Otherwise it is all content: a parser never invents reasoning. Whitespace
around the reasoning and between `</think>` and the answer frames them and is dropped. A
response cut inside the reasoning has no content."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from minisgl.ext.structured.parsers.json_scan import WHITESPACE
from minisgl.tokenizer.detokenize import partial_suffix


class ReasoningStream:
    """One response's reasoning parser, fed text deltas; each call returns the (reasoning,
    content) text it releases."""

    def __init__(self, start_tag: str, end_tag: str, in_reasoning: bool) -> None:
        self.start_tag, self.end_tag, self.in_reasoning = start_tag, end_tag, in_reasoning
        self.text = ""
        self.final = False
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.state: Callable[[], bool] = self.opening
        self.leading = True  # at the start of the reasoning

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        while self.state():
            pass
        return self._take()

    def finish(self) -> tuple[str, str]:
        self.final = True
        while self.state():
            pass
        return self._take()

    def _take(self) -> tuple[str, str]:
        out = "".join(self.reasoning), "".join(self.content)
        self.reasoning.clear()
        self.content.clear()
        return out

    def opening(self) -> bool:
        rest = self.text.lstrip(WHITESPACE)
        if rest.startswith(self.start_tag):
            self.text = rest[len(self.start_tag) :]
            self.state = self.thinking
            return True
        if not self.final and self.start_tag.startswith(rest):
            return False  # whitespace or a piece of the tag so far
        self.state = self.thinking if self.in_reasoning else self.answer
        return True

    def thinking(self) -> bool:
        text = self.text
        if self.leading:  # whitespace after the opening tag frames the reasoning
            text = self.text = text.lstrip(WHITESPACE)
            if not text:
                return False
            self.leading = False
        index = text.find(self.end_tag)
        if index >= 0:
            self.reasoning.append(text[:index].rstrip(WHITESPACE))
            self.text = text[index + len(self.end_tag) :]
            self.state = self.after_thinking
            return True
        # withheld: a possible piece of the end tag, and whitespace that may precede it
        held = 0 if self.final else partial_suffix(text, (self.end_tag,))
        body = text[: len(text) - held].rstrip(WHITESPACE)
        self.reasoning.append(body)
        self.text = "" if self.final else text[len(body) :]
        return False

    def after_thinking(self) -> bool:
        self.text = self.text.lstrip(WHITESPACE)
        if self.text:
            self.state = self.answer
            return True
        return False

    def answer(self) -> bool:
        if self.text:
            self.content.append(self.text)
            self.text = ""
        return False


class ReasoningParser:
    """A reasoning format: its tags and whether responses start inside the reasoning."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    starts_in_reasoning: ClassVar[bool] = False

    def prompt_opens_reasoning(self, prompt: str) -> bool:
        """Whether the rendered prompt ends inside an opened reasoning block."""
        return self.prompt_reasoning(prompt) is True

    def prompt_reasoning(self, prompt: str) -> bool | None:
        """Where the rendered prompt leaves the response: True inside a reasoning block the
        template opened, False after one it closed (thinking off: Qwen3's `enable_thinking:
        false` renders an empty block), None neither (the model may open one itself)."""
        end = prompt.rstrip(WHITESPACE)
        if end.endswith(self.start_tag):
            return True
        return False if end.endswith(self.end_tag) else None

    def stream(self, in_reasoning: bool | None = False) -> ReasoningStream:
        """A parser for one response; `in_reasoning`: the prompt opened the reasoning."""
        start = bool(in_reasoning) or self.starts_in_reasoning
        return ReasoningStream(self.start_tag, self.end_tag, start)

    def parse(self, text: str, in_reasoning: bool | None = False) -> tuple[str | None, str]:
        """(reasoning or None when there is none, content) of a whole response."""
        stream = self.stream(in_reasoning)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, content + more_content

    def structural_prefix(self, in_reasoning: bool | None = None) -> dict[str, Any] | None:
        """The structural-tag format of the reasoning before a constrained answer: free text up
        to the end tag (which the answer follows after a blank line, as the templates do).
        `in_reasoning` is `prompt_reasoning`'s: True (or a format that starts in reasoning) the
        block is already open and must be closed; None the model may open one (optional);
        False the prompt closed it: None, the constraint holds from the first token."""
        think = {"type": "any_text", "excludes": [self.end_tag]}
        end = self.end_tag + "\n\n"
        if in_reasoning or self.starts_in_reasoning:
            return {"type": "tag", "begin": "", "content": think, "end": end}
        if in_reasoning is False:
            return None
        block = {"type": "tag", "begin": self.start_tag, "content": think, "end": end}
        return {"type": "optional", "content": block}
