"""`python -m minisgl --shell`: chat with the model in the terminal, streaming its answer.
/reset forgets the conversation; /exit or Ctrl-D leaves. With --reasoning-parser the thinking
is shown dimmed (ANSI faint, on a terminal) before the answer, or left out with
--shell-hide-reasoning; the history keeps the answers only, as chat clients send them back."""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg
from minisgl.parsers import OutputStream, ReasoningParser, get_reasoning_parser
from minisgl.server.frontend import Frontend

if TYPE_CHECKING:
    from minisgl.server.launch import Launcher

HELP = "Type a message. /reset clears the history, /exit (or Ctrl-D) quits."
DIM, UNDIM = "\x1b[2m", "\x1b[22m"  # SGR faint on, normal intensity


@dataclass
class Display:
    """How answers are printed: `reasoning` (None: no reasoning parser, the raw text) splits the
    thinking off, shown dimmed unless `hide_reasoning`; `tokenizer` renders the prompt to see
    whether the template opened the thinking itself (None: not looked at)."""

    reasoning: ReasoningParser | None = None
    hide_reasoning: bool = False
    tokenizer: Any = None
    ansi: bool = field(default_factory=lambda: sys.stdout.isatty())

    def printer(self, history: list[dict[str, str]]) -> Printer:
        """The printer of the answer to `history`."""
        if self.reasoning is None:
            return Printer(self, None)
        opened = False
        if self.tokenizer is not None and not self.reasoning.starts_in_reasoning:
            from minisgl.tokenizer.server import render_chat

            try:
                prompt = render_chat(self.tokenizer, history, None, True)
            except Exception:  # noqa: BLE001 (the tokenizer worker reports the template's error)
                prompt = ""
            opened = self.reasoning.prompt_opens_reasoning(prompt)
        return Printer(self, OutputStream(self.reasoning.stream(opened), None))


class Printer:
    """One answer's printing, fed the text as it streams: reasoning dimmed (or dropped), then
    the answer on a line of its own; `answer` collects the answer for the history."""

    def __init__(self, display: Display, stream: OutputStream | None) -> None:
        self.display, self.stream = display, stream
        self.answer: list[str] = []
        self.dimmed = False  # the terminal is in faint mode
        self.thought = False  # reasoning was printed: the answer starts on a new line
        self.closed = False

    def feed(self, text: str, final: bool = False) -> None:
        if self.stream is None:
            self._answer(text)
            return
        piece = self.stream.finish() if final else self.stream.feed(text)
        if piece.reasoning and not self.display.hide_reasoning:
            self._print(piece.reasoning, dim=True)
            self.thought = True
        if piece.content:
            if self.thought:
                self._print("\n", dim=False)
                self.thought = False
            self._answer(piece.content)

    def close(self) -> None:
        """Flush what the parser held back; leave the terminal as it was."""
        if self.closed:
            return
        self.closed = True
        if self.stream is not None:
            self.feed("", final=True)
        if self.dimmed:
            self._print("", dim=False)

    def _answer(self, text: str) -> None:
        self.answer.append(text)
        self._print(text, dim=False)

    def _print(self, text: str, dim: bool) -> None:
        if self.display.ansi and dim != self.dimmed:
            text = (DIM if dim else UNDIM) + text
            self.dimmed = dim
        print(text, end="", flush=True)


async def _print_answer(frontend: Frontend, msg: TokenizeMsg, printer: Printer) -> None:
    try:
        async for reply in frontend.stream(msg):
            if reply.error:
                printer.close()
                print(f"[error] {reply.error}", flush=True)
                return
            printer.feed(reply.text_delta)
    finally:
        printer.close()  # also when Ctrl-C stops the answer


async def _chat(frontend: Frontend, max_tokens: int, display: Display) -> int:
    from prompt_toolkit import PromptSession

    frontend.start()
    session: PromptSession = PromptSession()
    history: list[dict[str, str]] = []
    print(HELP, flush=True)
    while True:
        try:
            line = (await session.prompt_async("> ")).strip()
        except EOFError:
            return 0
        except KeyboardInterrupt:
            continue
        if not line:
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            history.clear()
            print("(history cleared)", flush=True)
            continue
        history.append({"role": "user", "content": line})
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        msg = TokenizeMsg(frontend.new_uid(), None, None, list(history), params)
        printer = display.printer(history)
        # Ctrl-C stops the answer (leaving the stream aborts the request), not the shell.
        task = asyncio.ensure_future(_print_answer(frontend, msg, printer))
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, task.cancel)
        try:
            await asyncio.wait({task})
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            task.cancel()  # no-op unless this coroutine itself is being cancelled
        if not task.cancelled():
            task.result()  # re-raise its error, if any
        print(flush=True)
        history.append({"role": "assistant", "content": "".join(printer.answer)})


def make_display(launcher: Launcher) -> Display:
    """The display of --reasoning-parser and --shell-hide-reasoning; the prompt is rendered
    (the model's tokenizer, --chat-template) only for a format that the template may open."""
    args = launcher.args
    if args.reasoning_parser is None:
        return Display()
    reasoning = get_reasoning_parser(args.reasoning_parser)
    tokenizer = None
    if not reasoning.starts_in_reasoning:
        from minisgl.models.weight import resolve_model_path
        from minisgl.tokenizer.server import load_chat_tokenizer

        path = resolve_model_path(args.engine.model or "")
        tokenizer = load_chat_tokenizer(path, args.chat_template)
    return Display(reasoning, args.shell_hide_reasoning, tokenizer)


def run_shell(launcher: Launcher, frontend: Frontend, max_tokens: int = 512) -> int:
    """The front end of `launch_server` for `--shell`."""
    max_tokens = min(max_tokens, launcher.info["max_seq_len"] - 1)
    return asyncio.run(_chat(frontend, max_tokens, make_display(launcher)))
