"""`python -m minisgl --shell`: chat with the model in the terminal, its answer streamed.
/reset forgets the conversation; /exit or Ctrl-D leaves; Ctrl-C stops an answer."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from minisgl.core import SamplingParams
from minisgl.extension import extensions
from minisgl.message import TokenizeMsg
from minisgl.server.frontend import Frontend

if TYPE_CHECKING:
    from minisgl.server.launch import Launcher


class Printer:
    """One answer's printing as it streams; `answer`: what the history keeps."""

    def __init__(self) -> None:
        self.answer: list[str] = []

    def feed(self, text: str) -> None:
        self.answer.append(text)
        print(text, end="", flush=True)

    def close(self) -> None:
        """The answer is over (also when it was stopped)."""


Printers = Callable[[list[dict[str, str]]], Printer]  # a history -> its answer's printer


async def _print_answer(frontend: Frontend, msg: TokenizeMsg, printer: Printer) -> None:
    try:
        async for batch in frontend.batches([msg]):  # left early (Ctrl-C): aborted
            for _, reply in batch:
                if reply.error:
                    printer.close()
                    print(f"[error] {reply.error}", flush=True)
                    return
                printer.feed(reply.text_delta)
    finally:
        printer.close()  # also when Ctrl-C stops the answer


async def _chat(frontend: Frontend, max_tokens: int, printers: Printers) -> int:
    from prompt_toolkit import PromptSession

    frontend.start()
    session: PromptSession = PromptSession()
    history: list[dict[str, str]] = []
    print("Type a message. /reset clears the history, /exit (or Ctrl-D) quits.", flush=True)
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
        printer = printers(history)
        # Ctrl-C cancels the answer (leaving the stream aborts the request), not the shell
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


def make_printers(launcher: Launcher) -> Printers:
    """Each answer's printer: its text as it comes, or ext/structured's (--reasoning-parser)."""
    features = extensions().chat_features
    printers = features.shell_printers(launcher.args) if features is not None else None
    return printers or (lambda history: Printer())


def run_shell(launcher: Launcher, frontend: Frontend, max_tokens: int = 512) -> int:
    """The front end of `launch_server` for `--shell`."""
    max_tokens = min(max_tokens, launcher.info["max_seq_len"] - 1)
    return asyncio.run(_chat(frontend, max_tokens, make_printers(launcher)))
