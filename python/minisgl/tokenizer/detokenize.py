"""The detokenizer process: each request's tokens -> text deltas for the api server, never
broken UTF-8 and never part of a stop string (`IncrementalDetokenizer`, which `LLM` uses too)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minisgl.extension import extensions, require
from minisgl.message import (
    AbortBackendMsg,
    BatchMsg,
    DetokenizeMsg,
    DetokInitMsg,
    ExitMsg,
    UserReply,
)
from minisgl.tokenizer.server import PROMPT_CONTEXT
from minisgl.utils.procs import build_or_report, freeze_startup_heap
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

logger = logging.getLogger(__name__)


def partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `tags`."""
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
    starts = ((text.find(s, max(0, after - len(s) + 1)), s) for s in stops)  # ends past `after`
    found = [(i + len(s), i, s) for i, s in starts if i >= 0]  # (end, start, stop)
    return min(found)[1:] if found else None


class IncrementalDetokenizer:
    """A request's output tokens -> text deltas: together, the decode of all output ids, cut
    before the first stop string to complete (`stopped`, `stop_reason`). A token that ends
    inside a UTF-8 character waits for the one that completes it; text that may start a stop
    string waits until it completes or is ruled out."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stops = [s for s in (stop or []) if s]
        self.stopped = False
        self.stop_reason: str | None = None
        # the window (O(window) decoding per token): ids[:read] are decoded and emitted (as far
        # as UTF-8 goes), ids[read:] held
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:]) if prompt_ids else []
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith("\ufffd"):
            # the prompt ends inside a character: context would swallow the output's first bytes
            self._ids, self._read, self._prefix_text = [], 0, ""
        self._pending = ""  # UTF-8-final text held back because it may start a stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Feed output tokens; return the text that became final."""
        if self.stopped or not token_ids:
            return ""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):  # the last token ends mid-character: wait for the rest
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

    def _check_stop(self, delta: str, final: bool, after: int = 0) -> str:
        """The final part of held text + `delta`; a stop string counts if it ends past [:after]."""
        if not self.stops:
            return delta
        text = self._pending + delta
        # a stop string cannot start in text already emitted (it was never held back)
        found = find_stop(text, self.stops, after)
        if found is not None:
            self.stopped, self.stop_reason, self._pending = True, found[1], ""
            return text[: found[0]]
        held = 0 if final else partial_suffix(text, tuple(self.stops))
        self._pending = text[len(text) - held :]
        return text[: len(text) - held]


def request_detokenizer(
    tokenizer: Any, prompt_ids: list[int], skip: bool, stop: list[str], min_tokens: int
) -> IncrementalDetokenizer:
    """A request's detokenizer (with min_tokens, ext/sampling's)."""
    if min_tokens > 0 and any(stop):
        features = require(extensions().detokenize, "min_tokens", "sampling")
        return features.detokenizer(tokenizer, prompt_ids, skip, stop, min_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip, stop)


@dataclass
class _Request:
    detok: IncrementalDetokenizer | None  # None: no tokenizer (ids only)
    prompt_len: int
    dp_rank: int  # its replica
    completion_tokens: int = 0
    stopped: bool = False  # a stop string ended it; the scheduler was told to abort


@dataclass
class Detokenizer:
    """Each `DetokenizeMsg` -> a `UserReply`; a failure ends only its request, never the process."""

    tokenizer: Any
    to_api: Any  # the API process's queue (the launcher's `api_queue`)
    to_sched: list[Any]  # a queue per --dp replica
    states: dict[int, _Request] = field(default_factory=dict)
    early: dict[int, list[DetokenizeMsg]] = field(default_factory=dict)  # before their init

    def init(self, msg: DetokInitMsg) -> list[UserReply]:
        st = self.states[msg.uid] = _Request(None, msg.prompt_len, msg.dp_rank)
        try:
            if self.tokenizer is not None:
                args = (msg.prompt_tail, msg.skip_special_tokens, msg.stop, msg.min_tokens)
                st.detok = request_detokenizer(self.tokenizer, *args)
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
        if reason == "stop" and detok is not None:
            reply.matched = detok.stop_reason
        if msg.ext:  # the step features' values (log-probabilities)
            features = require(extensions().detokenize, "logprobs", "sampling")
            features.name_logprobs(self.tokenizer, msg, reply)
        return reply


def run_detokenizer(
    model_path: str,
    recv_addr: str,
    api_queue: Callable[[], Any],
    sched_addrs: list[str],
    ready: Any,
) -> None:
    from minisgl.models.hf import load_tokenizer  # without torch (launch's `_child_main`)

    def build() -> tuple[ZmqPullQueue, Detokenizer]:
        scheds = [ZmqPushQueue(a, create=False) for a in sched_addrs]
        detokenizer = Detokenizer(load_tokenizer(model_path), api_queue(), scheds)
        return ZmqPullQueue(recv_addr, create=True), detokenizer

    recv, worker = build_or_report("detokenizer", ready, build)
    freeze_startup_heap()
    ready.send(("ready", None))
    while not isinstance(msg := recv.get(), ExitMsg):
        if isinstance(msg, DetokInitMsg):
            if replies := worker.init(msg):
                worker.to_api.put(BatchMsg(replies))
        elif isinstance(msg, BatchMsg):
            replies = [r for m in msg.msgs if (r := worker.guarded(m))]
            if replies or msg.stats is not None:
                worker.to_api.put(BatchMsg(replies, msg.stats))
        else:  # an extension's answer (ext/serving's /flush_cache), in order after the stats
            worker.to_api.put(msg)
