"""The detokenizer process: each request's tokens -> text deltas, never broken UTF-8 and never
part of a stop string (`IncrementalDetokenizer`, which `LLM` uses too), sent to the api server.

Two layers of holding back:
1. UTF-8: a token may end inside a multi-byte character, which decodes to a trailing "\ufffd";
   such tokens wait until a later one completes the character. Each step decodes only a window
   of recent tokens (prefix..end) and diffs it against the decode of prefix..read: O(window)
   per token, and tokenizers that treat the first token specially see the same context in both.
2. Stop strings: final text that could start a stop string waits until it is completed (the
   output stops before it) or ruled out.

min_tokens (vLLM's semantics): a stop string counts only if it ends in the text of a token after
the first min_tokens (one straddling the boundary counts, cut where it starts). Text belongs to
the token after which it decodes, as in vLLM: one that ends mid-character passes all its text on
to the token that completes the character (" 你" as " " + two bytes, then the last byte: the
space belongs to the second token).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from minisgl.message import (
    AbortBackendMsg,
    BatchDetokenizeMsg,
    DetokenizeMsg,
    DetokInitMsg,
    ExitMsg,
    FlushCacheReply,
    UserReply,
)
from minisgl.tokenizer.server import ToApi, build_or_report
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

logger = logging.getLogger(__name__)
_PROMPT_CONTEXT = 5  # prompt tokens decoded before the output, the context of its first word


def partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `tags` (text
    that may still become a stop string, withheld until it clearly is not one)."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def find_stop(text: str, stops: list[str], after: int = 0) -> tuple[int, str] | None:
    """The stop string that completes first past text[:after] (on a tie, the one that starts
    earlier): (where it starts, the stop string), or None."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for s in stops:
        i = text.find(s, max(0, after - len(s) + 1))  # ends past `after`
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    return None if best is None else (best[1], best[2])


class IncrementalDetokenizer:
    """A request's output tokens -> text deltas. Every `add` result and `finish()` together are
    the decode of all output ids (prompt context aside), cut before the first stop string to
    complete; then `stopped` is True, `stop_reason` is that string, and further calls return ""."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stops = [s for s in (stop or []) if s]
        self.stopped = False
        self.stop_reason: str | None = None
        self.min_tokens = min_tokens
        self._num_tokens = 0  # output tokens fed so far
        # the window: ids[:read] are decoded and emitted (as far as UTF-8 goes), ids[read:] held
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith("\ufffd"):
            # the prompt ends inside a character: context would swallow the output's first bytes
            self._ids, self._read, self._prefix_text = [], 0, ""
        self._pending = ""  # UTF-8-final text held back because it may start a stop string
        self._protected = 0  # _pending[:_protected] is text of the first min_tokens tokens
        # characters at the start of the next delta that the first min_tokens tokens decoded,
        # when the min_tokens-th token ended inside a character (so nothing was emitted then):
        # the text up to the last of them that did not end mid-character
        self._early = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _complete_len(self) -> int:
        """Length of the decode of the longest run of the window's ids that does not end
        mid-character: what per-token decoding (vLLM's) has emitted by now (a token that ends
        mid-character emits nothing, not even the characters it completes before that)."""
        for n in range(len(self._ids) - 1, self._read, -1):
            text = self._decode(self._ids[:n])
            if not text.endswith("\ufffd"):
                return len(text)
        return len(self._prefix_text)

    def add(self, token_ids: list[int]) -> str:
        """Feed new output tokens; return the text that became final."""
        if self.stopped or not token_ids:
            return ""
        boundary = self.min_tokens - self._num_tokens
        if 0 < boundary < len(token_ids):  # the text of the first min_tokens is checked apart
            return self.add(token_ids[:boundary]) + self.add(token_ids[boundary:])
        self._num_tokens += len(token_ids)
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):  # the last token ends mid-character: wait for the rest
            if self._num_tokens == self.min_tokens:  # (add splits chunks at min_tokens)
                self._early = self._complete_len() - len(self._prefix_text)
            return ""
        delta = text[len(self._prefix_text) :]
        # slide the window: what was read becomes the context of the next decode
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return self._check_stop(delta, final=False)

    def finish(self) -> str:
        """Flush everything held back (an unfinished character decodes as "\ufffd")."""
        if self.stopped:
            return ""
        delta = ""
        if len(self._ids) > self._read:
            delta = self._decode(self._ids)[len(self._prefix_text) :]
            self._ids, self._read, self._prefix_text = [], 0, ""
        return self._check_stop(delta, final=True)

    def _check_stop(self, delta: str, final: bool) -> str:
        if not self.stops:
            return delta
        text = self._pending + delta
        early, self._early = self._early, 0
        protected = len(text) if self._num_tokens <= self.min_tokens else self._protected + early
        # a stop string cannot start in text already emitted (that text was never held), so
        # searching the held text plus the new delta is enough
        found = find_stop(text, self.stops, after=protected)
        if found is not None:
            self.stopped, self.stop_reason, self._pending = True, found[1], ""
            return text[: found[0]]
        held = 0 if final else partial_suffix(text, tuple(self.stops))
        self._pending = text[len(text) - held :]
        self._protected = max(0, protected - (len(text) - held))
        return text[: len(text) - held]


def token_texts(tokenizer: Any | None, ids: list[int]) -> list[str]:
    """Each token's own text (special tokens included), as log-probability entries show it;
    without a tokenizer, vLLM's `token_id:N`."""
    if tokenizer is None:
        return [f"token_id:{i}" for i in ids]
    return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)


def named_logprobs(tokenizer: Any | None, entries: list[list[Any]]) -> list[list[Any]]:
    """[token id, logprob, top ids, top logprobs] entries -> [token id, text, logprob,
    [[id, text, logprob], ...]] (one batched decode for all of them)."""
    ids = [i for e in entries for i in (e[0], *e[2])]
    texts = iter(token_texts(tokenizer, ids))
    named = []
    for token, logprob, top_ids, top_logprobs in entries:
        text = next(texts)
        top = [[i, next(texts), lp] for i, lp in zip(top_ids, top_logprobs)]
        named.append([token, text, logprob, top])
    return named


@dataclass
class _Request:
    detok: IncrementalDetokenizer | None  # None: no tokenizer (ids only), or it failed here
    prompt_len: int
    dp_rank: int  # its replica
    completion_tokens: int = 0
    stopped: bool = False  # a stop string ended it; the scheduler was told to abort


@dataclass
class Detokenizer:
    """The detokenizer process's work: each `DetokenizeMsg` -> a `UserReply`; a failure ends
    only its request (with an error), never the process."""

    tokenizer: Any
    to_api: ToApi
    to_sched: list[Any]  # a queue per --dp replica
    states: dict[int, _Request] = field(default_factory=dict)
    early: dict[int, list[DetokenizeMsg]] = field(default_factory=dict)  # before their init

    def init(self, msg: DetokInitMsg) -> list[UserReply]:
        stop, skip = msg.stop, msg.skip_special_tokens
        self.states[msg.uid] = _Request(None, msg.prompt_len, msg.dp_rank)
        try:
            if self.tokenizer is not None:
                self.states[msg.uid].detok = IncrementalDetokenizer(
                    self.tokenizer, msg.prompt_tail, skip, stop, msg.min_tokens
                )
        except Exception as e:
            ended = any(m.finished for m in self.early.pop(msg.uid, []))
            return [self._fail(msg.uid, ended, e)]
        return [r for m in self.early.pop(msg.uid, []) if (r := self.guarded(m))]

    def guarded(self, msg: DetokenizeMsg) -> UserReply | None:
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
            self._abort(uid, st)
        reason = f"detokenizing failed: {type(error).__name__}: {error}"
        return UserReply(uid, "", [], True, "error", st.prompt_len if st else 0, 0, reason)

    def _abort(self, uid: int, st: _Request) -> None:
        st.stopped = True
        self.to_sched[st.dp_rank].put(AbortBackendMsg(uid))

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
        detok, finished, reason = st.detok, msg.finished, msg.finish_reason
        text = detok.add(msg.token_ids) if detok else ""
        if detok is not None and detok.stopped and not finished:
            finished, reason = True, "stop"
            self._abort(msg.uid, st)
        elif finished:
            text += detok.finish() if detok else ""
            del self.states[msg.uid]
        reply = UserReply(msg.uid, text, msg.token_ids, finished, reason, st.prompt_len, 0)
        reply.completion_tokens, reply.error = st.completion_tokens, msg.error
        reply.queue_time, reply.cached_tokens = msg.queue_time, msg.cached_tokens
        if reason == "stop" and detok is not None and detok.stopped:
            reply.matched = detok.stop_reason
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

    def build() -> tuple[ZmqPullQueue, Detokenizer]:
        apis = ToApi([ZmqPushQueue(a, create=False) for a in api_addrs])
        scheds = [ZmqPushQueue(a, create=False) for a in sched_addrs]
        return ZmqPullQueue(recv_addr, create=True), Detokenizer(
            load_tokenizer(model_path), apis, scheds
        )

    recv, worker = build_or_report("detokenizer", ready, build)
    while not isinstance(msg := recv.get(), ExitMsg):
        if isinstance(msg, DetokInitMsg):
            worker.to_api.replies(worker.init(msg))
        elif isinstance(msg, BatchDetokenizeMsg):
            replies = [r for m in msg.msgs if (r := worker.guarded(m))]
            worker.to_api.replies(replies, msg.stats)
        elif isinstance(msg, FlushCacheReply):
            worker.to_api.flush_reply(msg)
