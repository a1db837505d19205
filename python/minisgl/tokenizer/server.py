"""Tokenizer and detokenizer worker processes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BatchDetokenizeMsg,
    BatchFrontendMsg,
    DetokenizeMsg,
    DetokInitMsg,
    ExitMsg,
    TokenizeMsg,
    UserMsg,
    UserReply,
)
from minisgl.tokenizer.detokenize import IncrementalDetokenizer
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

logger = logging.getLogger(__name__)
T = TypeVar("T")
PROMPT_TAIL = 8


def build_or_report(name: str, ready: Any, build: Callable[[], T]) -> T:
    """Build a worker's parts, then tell the launcher 'ready' or why the start failed."""
    try:
        parts = build()
    except Exception as e:
        ready.send(("error", f"{name} failed to start: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    ready.send(("ready", None))
    return parts


def load_chat_tokenizer(model_path: str, chat_template: str | None) -> Any | None:
    """The model's tokenizer with --chat-template applied: a file's text when the value names an
    existing file, else the value itself is the template."""
    from minisgl.models.hf import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    if tokenizer is not None and chat_template is not None:
        if os.path.isfile(chat_template):
            with open(chat_template) as f:
                chat_template = f.read()
        tokenizer.chat_template = chat_template
    return tokenizer


def needed(tokenizer: Any | None) -> Any:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: send token ids instead of text")
    return tokenizer


def encode_chat(
    tokenizer: Any, chat: list[dict], template_kwargs: dict | None, add_generation_prompt: bool
) -> list[int]:
    needed(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    # the client's kwargs (e.g. enable_thinking) go to the template; it must return text here
    kwargs = {"add_generation_prompt": add_generation_prompt, **(template_kwargs or {})}
    text = tokenizer.apply_chat_template(chat, **kwargs, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def tokenize(tokenizer: Any, msg: TokenizeMsg) -> list[int]:
    if msg.input_ids is not None:
        ids = list(msg.input_ids)
    elif msg.chat is not None:
        ids = encode_chat(tokenizer, msg.chat, msg.chat_template_kwargs, True)
    else:
        ids = needed(tokenizer).encode(msg.text)
    # vLLM's refusal, with the numbers (a prompt too long by itself: the scheduler's, which knows
    # whether the model or the KV pool sets the limit)
    limit, asked = msg.context_len, msg.params.max_tokens
    if limit is not None and len(ids) < limit < len(ids) + asked:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({asked}) = {len(ids) + asked} tokens is "
            f"longer than the context: at most {limit} tokens per request"
        )
    return ids


def run_tokenizer(
    model_path: str,
    chat_template: str | None,
    recv_addr: str,
    sched_addr: str,
    detok_addr: str,
    api_addr: str,
    ready: Any,
) -> None:
    tokenizer, recv, to_sched, to_detok, to_api = build_or_report(
        "tokenizer",
        ready,
        lambda: (
            load_chat_tokenizer(model_path, chat_template),
            ZmqPullQueue(recv_addr, create=True),
            ZmqPushQueue(sched_addr, create=False),
            ZmqPushQueue(detok_addr, create=False),
            ZmqPushQueue(api_addr, create=False),
        ),
    )
    while True:
        msg = recv.get()
        if isinstance(msg, ExitMsg):
            return
        if isinstance(msg, AbortMsg):
            to_sched.put(AbortBackendMsg(msg.uid))  # same pipe as the request: never overtakes it
            continue
        try:
            ids = tokenize(tokenizer, msg)
        except Exception as e:  # a bad chat template input etc.: fail this request only
            to_api.put(BatchFrontendMsg([UserReply(msg.uid, "", [], True, "error", 0, 0, str(e))]))
            continue
        tail = ids[-PROMPT_TAIL:]
        stop, min_tokens = list(msg.params.stop), msg.params.min_tokens
        to_detok.put(
            DetokInitMsg(msg.uid, len(ids), tail, stop, msg.skip_special_tokens, min_tokens)
        )
        to_sched.put(UserMsg(msg.uid, ids, msg.params))


@dataclass
class _DetokState:
    detok: IncrementalDetokenizer | None  # None: no tokenizer (ids only), or it failed here
    prompt_len: int
    completion_tokens: int = 0
    stopped: bool = False  # a stop string ended it; the scheduler was told to abort


@dataclass
class Detokenizer:
    tokenizer: Any
    to_api: ZmqPushQueue
    to_sched: ZmqPushQueue
    states: dict[int, _DetokState] = field(default_factory=dict)
    early: dict[int, list[DetokenizeMsg]] = field(default_factory=dict)

    def init(self, msg: DetokInitMsg) -> list[UserReply]:
        detok = None
        try:
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    msg.prompt_tail,
                    msg.skip_special_tokens,
                    msg.stop,
                    msg.min_tokens,
                )
        except Exception as e:
            self.states[msg.uid] = _DetokState(None, msg.prompt_len)
            ended = any(m.finished for m in self.early.pop(msg.uid, []))
            return [self._fail(msg.uid, ended, e)]
        self.states[msg.uid] = _DetokState(detok, msg.prompt_len)
        return [r for m in self.early.pop(msg.uid, []) if (r := self.guarded(m))]

    def guarded(self, msg: DetokenizeMsg) -> UserReply | None:
        """`tokens`, but a failure ends only this request (with an error), never the process."""
        try:
            return self.tokens(msg)
        except Exception as e:
            return self._fail(msg.uid, msg.finished, e)

    def _fail(self, uid: int, finished: bool, error: Exception) -> UserReply:
        logger.exception("detokenizing request %d failed", uid)
        st = self.states.get(uid)
        if finished or st is None:
            self.states.pop(uid, None)
        else:  # like a stop string: abort it; the abort's echo then drops the state
            st.stopped = True
            self.to_sched.put(AbortBackendMsg(uid))
        reason = f"detokenizing failed: {type(error).__name__}: {error}"
        return UserReply(uid, "", [], True, "error", st.prompt_len if st else 0, 0, reason)

    def tokens(self, msg: DetokenizeMsg) -> UserReply | None:
        st = self.states.get(msg.uid)
        if st is None:
            if msg.error is not None:  # refused by the scheduler; prompt size unknown here
                return UserReply(msg.uid, "", [], True, "error", 0, 0, msg.error)
            self.early.setdefault(msg.uid, []).append(msg)  # overtook its DetokInitMsg
            return None
        if st.stopped:  # tokens in flight when the stop string hit; the abort's echo ends it
            if msg.finished:
                del self.states[msg.uid]
            return None
        st.completion_tokens += len(msg.token_ids)
        text = st.detok.add(msg.token_ids) if st.detok else ""
        finished, reason = msg.finished, msg.finish_reason
        if st.detok is not None and st.detok.stopped and not finished:
            st.stopped, finished, reason = True, True, "stop"
            self.to_sched.put(AbortBackendMsg(msg.uid))
        elif finished:
            text += st.detok.finish() if st.detok else ""
            del self.states[msg.uid]
        return UserReply(
            msg.uid,
            text,
            msg.token_ids,
            finished,
            reason,
            st.prompt_len,
            st.completion_tokens,
            msg.error,
        )


def run_detokenizer(model_path: str, recv_addr: str, api_addr: str, sched_addr: str, ready) -> None:
    from minisgl.models.hf import load_tokenizer

    recv, worker = build_or_report(
        "detokenizer",
        ready,
        lambda: (
            ZmqPullQueue(recv_addr, create=True),
            Detokenizer(
                load_tokenizer(model_path),
                ZmqPushQueue(api_addr, create=False),
                ZmqPushQueue(sched_addr, create=False),
            ),
        ),
    )
    while True:
        msg = recv.get()
        if isinstance(msg, ExitMsg):
            return
        if isinstance(msg, DetokInitMsg):
            replies = worker.init(msg)
            stats = None
        elif isinstance(msg, BatchDetokenizeMsg):
            replies = [r for m in msg.msgs if (r := worker.guarded(m))]
            stats = msg.stats
        else:
            continue
        if replies or stats is not None:
            worker.to_api.put(BatchFrontendMsg(replies, stats))
