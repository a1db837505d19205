"""`qwen3`: Qwen3's `<think>...</think>` (ordinary tokens). With thinking on, the model opens
the tag itself (or the prompt did: `prompt_opens_reasoning`); with thinking off
(`enable_thinking: false`, the template closes an empty block in the prompt) the response has
no tag and is all content."""

from __future__ import annotations

from minisgl.ext.structured.parsers.reasoning import ReasoningParser
from minisgl.ext.structured.parsers.registry import register_reasoning_parser


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    pass
