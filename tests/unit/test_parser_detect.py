"""`--tool-call-parser auto` / `--reasoning-parser auto` (ext/structured/detect.py): the format
each family's chat template shows, from the distinctive parts of the real templates (Qwen2.5 /
Qwen3's hermes instructions, Qwen3-Coder's XML, Mistral's [TOOL_CALLS], Llama 3.1's JSON
instruction and <|python_tag|>, Qwen3's and DeepSeek-R1's think tags) in small templates; the
choice is logged with its reason; `none` and explicit names pass as they are; ServerArgs and
LLM.chat default to auto."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from minisgl.ext.structured.detect import resolve
from minisgl.server.args import ServerArgs
from support.tokenizer import build_tiny_tokenizer

TURNS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
HERMES = (  # Qwen2.5 / Qwen3's tool instructions
    "{% if tools %}<|im_start|>system\n# Tools\n\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools>\n\nFor each function call, return a json object with function name "
    'and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
)
QWEN3_CODER = (  # Qwen3-Coder's: the XML example (its template has <tool_call> too)
    "{% if tools %}If you choose to call a function ONLY reply in the following format:\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n</function>\n</tool_call>\n{% endif %}"
)
MISTRAL = (
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{% endif %}{% endfor %}"
)
LLAMA3 = (  # Llama 3.1-3.3's
    "{% if tools %}Given the following functions, please respond with a JSON for a function "
    "call with its proper arguments that best answers the given prompt.\n\nRespond in the "
    'format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "{% endif %}{% if builtin_tools %}<|python_tag|>{% endif %}"
)
QWEN3_THINKING = (  # Qwen3's generation prompt: an empty block when thinking is off
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined "
    "and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
R1_THINKING = (  # DeepSeek-R1's (and QwQ's): the generation prompt opens the reasoning
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "tool", "reasoning"),
    [
        (TURNS, None, None),  # SmolLM2's kind: no tools, no reasoning
        (HERMES + TURNS, "hermes", None),
        (HERMES + TURNS + QWEN3_THINKING, "hermes", "qwen3"),
        (QWEN3_CODER + HERMES + TURNS, "qwen3_coder", None),
        (MISTRAL, "mistral", None),
        (LLAMA3 + TURNS, "llama3_json", None),
        (TURNS + R1_THINKING, None, "deepseek_r1"),
    ],
)
def test_auto_picks_the_template_format(
    template: str, tool: str | None, reasoning: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = template
    with caplog.at_level(logging.INFO, logger="minisgl"):
        assert resolve("auto", "auto", tokenizer) == (tool, reasoning)
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"--tool-call-parser auto: {tool or 'none'} (" in line
    assert f"--reasoning-parser auto: {reasoning or 'none'} (" in line


def test_explicit_names_and_none(caplog: pytest.LogCaptureFixture) -> None:
    tokenizer: Any = build_tiny_tokenizer()
    tokenizer.chat_template = HERMES + TURNS
    with caplog.at_level(logging.INFO, logger="minisgl"):
        assert resolve("mistral", "none", tokenizer) == ("mistral", None)
        assert resolve("none", "deepseek_r1", None) == (None, "deepseek_r1")
    assert not caplog.records  # nothing detected, nothing said
    assert resolve("auto", "auto", None) == (None, None)  # no tokenizer: no template


def test_server_args_default_to_auto() -> None:
    from minisgl.ext.structured.options import ChatOptions, chat_options

    args = chat_options(ServerArgs())
    assert (args.tool_call_parser, args.reasoning_parser) == ("auto", "auto")
    off = ChatOptions(tool_call_parser="none", reasoning_parser="none")
    off = chat_options(ServerArgs(extras={"structured": off}))
    assert (off.tool_call_parser, off.reasoning_parser) == (None, None)
