"""`StructuredChat`: the structured extension's `chat_features` point (extension.ChatFeatures),
each method handing the core's question to the module that answers it. Those modules are
imported on first use: the server's pulls in FastAPI, which an `LLM` or a scheduler process
(which load the extensions too) would import for nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from minisgl.ext.structured.detect import AUTO
from minisgl.ext.structured.options import chat_options
from minisgl.utils.options import OptionError

if TYPE_CHECKING:
    from minisgl.ext.structured.server import ChatParsing


class StructuredChat:
    """Tool calls and reasoning for the API server, `LLM.chat` and the shell."""

    def resolve_parsers(self, args: Any, model_path: str) -> None:
        from minisgl.ext.serving.options import serving_options
        from minisgl.ext.serving.template import load_chat_tokenizer
        from minisgl.ext.structured.detect import resolve

        options = chat_options(args)
        tool, reasoning = options.tool_call_parser, options.reasoning_parser
        tokenizer = None
        if AUTO in (tool, reasoning):
            tokenizer = load_chat_tokenizer(model_path, serving_options(args).chat_template)
        options.tool_call_parser, options.reasoning_parser = resolve(tool, reasoning, tokenizer)
        if options.shell_hide_reasoning and options.reasoning_parser is None:
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

    def shell_printers(self, args: Any) -> Callable[[list[dict[str, str]]], Any] | None:
        if chat_options(args).reasoning_parser is None:
            return None  # the core's: the text as it comes
        from minisgl.ext.structured import shell

        return shell.shell_printers(args)
