"""A random tiny qwen3 checkpoint for tool calling: the tiny tokenizer with the tool and
reasoning tags, and a chat template that renders hermes tools and, like Qwen3's, closes an
empty reasoning block at the end of the prompt when `enable_thinking` is false. Its free
output is noise: what it emits under a grammar shows what the grammar enforces."""

from __future__ import annotations

import json
import os

from support.models import save_model
from support.scripted import TOOL_CHAT_TEMPLATE
from support.tokenizer import build_tiny_tokenizer

THINKING_OFF = (
    "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}"
)
# bounded arguments: a random model would otherwise write one endless string
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_forecast": FORECAST, "get_time": CLOCK}


def make_random_tool_model(path: str) -> str:
    save_model("qwen3", path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["max_position_embeddings"] = 2048  # the tools' schemas take ~550 tokens to render
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tokenizer = build_tiny_tokenizer(tool_tokens=True)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE + THINKING_OFF
    tokenizer.save_pretrained(path)
    return path
