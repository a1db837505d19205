"""`deepseek_r1`: DeepSeek-R1 (and its distills), whose newer templates open `<think>` in the
prompt, so the response starts inside the reasoning without an opening tag: the text up to
`</think>` is reasoning (an opening tag the model writes anyway is dropped), all of it when the
response never closes it."""

from __future__ import annotations

from minisgl.ext.structured.parsers.reasoning import ReasoningParser
from minisgl.ext.structured.parsers.registry import register_reasoning_parser


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True
