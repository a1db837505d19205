"""The tokenizer worker process: each request's text or chat -> token ids, handed to the
detokenizer and the scheduler; and the chat template, rendered here for the server and `LLM`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BatchFrontendMsg,
    DetokInitMsg,
    DoneMsg,
    ExitMsg,
    FlushCacheReply,
    SchedulerStats,
    TokenizeMsg,
    UserMsg,
    UserReply,
)
from minisgl.utils.options import OptionError
from minisgl.utils.procs import freeze_startup_heap
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

logger = logging.getLogger(__name__)
T = TypeVar("T")
PROMPT_TAIL = 8  # prompt tokens the detokenizer decodes the first output tokens after


def read_chat_template(value: str) -> str:
    """--chat-template's text: a file's, or the value itself when it looks like a template
    (vLLM's rule: it holds a brace or a newline); a path that does not exist is refused."""
    if os.path.isfile(value):
        try:
            with open(value) as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise OptionError("chat_template", f"cannot read {value!r}: {e}") from None
    if os.path.isdir(value):
        raise OptionError("chat_template", f"{value!r} is a directory, not a template file")
    if not any(c in value for c in "{}\n"):
        raise OptionError("chat_template", f"no such file {value!r}, and no template tags in it")
    return value


def load_chat_tokenizer(model_path: str, chat_template: str | None) -> Any | None:
    """The model's tokenizer (None: it has none) with --chat-template applied."""
    from minisgl.models.hf import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    if tokenizer is not None and chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def needed(tokenizer: Any | None) -> Any:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: send token ids instead of text")
    return tokenizer


def render_chat(
    tokenizer: Any,
    chat: list[dict],
    template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
) -> str:
    """The chat as the template renders it; `template_kwargs` (e.g. enable_thinking) go to it."""
    if not getattr(needed(tokenizer), "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    kwargs = {"add_generation_prompt": add_generation_prompt, **(template_kwargs or {})}
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(chat, **kwargs, tokenize=False)


def encode_chat(
    tokenizer: Any,
    chat: list[dict],
    template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
) -> list[int]:
    text = render_chat(tokenizer, chat, template_kwargs, add_generation_prompt, tools)
    return tokenizer.encode(text, add_special_tokens=False)  # the template has its own


def tokenize(tokenizer: Any, msg: TokenizeMsg) -> list[int]:
    if msg.input_ids is not None:
        ids = list(msg.input_ids)
    elif msg.chat is not None:
        ids = encode_chat(tokenizer, msg.chat, msg.chat_template_kwargs, True, msg.tools)
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


class ToApi:
    """The API processes' queues (--api-server-count): process k numbers its requests k, k + N,
    k + 2N..., so a reply goes to uid % N; the scheduler's stats go to every one."""

    def __init__(self, queues: list[Any]) -> None:
        self.queues = queues

    def replies(self, replies: list[UserReply], stats: SchedulerStats | None = None) -> None:
        groups: list[list[UserReply]] = [[] for _ in self.queues]
        for reply in replies:
            groups[reply.uid % len(self.queues)].append(reply)
        for queue, group in zip(self.queues, groups):
            if group or stats is not None:
                queue.put(BatchFrontendMsg(group, stats))

    def flush_reply(self, msg: FlushCacheReply) -> None:
        if 0 <= msg.api_rank < len(self.queues):
            self.queues[msg.api_rank].put(msg)
        else:
            logger.error("dropped a /flush_cache answer for API process %d", msg.api_rank)


class TokenizerWorker:
    """Tokenizes each request and sends it on to the detokenizer and the scheduler, or answers
    its error (a bad chat template input fails only its request)."""

    def __init__(self, tokenizer: Any, to_sched: list[Any], to_detok: Any, to_api: list[Any]):
        self.tokenizer, self.to_scheds, self.to_detok = tokenizer, to_sched, to_detok
        self.to_api = ToApi(to_api)

    def handle(self, msg: Any) -> None:
        if isinstance(msg, AbortMsg):  # same pipe as the request: never overtakes it
            self.to_scheds[0].put(AbortBackendMsg(msg.uid))
        elif isinstance(msg, TokenizeMsg):
            self.forward(msg, lambda: tokenize(self.tokenizer, msg))
        elif not isinstance(msg, DoneMsg):  # (DoneMsg: for --dp's dispatcher)
            logger.error("tokenizer: dropped an unexpected %s message", type(msg).__name__)

    def forward(self, msg: TokenizeMsg, token_ids: Callable[[], list[int]]) -> None:
        try:
            ids = token_ids()
        except Exception as e:  # a bad chat template input etc.: fail this request only
            return self.fail(msg.uid, e)
        self.send(msg, ids, 0)

    def send(self, msg: TokenizeMsg, ids: list[int], rank: int) -> None:
        """The tokenized request to replica `rank`'s scheduler, and how to detokenize it."""
        params, tail = msg.params, ids[-PROMPT_TAIL:]
        stop, skip = list(params.stop), msg.skip_special_tokens
        self.to_detok.put(
            DetokInitMsg(msg.uid, len(ids), tail, stop, skip, params.min_tokens, rank)
        )
        self.to_scheds[rank].put(UserMsg(msg.uid, ids, params))

    def fail(self, uid: int, error: Exception) -> None:
        self.to_api.replies([UserReply(uid, "", [], True, "error", 0, 0, str(error))])

    def serve(self, recv: Any) -> None:
        while not isinstance(msg := recv.get(), ExitMsg):
            self.handle(msg)


def build_or_report(name: str, ready: Any, build: Callable[[], T]) -> T:
    """Build a worker's parts, then tell the launcher 'ready' or why the start failed."""
    try:
        parts = build()
    except Exception as e:
        ready.send(("error", f"{name} failed to start: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    freeze_startup_heap()
    ready.send(("ready", None))
    return parts


def run_tokenizer(
    model_path: str,
    chat_template: str | None,
    recv_addr: str,
    sched_addrs: list[str],
    detok_addr: str,
    api_addrs: list[str],
    ready: Any,
    worker: Callable[..., TokenizerWorker] = TokenizerWorker,
) -> None:
    """`sched_addrs`: one per --dp replica; `worker`: the launcher's (`tokenizer_worker`)."""

    def build() -> tuple[ZmqPullQueue, TokenizerWorker]:
        tokenizer = load_chat_tokenizer(model_path, chat_template)
        scheds = [ZmqPushQueue(a, create=False) for a in sched_addrs]
        apis = [ZmqPushQueue(a, create=False) for a in api_addrs]
        detok = ZmqPushQueue(detok_addr, create=False)
        return ZmqPullQueue(recv_addr, create=True), worker(tokenizer, scheds, detok, apis)

    recv, tokenizer_worker = build_or_report("tokenizer", ready, build)
    tokenizer_worker.serve(recv)
