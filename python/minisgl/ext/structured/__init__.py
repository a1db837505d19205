"""Structured output's chat side: tool calling and reasoning. The parsers (`parsers/`, one
module per format under vLLM's name) split a response into content, reasoning_content and
tool_calls; `server.py` validates a request's tools and shapes the API server's messages and
stream deltas; `offline.py` does the same for `LLM.chat`, `shell.py` for the shell's display.
Registered as the `chat_features` point: without this package the core refuses tools,
--tool-call-parser and --reasoning-parser."""

from minisgl.ext.structured.features import StructuredChat
from minisgl.extension import extensions

extensions().chat_features = StructuredChat()
