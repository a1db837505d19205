"""The serving extension's tokenizer worker (its launcher's `tokenizer_worker`): the core's, plus

- a prompt that cannot fit in the context whatever its tokens is refused before tokenizing
  (15 MB take ~15 s, holding up every request behind it);
- a long prompt is tokenized on a thread, so the requests behind it go on; its abort waits for
  its tokens, never overtaking it;
- with --dp > 1, each request's replica is picked by the dispatcher (`dispatch.py`), or named by
  SGLang's data_parallel_rank (`TokenizeMsg.dp_rank`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from minisgl.ext.serving.dispatch import Dispatcher
from minisgl.ext.serving.template import with_chat_template
from minisgl.message import AbortBackendMsg, AbortMsg, ExitMsg, TokenizeMsg, register
from minisgl.tokenizer.server import TokenizerWorker, tokenize

BACKGROUND_CHARS = 65536  # a longer prompt is tokenized on a thread while others go on
POLL_S = 0.005  # meanwhile, how often the worker looks for its end
NORMALIZER_SLACK = 2  # see check_prompt_size


@register
@dataclass
class DoneMsg:
    """API process -> its tokenizer worker: request `uid` has ended (it no longer counts in its
    replica's load)."""

    uid: int


@functools.lru_cache(maxsize=4)
def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token stands for: its longest vocabulary entry."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def check_prompt_size(tokenizer: Any, chars: int, max_seq_len: int | None) -> None:
    """Refuse a prompt of `chars` characters that cannot fit in `max_seq_len` tokens whatever
    they are, before tokenizing it. NORMALIZER_SLACK: a normalizer that composes characters
    (NFC) must not refuse one that fits."""
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
    """The characters of a text prompt, or of a chat (its tool calls and tools as JSON)."""
    if msg.text is not None:
        return len(msg.text)
    calls = [m["tool_calls"] for m in msg.chat or [] if m.get("tool_calls")]
    structured = len(json.dumps([calls, msg.tools])) if calls or msg.tools else 0
    return structured + sum(len(m.get("content") or "") for m in msg.chat or [])


class ServingTokenizerWorker(TokenizerWorker):
    """`dispatch`: (page size, --dp-dispatch, --dp-load-threshold), used with several replicas;
    `chat_template`: --chat-template's."""

    def __init__(
        self,
        tokenizer: Any,
        to_sched: list[Any],
        to_detok: Any,
        to_api: Any,
        dispatch: tuple[int, str, int] = (16, "prefix", 8),
        chat_template: str | None = None,
    ) -> None:
        tokenizer = with_chat_template(tokenizer, chat_template)
        super().__init__(tokenizer, to_sched, to_detok, to_api)
        self.dispatcher = Dispatcher(len(to_sched), *dispatch) if len(to_sched) > 1 else None
        self.background = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.pending: dict[int, tuple[TokenizeMsg, Future[list[int]]]] = {}  # on the thread
        self.aborted: set[int] = set()  # of those, the ones whose client has left

    def handle(self, msg: Any) -> None:
        if isinstance(msg, AbortMsg) and msg.uid in self.pending:
            self.aborted.add(msg.uid)
        elif isinstance(msg, AbortMsg):  # same pipe as the request: never overtakes it
            rank = self.dispatcher.replica_of(msg.uid) if self.dispatcher else 0
            self.to_scheds[rank or 0].put(AbortBackendMsg(msg.uid))
            self.done(msg.uid)
        elif isinstance(msg, DoneMsg):
            self.done(msg.uid)
        elif isinstance(msg, TokenizeMsg):
            chars = prompt_chars(msg)
            try:
                check_prompt_size(self.tokenizer, chars, msg.max_seq_len)
            except ValueError as e:
                return self.fail(msg.uid, e)
            if chars > BACKGROUND_CHARS:
                self.pending[msg.uid] = (msg, self.background.submit(tokenize, self.tokenizer, msg))
            else:
                super().handle(msg)
        else:
            super().handle(msg)

    def forward_done(self) -> None:
        """Forward the requests whose tokenization on the thread has ended."""
        for uid, (msg, future) in list(self.pending.items()):
            if future.done():
                del self.pending[uid]
                if uid in self.aborted:
                    self.aborted.discard(uid)
                else:
                    self.forward(msg, future.result)

    def send(self, msg: TokenizeMsg, ids: list[int], rank: int) -> None:
        if self.dispatcher is not None:
            rank = self.dispatcher.choose(ids) if msg.dp_rank is None else msg.dp_rank
            self.dispatcher.sent(msg.uid, rank, ids)
        super().send(msg, ids, rank)

    def done(self, uid: int) -> None:
        if self.dispatcher is not None:
            self.dispatcher.done(uid)

    def serve(self, recv: Any) -> None:
        while not isinstance(msg := recv.get(POLL_S if self.pending else None), ExitMsg):
            if msg is not None:  # (None: the poll for a prompt tokenized on the thread)
                self.handle(msg)
            self.forward_done()
        self.background.shutdown(wait=False, cancel_futures=True)


def tokenizer_worker(
    page_size: int, dp_dispatch: str, threshold: int, chat_template: str | None = None
) -> Callable[..., Any]:
    """The serving launcher's maker of tokenizer workers (sent to each worker's process)."""
    dispatch = (page_size, dp_dispatch, threshold)
    return functools.partial(ServingTokenizerWorker, dispatch=dispatch, chat_template=chat_template)
