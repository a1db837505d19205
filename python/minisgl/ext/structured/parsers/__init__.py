"""Tool-call and reasoning parsers for chat responses (the server, the shell and `LLM.chat`
share them). A format is one module registering a `ToolParser` or `ReasoningParser` subclass
under vLLM's name; it is imported here so that it registers."""

from minisgl.ext.structured.parsers import (  # noqa: F401 (register)
    deepseek_r1,
    hermes,
    llama3_json,
    mistral,
    qwen3,
    qwen3_coder,
)
from minisgl.ext.structured.parsers.base import (
    IdFactory,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolStream,
    counter_ids,
    random_call_id,
)
from minisgl.ext.structured.parsers.output import OutputParser, OutputStream
from minisgl.ext.structured.parsers.reasoning import ReasoningParser, ReasoningStream
from minisgl.ext.structured.parsers.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ToolParser,
    get_reasoning_parser,
    get_tool_parser,
)
from minisgl.ext.structured.parsers.schema import (
    FunctionSchema,
    ToolChoice,
    ToolSpecError,
    parse_tools,
    resolve_tool_choice,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "FunctionSchema",
    "IdFactory",
    "OutputParser",
    "OutputStream",
    "ParsedOutput",
    "ReasoningParser",
    "ReasoningStream",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "ToolParser",
    "ToolSpecError",
    "ToolStream",
    "counter_ids",
    "get_reasoning_parser",
    "get_tool_parser",
    "parse_tools",
    "random_call_id",
    "resolve_tool_choice",
]
