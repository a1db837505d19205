"""`python -m minisgl --shell`: chat with the model in the terminal, streaming its answer.
/reset forgets the conversation; /exit or Ctrl-D leaves."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg
from minisgl.server.frontend import Frontend

if TYPE_CHECKING:
    from minisgl.server.launch import Launcher

HELP = "Type a message. /reset clears the history, /exit (or Ctrl-D) quits."


async def _print_answer(frontend: Frontend, msg: TokenizeMsg, answer: list[str]) -> None:
    async for reply in frontend.stream(msg):
        if reply.error:
            print(f"[error] {reply.error}", flush=True)
            return
        answer.append(reply.text_delta)
        print(reply.text_delta, end="", flush=True)


async def _chat(frontend: Frontend, max_tokens: int) -> int:
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
        answer: list[str] = []
        # Ctrl-C stops the answer (leaving the stream aborts the request), not the shell.
        task = asyncio.ensure_future(_print_answer(frontend, msg, answer))
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
        history.append({"role": "assistant", "content": "".join(answer)})


def run_shell(launcher: Launcher, frontend: Frontend, max_tokens: int = 512) -> int:
    """The front end of `launch_server` for `--shell`."""
    max_tokens = min(max_tokens, launcher.info["max_seq_len"] - 1)
    return asyncio.run(_chat(frontend, max_tokens))
