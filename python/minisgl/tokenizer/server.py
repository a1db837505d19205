"""The tokenizer worker process: each request's text or chat -> token ids for the detokenizer
and the scheduler; and the chat template, rendered here for the server and `LLM`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BatchMsg,
    DetokInitMsg,
    ExitMsg,
    TokenizeMsg,
    UserMsg,
    UserReply,
)
from minisgl.utils.procs import build_or_report, freeze_startup_heap
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

logger = logging.getLogger(__name__)
PROMPT_CONTEXT = 5  # prompt tokens decoded before the output, the context of its first word


def needed(tokenizer: Any | None) -> Any:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: send token ids instead of text")
    return tokenizer


def render_chat(tokenizer: Any, chat: list[dict], template_kwargs: dict | None = None) -> str:
    """The chat as the template renders it with `template_kwargs` (e.g. tools, enable_thinking),
    ready for the assistant's turn unless they say add_generation_prompt=False."""
    if not getattr(needed(tokenizer), "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
    return tokenizer.apply_chat_template(chat, **kwargs, tokenize=False)


def encode_chat(tokenizer: Any, chat: list[dict], template_kwargs: dict | None = None) -> list[int]:
    text = render_chat(tokenizer, chat, template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)  # the template has its own


def tokenize(tokenizer: Any, msg: TokenizeMsg) -> list[int]:
    if msg.input_ids is not None:
        ids = list(msg.input_ids)
    elif msg.chat is not None:
        tools = {"tools": msg.tools} if msg.tools else {}  # rendered by the template
        ids = encode_chat(tokenizer, msg.chat, {**(msg.chat_template_kwargs or {}), **tools})
    else:
        ids = needed(tokenizer).encode(msg.text)
    # vLLM's refusal (a prompt too long by itself is the scheduler's, which knows the limit)
    limit, asked = msg.context_len, msg.params.max_tokens
    if limit is not None and len(ids) < limit < len(ids) + asked:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({asked}) = {len(ids) + asked} tokens is "
            f"longer than the context: at most {limit} tokens per request"
        )
    return ids


class TokenizerWorker:
    """Tokenizes each request and sends it on to the detokenizer and the scheduler, or answers
    its error (a bad chat template input fails only its request)."""

    def __init__(self, tokenizer: Any, to_sched: list[Any], to_detok: Any, to_api: Any):
        self.tokenizer, self.to_scheds, self.to_detok = tokenizer, to_sched, to_detok
        self.to_api = to_api  # the API process's queue (the launcher's `api_queue`)

    def handle(self, msg: Any) -> None:
        if isinstance(msg, AbortMsg):  # same pipe as the request: never overtakes it
            self.to_scheds[0].put(AbortBackendMsg(msg.uid))
        elif isinstance(msg, TokenizeMsg):
            self.forward(msg, lambda: tokenize(self.tokenizer, msg))
        else:
            logger.error("tokenizer: dropped an unexpected %s message", type(msg).__name__)

    def forward(self, msg: TokenizeMsg, token_ids: Callable[[], list[int]]) -> None:
        try:
            ids = token_ids()
        except Exception as e:  # a bad chat template input etc.: fail this request only
            return self.fail(msg.uid, e)
        self.send(msg, ids, 0)

    def send(self, msg: TokenizeMsg, ids: list[int], rank: int) -> None:
        """The tokenized request to replica `rank`'s scheduler, and how to detokenize it."""
        params, tail, skip = msg.params, ids[-PROMPT_CONTEXT:], msg.skip_special_tokens
        stop, min_tokens = list(params.stop), params.get("min_tokens")
        self.to_detok.put(DetokInitMsg(msg.uid, len(ids), tail, stop, skip, min_tokens, rank))
        self.to_scheds[rank].put(UserMsg(msg.uid, ids, params))

    def fail(self, uid: int, error: Exception) -> None:
        self.to_api.put(BatchMsg([UserReply(uid, "", [], True, "error", 0, 0, str(error))]))

    def serve(self, recv: Any) -> None:
        while not isinstance(msg := recv.get(), ExitMsg):
            self.handle(msg)


def run_tokenizer(
    model_path: str,
    recv_addr: str,
    sched_addrs: list[str],
    detok_addr: str,
    api_queue: Callable[[], Any],
    ready: Any,
    worker: Callable[..., TokenizerWorker] = TokenizerWorker,
) -> None:
    """`sched_addrs`: one per --dp replica; `api_queue`, `worker`: the launcher's."""
    from minisgl.models.hf import load_tokenizer

    def build() -> tuple[ZmqPullQueue, TokenizerWorker]:
        tokenizer = load_tokenizer(model_path)
        scheds = [ZmqPushQueue(a, create=False) for a in sched_addrs]
        detok = ZmqPushQueue(detok_addr, create=False)
        return ZmqPullQueue(recv_addr, create=True), worker(tokenizer, scheds, detok, api_queue())

    recv, tokenizer_worker = build_or_report("tokenizer", ready, build)
    freeze_startup_heap()
    ready.send(("ready", None))
    tokenizer_worker.serve(recv)
