"""The shell's answers with --reasoning-parser: the thinking shown dimmed (ANSI faint, on a
terminal) before the answer, or left out with --shell-hide-reasoning; the history keeps the
answers only, as chat clients send them back."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from minisgl.ext.structured.options import chat_options
from minisgl.ext.structured.parsers import OutputStream, get_reasoning_parser
from minisgl.shell import Printer

DIM, UNDIM = "\x1b[2m", "\x1b[22m"  # SGR faint on, normal intensity


class ReasoningPrinter(Printer):
    """One answer's printing, fed the text as it streams: reasoning dimmed (or dropped), then
    the answer on a line of its own."""

    def __init__(self, stream: OutputStream, hide: bool, ansi: bool) -> None:
        super().__init__()
        self.stream, self.hide, self.ansi = stream, hide, ansi
        self.dimmed = False  # the terminal is in faint mode
        self.thought = False  # reasoning was printed: the answer starts on a new line
        self.closed = False

    def feed(self, text: str) -> None:
        piece = self.stream.feed(text)
        self.show(piece.reasoning, piece.content)

    def show(self, reasoning: str, content: str) -> None:
        if reasoning and not self.hide:
            self.write(reasoning, dim=True)
            self.thought = True
        if content:
            if self.thought:
                self.write("\n", dim=False)
                self.thought = False
            self.answer.append(content)
            self.write(content, dim=False)

    def close(self) -> None:
        """Flush what the parser held back; leave the terminal as it was."""
        if self.closed:
            return
        self.closed = True
        piece = self.stream.finish()
        self.show(piece.reasoning, piece.content)
        if self.dimmed:
            self.write("", dim=False)

    def write(self, text: str, dim: bool) -> None:
        if self.ansi and dim != self.dimmed:
            text = (DIM if dim else UNDIM) + text
            self.dimmed = dim
        print(text, end="", flush=True)


def shell_printers(args: Any) -> Callable[[list[dict[str, str]]], Printer]:
    """The printer of the answer to each history, for `args` (ServerArgs) with a reasoning
    parser; the prompt is rendered (the model's tokenizer, --chat-template) only for a format
    that the template may open, to see whether it did."""
    options = chat_options(args)
    assert options.reasoning_parser is not None  # StructuredChat.shell_printers
    reasoning = get_reasoning_parser(options.reasoning_parser)
    hide, ansi = options.shell_hide_reasoning, sys.stdout.isatty()
    tokenizer = None
    if not reasoning.starts_in_reasoning:
        from minisgl.ext.serving.options import serving_options
        from minisgl.ext.serving.template import load_chat_tokenizer
        from minisgl.models.weight import resolve_model_path

        path = resolve_model_path(args.engine.model or "")
        tokenizer = load_chat_tokenizer(path, serving_options(args).chat_template)

    def printer(history: list[dict[str, str]]) -> Printer:
        opened = False
        if tokenizer is not None:
            from minisgl.tokenizer.server import render_chat

            try:
                prompt = render_chat(tokenizer, history)
            except Exception:  # noqa: BLE001 (the tokenizer worker reports the template's error)
                prompt = ""
            opened = reasoning.prompt_opens_reasoning(prompt)
        return ReasoningPrinter(OutputStream(reasoning.stream(opened), None), hide, ansi)

    return printer
