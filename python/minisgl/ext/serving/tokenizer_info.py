"""vLLM's `GET /tokenizer_info`: the served tokenizer's configuration (what its
tokenizer_config.json holds: special tokens, chat template, class), which clients that tokenize
through the server (lm-eval's `tokenizer_backend=remote`, beside /tokenize and /detokenize) read
instead of fetching the tokenizer from the hub."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from minisgl.ext.serving.api_tokenizer import with_tokenizer
from minisgl.server.protocol import APIError
from minisgl.tokenizer.server import needed


def plain(value: Any) -> Any:
    """`value` as JSON: a special token (transformers' AddedToken) as its text, as vLLM does;
    what JSON cannot hold (a path, a class) as its string."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def tokenizer_info(tok: Any) -> dict[str, Any]:
    """The tokenizer's init arguments (its tokenizer_config.json, special tokens included), its
    class, and the chat template it applies (--chat-template's when given)."""
    tok = needed(tok)
    config: dict[str, Any] = plain(dict(tok.init_kwargs))
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        config[name] = plain(getattr(tok, name, None))  # set after init (a GGUF's, a default)
    config["tokenizer_class"] = type(tok).__name__
    template = getattr(tok, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def add_tokenizer_info_route(app: FastAPI, api: Any, info: dict[str, Any]) -> None:
    """`api`: the core's ApiServer (its tokenizer, loaded once for /tokenize)."""

    async def get_tokenizer_info() -> dict[str, Any]:
        try:
            return await with_tokenizer(api, tokenizer_info, "model")
        except APIError as e:  # a model without a tokenizer: nothing to describe
            raise APIError(404, e.message, code="not_found") from None

    app.get("/tokenizer_info")(get_tokenizer_info)
