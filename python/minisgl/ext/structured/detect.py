"""`--tool-call-parser auto` / `--reasoning-parser auto` (the defaults): the formats a model's
chat template shows, as vLLM's and SGLang's users pick them by hand. The template teaches the
model its tool-call format, so the format's tag in it is the sign: Qwen3-Coder's
`<function=` (its template has `<tool_call>` too: checked first), hermes' `<tool_call>`
(Qwen2.5, Qwen3, Hermes), Mistral's `[TOOL_CALLS]`, Llama 3.1-3.3's `<|python_tag|>` or their
JSON instruction. Reasoning: a template with `<think>` thinks; when its generation prompt opens
`<think>` (DeepSeek-R1, QwQ, Qwen3's thinking-2507 models) the answer starts inside the
reasoning (deepseek_r1), else the model opens it itself or the template closes an empty block
(qwen3). `none`: off; any other value names the format."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("minisgl")

AUTO, NONE = "auto", "none"
# (tool call parser, its sign in the chat template), the first match wins
TOOL_SIGNS = (
    ("qwen3_coder", "<function="),
    ("hermes", "<tool_call>"),
    ("mistral", "[TOOL_CALLS]"),
    ("llama3_json", "<|python_tag|>"),
    ("llama3_json", '"parameters": dictionary of argument name'),
)
THINK = "<think>"


def template_text(tokenizer: Any) -> str:
    """The chat template's text (all of a tokenizer's named templates), "" without one."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def tool_format(template: str) -> tuple[str | None, str]:
    """The tool call parser the template shows, and why."""
    if not template:
        return None, "the model has no chat template"
    for name, sign in TOOL_SIGNS:
        if sign in template:
            return name, f"the chat template has {sign!r}"
    return None, "no tool call format recognised in the chat template"


def reasoning_format(template: str, tokenizer: Any) -> tuple[str | None, str]:
    """The reasoning parser the template shows, and why."""
    if THINK not in template:
        return None, f"no {THINK} in the chat template"
    try:
        chat = [{"role": "user", "content": "hi"}]
        prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that wants more than a user turn: it thinks, qwen3's way
        prompt = ""
    if isinstance(prompt, str) and prompt.rstrip().endswith(THINK):
        return "deepseek_r1", f"the chat template's generation prompt opens {THINK}"
    return "qwen3", f"the chat template has {THINK}"


def resolve(tool: str | None, reasoning: str | None, tokenizer: Any) -> tuple[str | None, ...]:
    """(tool call parser, reasoning parser) for the options' values: `auto` detected from the
    tokenizer's chat template (logged, with the reason), `none` off, a name as it is."""
    template = template_text(tokenizer)
    chosen: list[str | None] = []
    said: list[str] = []
    for flag, value, detect in (
        ("--tool-call-parser", tool, lambda: tool_format(template)),
        ("--reasoning-parser", reasoning, lambda: reasoning_format(template, tokenizer)),
    ):
        if value == AUTO:
            name, why = detect()
            said.append(f"{flag} auto: {name or 'none'} ({why})")
            value = name
        chosen.append(None if value == NONE else value)
    if said:
        logger.info("; ".join(said))
    return tuple(chosen)
