"""vLLM's /tokenize and /detokenize (the `routes` point), with the API process's tokenizer
(`api_tokenizer.py`: the workers' files and --chat-template), under the completions'
size limits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import Field

from minisgl.core import SamplingParams, check_token_ids
from minisgl.ext.serving.api_tokenizer import with_tokenizer
from minisgl.ext.serving.fields import check_limits
from minisgl.ext.serving.worker import check_prompt_size, prompt_chars
from minisgl.extension import ExtensionMissing, extensions, require
from minisgl.message import TokenizeMsg
from minisgl.server.protocol import (
    APIError,
    Body,
    ChatMessage,
    Int64,
    TemplateKwargs,
    chat_messages,
)
from minisgl.tokenizer.server import needed, render_chat

if TYPE_CHECKING:  # types only: the extension loads while the api server module may be loading
    from minisgl.server.api_server import ApiServer


class TokenizeRequest(Body):
    """vLLM's /tokenize: a completion prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    tools: Any = None  # rendered as in a chat request (the structured extension checks them)
    # vLLM's: unset, as the server encodes a completion's prompt (the tokenizer's BOS...) or a
    # chat (none: the template writes them)
    add_special_tokens: bool | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[Int64]


async def tokenize(api: ApiServer, req: TokenizeRequest) -> dict[str, Any]:
    """A prompt that could not fit in the context is refused before it is tokenized (a 15 MB
    one took 14 s and 1.4 GB)."""
    api.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt")
    limit, special = api.max_seq_len, req.add_special_tokens
    if req.messages is None:
        text = req.prompt or ""

        def encode(tok: Any) -> list[int]:
            check_prompt_size(tok, len(text), limit)
            return needed(tok).encode(text, add_special_tokens=special is not False)

        return tokens(api, await with_tokenizer(api, encode, "prompt"))
    chat, kwargs, tools = chat_messages(req.messages), req.chat_template_kwargs, None
    msg = TokenizeMsg(-1, None, None, chat, SamplingParams())
    check_limits(msg)
    if req.tools is not None:
        try:
            features = require(extensions().chat_features, "tools", "structured")
        except ExtensionMissing as e:
            raise APIError(400, str(e), "tools") from None
        msg.tools = tools = features.template_tools(req.tools)
    kwargs = {"add_generation_prompt": req.add_generation_prompt, **(kwargs or {})}
    if tools:
        kwargs["tools"] = tools

    def encode_messages(tok: Any) -> list[int]:
        check_prompt_size(tok, prompt_chars(msg), limit)
        # add_special_tokens: the tokenizer's special tokens around the template's text
        return needed(tok).encode(render_chat(tok, chat, kwargs), add_special_tokens=bool(special))

    return tokens(api, await with_tokenizer(api, encode_messages, "messages"))


def tokens(api: ApiServer, ids: list[int]) -> dict[str, Any]:
    return {"tokens": ids, "count": len(ids), "max_model_len": api.max_seq_len}


async def detokenize(api: ApiServer, req: DetokenizeRequest) -> dict[str, Any]:
    api.check_model(req.model)
    if len(req.tokens) > api.max_seq_len:  # the one size limit: what a context holds
        message = f"tokens: at most {api.max_seq_len} tokens (the context), got {len(req.tokens)}"
        raise APIError(400, message, "tokens", "limit_exceeded")

    def decode(tok: Any) -> str:
        check_token_ids(len(needed(tok)), tokens=req.tokens)
        return tok.decode(req.tokens)

    return {"prompt": await with_tokenizer(api, decode, "tokens")}


def add_tokenize_routes(app: FastAPI, api: ApiServer, info: dict[str, Any]) -> None:
    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest) -> dict[str, Any]:
        return await tokenize(api, req)

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest) -> dict[str, Any]:
        return await detokenize(api, req)
