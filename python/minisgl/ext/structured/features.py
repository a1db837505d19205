"""`StructuredChat`: the structured extension's `chat_features` point (extension.ChatFeatures),
each method handing the core's question to the module that answers it. Those modules are
imported on first use: the server's pulls in FastAPI, which an `LLM` or a scheduler process
(which load the extensions too) would import for nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from minisgl.ext.structured.detect import AUTO, NONE
from minisgl.ext.structured.parsers import REASONING_PARSERS, TOOL_PARSERS
from minisgl.utils.options import OptionError

if TYPE_CHECKING:
    from minisgl.ext.structured.server import ChatParsing

# the options naming a format, and the formats they may name
FORMATS: dict[str, dict[str, Any]] = {
    "tool_call_parser": TOOL_PARSERS,
    "reasoning_parser": REASONING_PARSERS,
}


class StructuredChat:
    """Tool calls and reasoning for the API server, `LLM.chat` and the shell."""

    def check_option(self, name: str, value: str) -> None:
        # argparse's words for a value outside a flag's choices: the flag used to declare them
        known = FORMATS[name]
        if value not in known and value not in (AUTO, NONE):
            names = ", ".join([AUTO, NONE, *sorted(known)])
            raise OptionError(name, f"invalid choice: {value!r} (choose from {names})")

    def resolve_parsers(self, args: Any, model_path: str) -> None:
        from minisgl.ext.structured.detect import resolve
        from minisgl.tokenizer.server import load_chat_tokenizer

        tool, reasoning = args.tool_call_parser, args.reasoning_parser
        tokenizer = None
        if AUTO in (tool, reasoning):
            tokenizer = load_chat_tokenizer(model_path, args.chat_template)
        args.tool_call_parser, args.reasoning_parser = resolve(tool, reasoning, tokenizer)
        if getattr(args, "shell_hide_reasoning", False) and args.reasoning_parser is None:
            message = "needs --shell and --reasoning-parser (auto found no think tags in the "
            raise OptionError("shell_hide_reasoning", message + "chat template)")

    def template_tools(self, tools: Any) -> list[dict[str, Any]] | None:
        from minisgl.ext.structured import server

        return server.template_tools(tools)

    def history_calls(self, calls: Any, where: str) -> list[dict[str, Any]]:
        from minisgl.ext.structured import server

        return server.history_tool_calls(calls, where)

    async def shape_chat(
        self, req: Any, chat: list[dict[str, Any]], api: Any
    ) -> tuple[list[dict[str, Any]] | None, ChatParsing | None]:
        from minisgl.ext.structured import server

        return await server.shape_chat(req, chat, api)

    def offline_chat(
        self, llm: Any, chats: list[list[dict[str, Any]]], params: list[Any], **options: Any
    ) -> list[dict[str, Any]]:
        from minisgl.ext.structured import offline

        return offline.offline_chat(llm, chats, params, **options)

    def shell_printers(self, args: Any) -> Callable[[list[dict[str, str]]], Any]:
        from minisgl.ext.structured import shell

        return shell.shell_printers(args)
