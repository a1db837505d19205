"""Tokenizer and detokenizer worker processes."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from minisgl.extension import extensions, require
from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BatchDetokenizeMsg,
    BatchFrontendMsg,
    DetokenizeMsg,
    DetokInitMsg,
    DoneMsg,
    ExitMsg,
    FlushCacheReply,
    SchedulerStats,
    TokenizeMsg,
    UserMsg,
    UserReply,
)
from minisgl.tokenizer.detokenize import IncrementalDetokenizer, named_logprobs
from minisgl.utils.options import OptionError
from minisgl.utils.procs import freeze_startup_heap
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

logger = logging.getLogger(__name__)
T = TypeVar("T")
PROMPT_TAIL = 8
# a prompt longer than this (characters) is tokenized on a thread, so that others go on meanwhile
BACKGROUND_CHARS = 65536
POLL_S = 0.005  # meanwhile, how often the worker looks for its end
NORMALIZER_SLACK = 2  # see check_prompt_size


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


def read_chat_template(value: str) -> str:
    """--chat-template's text: an existing file's, else the value itself when it looks like a
    template (vLLM's rule: it holds a brace or a newline); otherwise it is a path that does not
    exist, refused rather than sent to the model as a literal template."""
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
    """The model's tokenizer with --chat-template (read_chat_template) applied."""
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
    template_kwargs: dict | None,
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
) -> str:
    """The chat as the template renders it (text); `tools` as transformers takes them."""
    needed(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    # the client's kwargs (e.g. enable_thinking) go to the template; it must return text here
    kwargs = {"add_generation_prompt": add_generation_prompt, **(template_kwargs or {})}
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(chat, **kwargs, tokenize=False)


def encode_chat(
    tokenizer: Any,
    chat: list[dict],
    template_kwargs: dict | None,
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
) -> list[int]:
    text = render_chat(tokenizer, chat, template_kwargs, add_generation_prompt, tools)
    return tokenizer.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=4)
def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token stands for: its longest vocabulary entry (a
    byte-level entry has a character per byte, so this bounds the UTF-8 bytes too)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def check_prompt_size(tokenizer: Any, chars: int, max_seq_len: int | None) -> None:
    """Refuse, before tokenizing it, a prompt of `chars` characters that cannot fit in
    `max_seq_len` tokens whatever they are: tokenizing it would hold up every request behind it
    (15 MB take ~15 s) only to be refused. NORMALIZER_SLACK keeps a tokenizer whose normalizer
    composes characters (NFC) from refusing a prompt that would fit."""
    if tokenizer is None or max_seq_len is None:
        return
    per_token = max_token_chars(tokenizer)
    limit = max_seq_len * per_token * NORMALIZER_SLACK
    if chars > limit:
        raise ValueError(
            f"prompt ({chars} characters) is too long for the context of {max_seq_len} tokens: "
            f"a token is at most {per_token} characters, so at most {limit} characters "
            "are tokenized"
        )


def prompt_chars(msg: TokenizeMsg) -> int:
    """The characters of a text prompt, or of a chat's contents (its template adds to them)."""
    if msg.text is not None:
        return len(msg.text)
    # earlier tool calls and the tools' schemas are rendered too: counted as their JSON
    calls = [m["tool_calls"] for m in msg.chat or [] if m.get("tool_calls")]
    structured = len(json.dumps([calls, msg.tools])) if calls or msg.tools else 0
    return structured + sum(len(m.get("content") or "") for m in msg.chat or [])


def tokenize(tokenizer: Any, msg: TokenizeMsg) -> list[int]:
    if msg.input_ids is not None:
        ids = list(msg.input_ids)
    elif msg.chat is not None:
        ids = encode_chat(tokenizer, msg.chat, msg.chat_template_kwargs, True, msg.tools)
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


class ToApi:
    """The API processes' queues (one per --api-server-count): a request's replies go to the
    process that took it (process k numbers its requests k, k + N, k + 2N...); the scheduler's
    stats go to every one (their /stats, /metrics and watchdogs read them); a /flush_cache
    answer to the one that asked. `queues`: one queue, or the list of them."""

    def __init__(self, queues: Any) -> None:
        self.queues = queues if isinstance(queues, list) else [queues]

    def replies(self, replies: list[UserReply], stats: SchedulerStats | None = None) -> None:
        n = len(self.queues)
        if n == 1:
            self.queues[0].put(BatchFrontendMsg(replies, stats))
            return
        groups: list[list[UserReply]] = [[] for _ in range(n)]
        for reply in replies:
            groups[reply.uid % n].append(reply)
        for queue, group in zip(self.queues, groups):
            if group or stats is not None:
                queue.put(BatchFrontendMsg(group, stats))

    def flush_reply(self, msg: FlushCacheReply) -> None:
        if 0 <= msg.api_rank < len(self.queues):
            self.queues[msg.api_rank].put(msg)
        else:
            logger.error("dropped a /flush_cache answer for API process %d", msg.api_rank)


class TokenizerWorker:
    """The tokenizer process's work: tokenize each request and hand it to the detokenizer and
    the scheduler, or answer its error. A long prompt is tokenized on a thread (the fast
    tokenizers release the GIL) while the requests behind it go on; an abort of such a request
    drops it when its tokens are ready, so that the abort never overtakes its request.
    `to_sched`: the scheduler's queue, or with --dp > 1 a list of the replicas' queues; then
    `dispatcher` (the serving extension's `dispatcher` point) picks one per request."""

    def __init__(
        self,
        tokenizer: Any,
        to_sched: Any,
        to_detok: Any,
        to_api: Any,
        dispatcher: Any = None,
    ) -> None:
        self.tokenizer, self.to_detok, self.to_api = tokenizer, to_detok, ToApi(to_api)
        self.to_scheds = to_sched if isinstance(to_sched, list) else [to_sched]
        self.dispatcher = dispatcher
        self.background = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.pending: dict[int, tuple[TokenizeMsg, Future[list[int]]]] = {}  # on the thread
        self.aborted: set[int] = set()  # of those, the ones whose client has left

    def handle(self, msg: Any) -> None:
        if isinstance(msg, AbortMsg):
            if msg.uid in self.pending:
                self.aborted.add(msg.uid)
            else:  # same pipe as the request: never overtakes it
                self.to_scheds[self._replica_of(msg.uid)].put(AbortBackendMsg(msg.uid))
                self._done(msg.uid)
        elif isinstance(msg, DoneMsg):
            self._done(msg.uid)
        elif not isinstance(msg, TokenizeMsg):
            logger.error("tokenizer: dropped an unexpected %s message", type(msg).__name__)
        else:
            chars = prompt_chars(msg)
            try:
                check_prompt_size(self.tokenizer, chars, msg.max_seq_len)
            except ValueError as e:
                return self.fail(msg.uid, e)
            if chars > BACKGROUND_CHARS:
                future = self.background.submit(tokenize, self.tokenizer, msg)
                self.pending[msg.uid] = (msg, future)
            else:
                self.forward(msg, lambda: tokenize(self.tokenizer, msg))

    def forward_done(self) -> None:
        """Forward the requests whose tokenization on the thread has ended."""
        for uid, (msg, future) in list(self.pending.items()):
            if future.done():
                del self.pending[uid]
                if uid in self.aborted:
                    self.aborted.discard(uid)
                else:
                    self.forward(msg, future.result)

    def forward(self, msg: TokenizeMsg, token_ids: Callable[[], list[int]]) -> None:
        try:
            ids = token_ids()
        except Exception as e:  # a bad chat template input etc.: fail this request only
            return self.fail(msg.uid, e)
        tail, rank = ids[-PROMPT_TAIL:], 0
        if self.dispatcher is not None:
            rank = self.dispatcher.choose(ids) if msg.dp_rank is None else msg.dp_rank
            self.dispatcher.sent(msg.uid, rank, ids)
        stop, min_tokens, skip = (
            list(msg.params.stop),
            msg.params.min_tokens,
            msg.skip_special_tokens,
        )
        self.to_detok.put(DetokInitMsg(msg.uid, len(ids), tail, stop, skip, min_tokens, rank))
        self.to_scheds[rank].put(UserMsg(msg.uid, ids, msg.params))

    def _replica_of(self, uid: int) -> int:
        rank = None if self.dispatcher is None else self.dispatcher.replica_of(uid)
        return rank or 0

    def _done(self, uid: int) -> None:
        if self.dispatcher is not None:
            self.dispatcher.done(uid)

    def fail(self, uid: int, error: Exception) -> None:
        self.to_api.replies([UserReply(uid, "", [], True, "error", 0, 0, str(error))])


def run_tokenizer(
    model_path: str,
    chat_template: str | None,
    recv_addr: str,
    sched_addrs: list[str],
    detok_addr: str,
    api_addrs: list[str],
    dispatch: tuple[int, str, int],
    ready: Any,
) -> None:
    """`sched_addrs`: one per --dp replica; `dispatch`: (page size, --dp-dispatch,
    --dp-load-threshold), used with more than one."""
    dispatcher = None
    if len(sched_addrs) > 1:  # --dp > 1, which ServerArgs allows only with the extension
        make = require(extensions().dispatcher, "--dp > 1", "serving")
        dispatcher = make(len(sched_addrs), *dispatch)
    recv, worker = build_or_report(
        "tokenizer",
        ready,
        lambda: (
            ZmqPullQueue(recv_addr, create=True),
            TokenizerWorker(
                load_chat_tokenizer(model_path, chat_template),
                [ZmqPushQueue(a, create=False) for a in sched_addrs],
                ZmqPushQueue(detok_addr, create=False),
                [ZmqPushQueue(a, create=False) for a in api_addrs],
                dispatcher,
            ),
        ),
    )
    while True:
        # while a prompt is tokenized on the thread, look for its end between messages
        msg = recv.get(POLL_S if worker.pending else None)
        if isinstance(msg, ExitMsg):
            worker.background.shutdown(wait=False, cancel_futures=True)
            return
        if msg is not None:
            worker.handle(msg)
        worker.forward_done()


@dataclass
class _DetokState:
    detok: IncrementalDetokenizer | None  # None: no tokenizer (ids only), or it failed here
    prompt_len: int
    completion_tokens: int = 0
    stopped: bool = False  # a stop string ended it; the scheduler was told to abort
    dp_rank: int = 0  # its replica


@dataclass
class Detokenizer:
    tokenizer: Any
    to_api: ToApi
    to_sched: Any  # the scheduler's queue, or with --dp > 1 the list of the replicas'
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
            self.states[msg.uid] = _DetokState(None, msg.prompt_len, dp_rank=msg.dp_rank)
            ended = any(m.finished for m in self.early.pop(msg.uid, []))
            return [self._fail(msg.uid, ended, e)]
        self.states[msg.uid] = _DetokState(detok, msg.prompt_len, dp_rank=msg.dp_rank)
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
            self._abort(uid, st)
        reason = f"detokenizing failed: {type(error).__name__}: {error}"
        return UserReply(uid, "", [], True, "error", st.prompt_len if st else 0, 0, reason)

    def _abort(self, uid: int, st: _DetokState) -> None:
        """Tell the request's replica to stop generating for it."""
        queues = self.to_sched if isinstance(self.to_sched, list) else [self.to_sched]
        queues[st.dp_rank].put(AbortBackendMsg(uid))

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
            self._abort(msg.uid, st)
        elif finished:
            text += st.detok.finish() if st.detok else ""
            del self.states[msg.uid]
        reply = UserReply(
            msg.uid,
            text,
            msg.token_ids,
            finished,
            reason,
            st.prompt_len,
            st.completion_tokens,
            msg.error,
            queue_time=msg.queue_time,
            cached_tokens=msg.cached_tokens,
        )
        if reason == "stop" and st.detok is not None and st.detok.stopped:
            reply.matched = st.detok.stop_reason
        if msg.logprobs is not None:
            entries = [[t, *e] for t, e in zip(msg.token_ids, msg.logprobs)]
            reply.logprobs = named_logprobs(self.tokenizer, entries)
        if msg.prompt_logprobs is not None:
            reply.prompt_logprobs = named_logprobs(self.tokenizer, msg.prompt_logprobs)
        return reply


def run_detokenizer(
    model_path: str, recv_addr: str, api_addrs: list[str], sched_addrs: list[str], ready: Any
) -> None:
    from minisgl.models.hf import load_tokenizer

    recv, worker = build_or_report(
        "detokenizer",
        ready,
        lambda: (
            ZmqPullQueue(recv_addr, create=True),
            Detokenizer(
                load_tokenizer(model_path),
                ToApi([ZmqPushQueue(a, create=False) for a in api_addrs]),
                [ZmqPushQueue(a, create=False) for a in sched_addrs],
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
        elif isinstance(msg, FlushCacheReply):
            worker.to_api.flush_reply(msg)
            continue
        else:
            continue
        if replies or stats is not None:
            worker.to_api.replies(replies, stats)
