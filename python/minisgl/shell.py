"""`python -m minisgl --shell`: chat with the model in the terminal, streaming its answer.
/reset forgets the conversation; /exit or Ctrl-D leaves."""

from __future__ import annotations

import asyncio
from typing import Any

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg
from minisgl.server.frontend import Frontend

HELP = "Type a message. /reset clears the history, /exit (or Ctrl-D) quits."


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
        answer = ""
        try:
            async for reply in frontend.stream(msg):
                if reply.error:
                    print(f"[error] {reply.error}", flush=True)
                    break
                answer += reply.text_delta
                print(reply.text_delta, end="", flush=True)
        except KeyboardInterrupt:
            pass
        print(flush=True)
        history.append({"role": "assistant", "content": answer})


def run_shell(frontend: Frontend, info: dict[str, Any], max_tokens: int = 512) -> int:
    return asyncio.run(_chat(frontend, min(max_tokens, info["max_seq_len"] - 1)))
